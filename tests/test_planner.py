"""`llamarl plan`'s cost model alone (llamarl_core.planner): model shapes and memory
against hand-computed cases, monotonic in bandwidths and sizes over random
factors, sync = async where the overlap degenerates, the fit recovering known
factors, --choose, bad input named, and the command."""

import copy
import dataclasses
import itertools
import json
import math
import random
import re

import pytest

from helpers import llamarl_here
from llamarl_core.planner import (FACTORS, Calibration, CostModel, PlanError, Side, choose, describe, device, fit,
                                  from_row, leave_one_out, model_shape)
from llamarl_core.planner.cli import PAPER_RUNS, PUBLISHED_RUNS, SHIPPED_CALIBRATION, data_path
from llamarl_core.planner.cost import LengthDist, kv_per_token

GiB = 2**30
PUBLISHED = json.loads(data_path(PUBLISHED_RUNS).read_text())["runs"]
BY_MODEL = {row["model"]: row["hf_config"] for row in PUBLISHED}
FACTORS_MID = {"decode_bandwidth": 0.7, "generation_compute": 0.4, "decode_step_s": 0.004,
               "collective_latency_s": 2e-5, "train_mfu_dense": 0.4, "train_mfu_moe": 0.2, "link_efficiency": 0.5,
               "host_link_efficiency": 0.5, "step_overhead_s": 5.0, "length_shape": 1.5}

# Small configs whose counts are worked out by hand in the tests below.
DENSE = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": False}
MOE = {"model_type": "qwen3_moe", "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256,
       "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
       "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1000, "tie_word_embeddings": True}
MLA = {"model_type": "deepseek_v3", "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64,
       "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 4, "n_routed_experts": 4,
       "n_shared_experts": 1, "num_experts_per_tok": 2, "q_lora_rank": 64, "kv_lora_rank": 32,
       "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 500,
       "tie_word_embeddings": False}


def row(hf_config, *, mode="sync", gpus=8, gen_tp=1, trainer=None, batch=None, gpu="H100", **placement):
    place = {"mode": mode, "gpus": gpus, **placement}
    if mode == "async":
        place.setdefault("generator_gpus", gpus // 2)
        place.setdefault("trainer_gpus", gpus - place["generator_gpus"])
    return {"name": "case", "hf_config": hf_config, "gpu": gpu, "gpus_per_node": 8, "placement": place,
            "generator": {"tp": gen_tp, "dtype": "bf16"}, "trainer": {"tp": 1, "dtype": "bf16", **(trainer or {})},
            "batch": {"prompts": 8, "samples_per_prompt": 4, "train_global_batch": 32, "prompt_tokens": 100,
                      "mean_new_tokens": 500, "max_total_tokens": 2048, "logprob_passes": 2, **(batch or {})}}


def _activated(shape):
    """Parameters a token reaches, the input embedding counted as the model cards count it."""
    return shape.active_params + shape.vocab * shape.hidden


def test_parameter_counts_are_the_published_ones():
    llama = model_shape(BY_MODEL["Llama-3.1-8B"])
    assert abs(llama.total_params / 8.03e9 - 1) < 0.005
    dsv3 = model_shape(BY_MODEL["DeepSeek-V3"])
    assert abs(dsv3.total_params / 671e9 - 1) < 0.01 and abs(_activated(dsv3) / 37e9 - 1) < 0.03
    assert dsv3.mla and dsv3.moe_layers == 58
    qwen_moe = model_shape(BY_MODEL["Qwen3-235B-A22B"])
    assert abs(qwen_moe.total_params / 235e9 - 1) < 0.01 and abs(_activated(qwen_moe) / 22e9 - 1) < 0.03
    small = model_shape(BY_MODEL["Qwen3-30B-A3B"])
    assert abs(small.total_params / 30.5e9 - 1) < 0.01 and abs(_activated(small) / 3.3e9 - 1) < 0.03


# Published totals (and activated parameters, the input embedding counted) of other families the planner reads.
OTHERS = [
    ({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
      "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
      "vocab_size": 32000}, 46.7e9, 12.9e9),
    ({"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
      "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
      "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4, "vocab_size": 151936}, 14.3e9, 2.7e9),
    ({"model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
      "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
      "vocab_size": 50304}, 6.9e9, 1.3e9),
    ({"model_type": "gemma", "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
      "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "vocab_size": 256000}, 8.54e9, None),
    ({"model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
      "num_hidden_layers": 27, "first_k_dense_replace": 1, "num_attention_heads": 16, "kv_lora_rank": 512,
      "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
      "n_shared_experts": 2, "num_experts_per_tok": 6, "vocab_size": 102400}, 15.7e9, 2.4e9),
]


@pytest.mark.parametrize("config, total, activated", OTHERS, ids=[c["model_type"] for c, _, _ in OTHERS])
def test_other_families_count_as_published(config, total, activated):
    shape = model_shape(config)
    assert abs(shape.total_params / total - 1) < 0.02
    if activated:  # model cards count the input embedding, or not (DeepSeek-V2-Lite's 2.4B does not)
        assert min(abs(_activated(shape) / activated - 1), abs(shape.active_params / activated - 1)) < 0.05


def test_hand_counted_shapes():
    dense = model_shape(DENSE)
    # attention 4 x 1024^2, MLP 3 x 1024 x 4096, 8 layers, untied 32000 x 1024 embedding and head.
    assert dense.total_params == 8 * (4 * 1024**2 + 3 * 1024 * 4096) + 2 * 32000 * 1024 == 199_753_728
    moe = model_shape(MOE)
    # attention 512 x 512 x 2 + 512 x 256 x 2, router 512 x 8, experts 3 x 512 x 256, tied 1000 x 512.
    assert moe.total_params == 4 * 786_432 + 4 * 4_096 + 4 * 8 * 393_216 + 512_000 == 16_257_024
    assert moe.active_params == 4 * 786_432 + 4 * (4_096 + 2 * 393_216) + 512_000 == 6_819_840
    mla = model_shape(MLA)
    # q: 256 x 64 + 64 x 4 x 24; kv_a: 256 x (32 + 8); kv_b: 32 x 4 x (16 + 16); o: 4 x 16 x 256.
    assert mla.attn_params == 16_384 + 6_144 + 10_240 + 4_096 + 16_384
    assert mla.moe_layers == 1 and mla.kv_bytes_per_token_layer == 2 * (32 + 8)


def test_memory_against_hand_computed_cases():
    model = CostModel(FACTORS_MID)
    # Dense: trainer tp 2, pp 2 on 8 GPUs (dp 2): 199,753,728 / 4 parameters a GPU, 6 bytes each and 12 / 2
    # of optimizer state; activations of one 2048-token sequence split over tp: inputs kept 1024 x 1024 x 2 x
    # 4 layers x 2 micro-batches in flight, 34 x 1024 x 1024 of one layer, fp32 logits and gradient
    # 8 x 2048 x 16000.
    dense = from_row(row(DENSE, trainer={"tp": 2, "pp": 2}))
    params = 199_753_728 / 4
    expected = params * 6 + params * 12 / 2 + 1024 * 1024 * 2 * 4 * 2 + 34 * 1024 * 1024 + 8 * 2048 * 16000
    assert model.trainer_memory(dense) == pytest.approx(expected / GiB, rel=1e-12)
    # MoE: ep 4 on 4 GPUs (dp 4, experts not replicated): non-expert 3,674,112 a GPU (optimizer over 4),
    # experts 12,582,912 / 4 (optimizer unsharded).
    moe = from_row(row(MOE, gpus=4, trainer={"ep": 4}, batch={"train_global_batch": 32}))
    expected_state = 6 * (3_674_112 + 3_145_728) + 12 * (3_674_112 / 4 + 3_145_728)
    activations = 2048 * 512 * 2 * 4 + 34 * 2048 * 512 + 8 * 2048 * 1000
    assert model.trainer_memory(moe) == pytest.approx((expected_state + activations) / GiB, rel=1e-12)
    # KV per token: GQA 2 x 2 bytes x 8 heads x 128 x 32 layers, split over tp, a head a GPU beyond 8;
    # MLA's latent (32 + 8) x 2 bytes x 2 layers on every GPU.
    llama = BY_MODEL["Llama-3.1-8B"]
    for tp, expected in ((1, 131_072), (2, 65_536), (8, 16_384), (16, 16_384)):
        assert kv_per_token(from_row(row(llama, gpus=16, gen_tp=tp, trainer={"tp": 1}))) == expected
    assert kv_per_token(from_row(row(MLA, gen_tp=4))) == 160
    # A generator GPU holds its weights (8.03e9 x 2 bytes at tp 1), the KV cache its share fills and a reserve.
    assert model.generator_memory(from_row(row(llama, gpus=16))) > 8.03e9 * 2 / GiB


def test_length_distribution_against_the_closed_form():
    # Shape 1, E[min(X, c)] = theta (1 - exp(-c / theta)), means from 1e-4 of the cap to near it.
    for fraction in (1e-4, 1e-3, 0.01, 0.1, 0.5, 0.9, 0.98):
        dist = LengthDist(fraction * 32768, 32768, 1.0)
        assert dist.scale * (1 - math.exp(-32768 / dist.scale)) == pytest.approx(fraction * 32768, rel=2e-3)


def test_length_distribution_matches_its_mean_and_cap():
    rng = random.Random(0)
    for _ in range(50):
        cap = rng.uniform(100, 20000)
        mean = rng.uniform(0.02, 0.98) * cap
        shape = rng.uniform(0.5, 4)
        dist = LengthDist(mean, cap, shape)
        assert dist.mean == mean and abs(dist._integral(1) / mean - 1) < 1e-3
        assert mean**2 <= dist.second_moment <= cap * mean * (1 + 1e-3)
        assert dist.survival(cap) == 0
        # The longest of n reaches the cap once n sequences would put one above it.
        above = math.exp(-((cap / dist.scale) ** shape))
        if above > 1e-12:
            assert dist.longest(1.01 / above) == cap
            assert 0.99 / above < 2 or dist.longest(0.99 / above) < cap
        assert dist.longest(8) <= dist.longest(64) <= cap


def _factors(rng):
    out = {}
    for name, (lo, hi, _) in FACTORS.items():
        out[name] = lo + (hi - lo) * rng.uniform(0.05, 0.95)
    return out


def test_monotonic_in_bandwidths_and_sizes():
    rng = random.Random(1)
    bases = [from_row(r) for r in PUBLISHED[::3]]
    for trial in range(600):
        model = CostModel(_factors(rng))
        s = bases[trial % len(bases)]
        p = model.predict(s)
        for field, better in (("hbm_GBps", 1.5), ("nic_GBps", 2.0), ("nvlink_GBps", 2.0), ("host_GBps", 2.0),
                              ("bf16_tflops", 1.5)):
            faster = dataclasses.replace(s, device=dataclasses.replace(
                s.device, **{field: getattr(s.device, field) * better}))
            q = model.predict(faster)
            assert q.step_time_s <= p.step_time_s * (1 + 1e-12), field
            assert q.gen_time_s <= p.gen_time_s * (1 + 1e-12) and q.train_time_s <= p.train_time_s * (1 + 1e-12)
        for field, more in (("samples_per_prompt", 2), ("mean_new_tokens", 1.2)):
            bigger_batch = dataclasses.replace(s.batch, **{field: type(getattr(s.batch, field))(
                getattr(s.batch, field) * more)})
            if field == "samples_per_prompt":
                bigger_batch = dataclasses.replace(bigger_batch, train_global_batch=bigger_batch.samples)
            if bigger_batch.mean_new_tokens >= bigger_batch.cap:
                continue
            q = model.predict(dataclasses.replace(s, batch=bigger_batch))
            assert q.gen_time_s >= p.gen_time_s and q.train_time_s >= p.train_time_s, field
        if s.delta_fraction is None:
            q = model.predict(dataclasses.replace(s, delta_fraction=0.01))
            assert q.sync_time_s <= p.sync_time_s and q.step_time_s <= p.step_time_s
    # A deeper model of the same width costs more everywhere.
    model = CostModel(FACTORS_MID)
    shallow = model.predict(from_row(row(DENSE)))
    deep = model.predict(from_row(row({**DENSE, "num_hidden_layers": 16})))
    assert deep.gen_time_s > shallow.gen_time_s and deep.train_time_s > shallow.train_time_s
    assert deep.sync_time_s > shallow.sync_time_s


def test_each_phase_is_the_sum_of_its_parts():
    rng = random.Random(3)
    for trial in range(200):
        model = CostModel(_factors(rng))
        p = model.predict(from_row(PUBLISHED[trial % len(PUBLISHED)]))
        assert sum(p.breakdown["generation"].values()) == pytest.approx(p.gen_time_s, rel=1e-9)
        assert sum(p.breakdown["training"].values()) == pytest.approx(p.train_time_s, rel=1e-9)


def test_links_follow_the_node():
    h100 = device("H100")
    assert h100.link(8, 8) == 450e9 and h100.link(16, 8) == 50e9
    assert h100.link(8, 4) == 50e9 and h100.link(4, 4) == 450e9  # four GPUs a node: a tp-8 group crosses nodes
    gb200 = device("GB200")
    assert gb200.link(64, 4) == 900e9 and gb200.link(144, 4) == 100e9  # one NVL72 rack
    model = CostModel(FACTORS_MID)
    eight = from_row(row(BY_MODEL["Llama-3.1-8B"], gpus=16, gen_tp=8))
    four = dataclasses.replace(eight, gpus_per_node=4)
    assert model.predict(four).gen_time_s > model.predict(eight).gen_time_s


def test_deltas_price_only_the_syncs_between_nodes():
    model = CostModel(FACTORS_MID)
    within = from_row(row(BY_MODEL["Llama-3.1-8B"], mode="async", gpus=8))  # 4 + 4 on one node: written whole
    across = from_row(row(BY_MODEL["Llama-3.1-8B"], mode="async", gpus=16))
    for s, cheaper in ((within, False), (across, True)):
        delta = dataclasses.replace(s, delta_fraction=0.01)
        assert (model.sync(delta) < model.sync(s)) == cheaper
        assert any("delta sync" in line for line in model.predict(delta).assumptions)
    # A sync-mode trainer with pipeline stages spans every GPU: its copy crosses the nodes.
    staged = from_row(row(BY_MODEL["Llama-3.1-8B"], gpus=16, trainer={"pp": 2}))
    assert model.sync_span(staged) == 16 and model.sync_span(dataclasses.replace(
        staged, trainer=dataclasses.replace(staged.trainer, pp=1))) == 1


def test_sync_equals_async_where_nothing_overlaps():
    rng = random.Random(2)
    for trial in range(400):
        model = CostModel(_factors(rng))
        base = PUBLISHED[trial % len(PUBLISHED)]
        s = from_row(base)
        if s.mode != "async":
            continue
        overlapped = model.predict(s)
        none = model.predict(dataclasses.replace(s, max_staleness=0))
        sync = model.sync(s)
        assert overlapped.gen_time_s == none.gen_time_s and overlapped.train_time_s == none.train_time_s
        assert none.step_time_s == pytest.approx(none.gen_time_s + none.train_time_s + sync
                                                 + model.f["step_overhead_s"], rel=1e-12)
        assert overlapped.step_time_s == pytest.approx(max(none.gen_time_s, none.train_time_s) + sync
                                                       + model.f["step_overhead_s"], rel=1e-12)
        # The same sides in sync mode (both on one set of GPUs) take the same phase times; sync mode adds the swap.
        g = s.generator
        as_sync = s.with_placement("sync", g, dataclasses.replace(s.trainer, gpus=g.gpus)) \
            if g.gpus == s.trainer.gpus else None
        if as_sync is not None:
            p = model.predict(as_sync)
            assert p.gen_time_s == pytest.approx(none.gen_time_s, rel=1e-12)
            assert p.swap_time_s > 0 and none.swap_time_s == 0
            assert p.step_time_s == pytest.approx(p.gen_time_s + p.train_time_s + p.sync_time_s + p.swap_time_s
                                                  + model.f["step_overhead_s"], rel=1e-12)


def test_fit_recovers_known_factors_and_leave_one_out_predicts_held_runs():
    truth = dict(FACTORS_MID, train_mfu_dense=0.37, step_overhead_s=12.0)
    model = CostModel(truth)
    runs = [(s, model.predict(s).step_time_s) for s in (from_row(r) for r in PUBLISHED)]
    fixed = {k: v for k, v in truth.items() if k not in ("train_mfu_dense", "step_overhead_s")}
    calibration = fit(runs, "H100-SXM-80GB", fixed)
    assert calibration.factors["train_mfu_dense"] == pytest.approx(0.37, rel=1e-3)
    assert calibration.factors["step_overhead_s"] == pytest.approx(12.0, rel=1e-3)
    assert calibration.fit["median_abs_error"] < 1e-4
    held = leave_one_out(runs[:4], "H100-SXM-80GB", fixed)
    assert [r["name"] for r in held] == [s.name for s, _ in runs[:4]]
    assert all(abs(r["error"]) < 1e-3 for r in held)
    assert leave_one_out(runs[:3], "H100-SXM-80GB", fixed, workers=2) == leave_one_out(
        runs[:3], "H100-SXM-80GB", fixed)  # processes or not: the same refits


def test_shipped_calibration_is_the_fit_of_the_published_runs():
    calibration = Calibration.load(data_path(SHIPPED_CALIBRATION))
    for name, value in calibration.factors.items():
        lo, hi, _ = FACTORS[name]
        assert lo <= value <= hi
    model = calibration.model()
    errors = [model.predict(from_row(r)).step_time_s / r["measured"]["step_time_s"] - 1 for r in PUBLISHED]
    median = sorted(abs(e) for e in errors)
    assert (median[4] + median[5]) / 2 == pytest.approx(calibration.fit["median_abs_error"], rel=1e-9)
    loo = calibration.fit["leave_one_out"]
    assert [r["name"] for r in loo] == [r["name"] for r in PUBLISHED]
    assert calibration.fit["leave_one_out_median_abs_error"] <= 0.2


def test_choose_finds_placements_beyond_the_given_one():
    model = CostModel(FACTORS_MID)
    # A global batch of 12 rules out a trainer of one GPU a data-parallel rank on 8: the generator's
    # candidates are ranked without the trainer's checks.
    given = from_row(row(BY_MODEL["Llama-3.1-8B"], mode="async", gpus=16, trainer={"tp": 2},
                         batch={"train_global_batch": 12, "prompts": 3}))
    best = choose(model, given, top=6)
    assert len({describe(s) for s, _ in best}) == 6 and any(s != given for s, _ in best)
    for candidate, prediction in best:  # what it chose is no longer said to be assumed; the given's still is
        assert ("trainer pp 1" in prediction.assumptions) == (candidate is given)


def _brute_force(model, s):
    """The lowest predicted step over every placement the search spans, tried one by one."""
    from llamarl_core.planner.search import PIPELINES, POWERS, splits

    best = math.inf
    experts = [1] + [p for p in POWERS[1:] if s.model.moe and s.model.experts % p == 0]
    layouts = [("sync", 0, s.gpus, s.gpus)] + [("async", 1, g, s.gpus - g) for g in splits(s.gpus, 8)]
    for mode, staleness, gen_gpus, train_gpus in layouts:
        for gtp, ttp, pp, ep in itertools.product(POWERS, POWERS[:4], PIPELINES, experts):
            try:
                candidate = s.with_placement(mode, Side(gen_gpus, gtp), Side(train_gpus, ttp, pp, s.trainer.cp, ep),
                                             staleness)
                best = min(best, model.predict(candidate).step_time_s)
            except PlanError:
                continue
    return best


def test_choose_lands_within_a_percent_of_every_placement_tried():
    model = Calibration.load(data_path(SHIPPED_CALIBRATION)).model()
    for r in (PUBLISHED[0], PUBLISHED[6]):  # Llama-3.1-8B on 16 GPUs, Qwen3-30B-A3B on 32
        s = from_row(r)
        assert choose(model, s, top=1)[0][1].step_time_s <= 1.01 * _brute_force(model, s)


def test_choose_is_no_slower_than_the_given_placement():
    model = CostModel(FACTORS_MID)
    for r in PUBLISHED[::2]:
        s = from_row(r)
        best = choose(model, s, top=3)
        assert len(best) == 3
        assert best[0][1].step_time_s <= model.predict(s).step_time_s * (1 + 1e-12)
        assert [p.step_time_s for _, p in best] == sorted(p.step_time_s for _, p in best)
        for candidate, prediction in best:
            assert candidate.gpus == s.gpus
            assert model.predict(candidate).step_time_s == prediction.step_time_s


@pytest.mark.parametrize("change, culprit", [
    (lambda r: r["hf_config"].update(model_type="gpt_bigcode"), "model_type 'gpt_bigcode'"),
    (lambda r: r.update(gpu="A100"), "device 'A100'"),
    (lambda r: r["generator"].update(tp=3), "generator.tp 3"),
    (lambda r: r["trainer"].update(tp=5), "trainer tp x cp x pp = 5 does not divide"),
    (lambda r: (r["placement"].update(gpus=64), r["generator"].update(tp=64)), "generator.tp 64 does not divide the "
                                                                               "model's 32 attention heads"),
    (lambda r: r["trainer"].update(ep=2), "trainer.ep 2 on a dense model"),
    (lambda r: r["placement"].update(gpus=12), "train_global_batch 32 is not a multiple"),
    (lambda r: r["batch"].update(mean_new_tokens=5000), "batch.mean_new_tokens"),
    (lambda r: r["batch"].update(prompts=0), "batch.prompts"),
    (lambda r: r["trainer"].update(fsdp=2), "unknown field(s) ['fsdp']"),
    (lambda r: r.update(extra=1), "unknown field(s) ['extra']"),
    (lambda r: r.update(gpu="cpu"), "'cpu' has no published figures"),
    (lambda r: r["placement"].update(mode="colocated"), "placement.mode"),
    (lambda r: r.update(cluster={"nic_GBps": "fast"}), "cluster.nic_GBps must be a number of GB/s"),
    (lambda r: r.update(cluster={"nic_GBps": 0}), "cluster.nic_GBps must be a number of GB/s"),
    (lambda r: r["hf_config"].update(num_attention_heads=0), "num_attention_heads must be a positive integer"),
    (lambda r: r["hf_config"].update(hidden_size=-4096), "hidden_size must be a positive integer"),
    (lambda r: r["hf_config"].update(num_experts=4, num_experts_per_tok=8, model_type="qwen3_moe"),
     "num_experts_per_tok 8 is more than its 4 experts"),
    (lambda r: r.update(hf_config=[1, 2]), "hf_config must be a config object"),
    (lambda r: r.update(cluster={"nic_GBps": 1e-300}), "cluster.nic_GBps must be a number of GB/s"),
    (lambda r: r["batch"].update(train_global_batch=64), "train_global_batch 64 is more than the step's 32"),
    (lambda r: r["batch"].update(logprob_passes=True), "batch.logprob_passes must be 0, 1 or 2"),
    (lambda r: r["hf_config"].update(tie_word_embeddings="false"), "tie_word_embeddings must be true or false"),
    (lambda r: r["hf_config"].update(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                                     n_shared_experts="x"), "n_shared_experts must be an integer >= 0"),
    (lambda r: r.update(gpu="cpu", cluster={"nic_GBps": 10}), "its measured figures (device_specs) need"),
    (lambda r: r["generator"].update(dtype=["bf16"]), "generator.dtype ['bf16']: one of"),
    (lambda r: r["trainer"].update(dtype={}), "trainer.dtype {}: one of"),
    (lambda r: r["batch"].update(prompts=10**400), "batch.prompts must be a positive integer, at most 2**53"),
    (lambda r: r["batch"].update(mean_new_tokens=1e300), "batch.mean_new_tokens must be a positive number, at most"),
    (lambda r: r["hf_config"].update(hidden_size=10**400), "hidden_size must be a positive integer, at most 2**53"),
    (lambda r: r.update(hf_config={"text_config": "x"}), "hf_config: text_config must be an object, got str"),
    (lambda r: r["hf_config"].update(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                                     mlp_only_layers=5), "mlp_only_layers must be a list of layer indices, got 5"),
])
def test_bad_scenarios_are_named(change, culprit):
    bad = copy.deepcopy(row(BY_MODEL["Llama-3.1-8B"], gpus=16))
    change(bad)
    with pytest.raises(PlanError) as info:
        from_row(bad)
    assert culprit in str(info.value)


def test_a_config_file_that_is_not_a_json_object_is_named(tmp_path):
    for name, body in (("list.json", b"[1]"), ("binary.json", b"\xff\xfe\x00")):
        (tmp_path / name).write_bytes(body)
        with pytest.raises(PlanError, match=f"hf_config '{tmp_path / name}': "):
            model_shape(str(tmp_path / name))


def test_an_fp32_trainer_holds_fp32_weights_gradients_and_moments():
    """Memory follows the trainer's dtype: fp32 weights and gradients (8 bytes a
    parameter), the two moments sharded (8), inputs and the working set in fp32;
    mixed precision (bf16, fp16, fp8) as in the hand-computed cases above."""
    model = CostModel(FACTORS_MID)
    params = 199_753_728 / 4
    activations = {2: 1024 * 1024 * 2 * 4 * 2 + 34 * 1024 * 1024, 4: 1024 * 1024 * 4 * 4 * 2 + 68 * 1024 * 1024}
    logits = 8 * 2048 * 16000
    for dtype, state, width in (("fp32", params * 8 + params * 8 / 2, 4), ("bf16", params * 6 + params * 12 / 2, 2),
                                ("fp8", params * 6 + params * 12 / 2, 2)):
        s = from_row(row(DENSE, trainer={"tp": 2, "pp": 2, "dtype": dtype}))
        assert model.trainer_memory(s) == pytest.approx((state + activations[width] + logits) / GiB, rel=1e-12)


def test_calibrations_and_factors_of_the_wrong_shape_are_named(tmp_path):
    shipped = json.loads(data_path(SHIPPED_CALIBRATION).read_text())
    cases = [
        (lambda c: c["fit"].update(held=5), "fit.held must list factors of"),
        (lambda c: c["fit"].update(held=[["x"]]), "fit.held must list factors of"),
        (lambda c: c["fit"].update(leave_one_out=5), "fit.leave_one_out must be a list of objects"),
        (lambda c: c["fit"]["leave_one_out"][0].update(predicted_s="x"), "fit.leave_one_out must be a list"),
        (lambda c: c["fit"]["leave_one_out"][0].update(error=float("nan")), "fit.leave_one_out must be a list"),
        (lambda c: c.update(device="foo"), "device 'foo' is not in the planner's table"),
        (lambda c: c.update(device=["H100"]), "device must be a device's name"),
        (lambda c: c["factors"].pop("length_shape"), "factors: missing ['length_shape']"),
        (lambda c: c["factors"].update(decode_bandwidth=0), "factor decode_bandwidth = 0 is outside"),
    ]
    assert shipped["fit"]["leave_one_out"], "the shipped calibration has leave-one-out entries to break"
    for change, culprit in cases:
        bad = copy.deepcopy(shipped)
        change(bad)
        path = tmp_path / "cal.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(PlanError) as info:
            Calibration.load(path)
        assert str(info.value).startswith(f"--calibration {path}: ") and culprit in str(info.value), str(info.value)
    cpu_specs = {"bf16_tflops": 1, "fp8_tflops": 1, "hbm_GBps": 10, "memory_GiB": 16, "nvlink_GBps": 5,
                 "nic_GBps": 1, "host_GBps": 5}
    for specs, culprit in (({**cpu_specs, "memory_GiB": True}, "missing or not a positive number: ['memory_GiB']"),
                           ({**cpu_specs, "hbm_GBps": float("inf")}, "missing or not a positive number: ['hbm_GBps']"),
                           ({**cpu_specs, "nvlink_domain": "x"}, "nvlink_domain must be a positive integer"),
                           ({**cpu_specs, "nvlink_domain": -5}, "nvlink_domain must be a positive integer")):
        with pytest.raises(PlanError, match=re.escape(culprit)):
            device("cpu", specs)
    assert device("cpu", {**cpu_specs, "nvlink_domain": 4}).nvlink_domain == 4
    with pytest.raises(PlanError, match=r"factor decode_bandwidth = nan is outside"):
        CostModel({**FACTORS_MID, "decode_bandwidth": float("nan")})
    for top in (0, -1, True, 1.5):
        with pytest.raises(PlanError, match="top must be a positive integer"):
            choose(CostModel(FACTORS_MID), from_row(PUBLISHED[0]), top=top)


def test_choose_keeps_the_assumptions_it_did_not_choose():
    """The search chooses the trainer's pp and ep, keeps its cp as given: a cp the
    row left out stays an assumption of every placement it returns."""
    given = from_row(row(BY_MODEL["Llama-3.1-8B"], gpus=16))
    assert ("trainer.cp", "trainer cp 1") in given.assumptions
    found = choose(CostModel(FACTORS_MID), given, top=50)
    assert len(found) > 5 and any(candidate is given for candidate, _ in found)
    for candidate, _ in found:
        assert ("trainer.cp", "trainer cp 1") in candidate.assumptions
        chosen = {key for key, _ in candidate.assumptions} & {"trainer.pp", "trainer.ep"}
        assert chosen == (set() if candidate is not given else {"trainer.pp", "trainer.ep"}), candidate.assumptions


def test_a_model_of_any_depth_is_counted_at_once():
    """Routed layers are counted, not walked: 2**50 layers take no longer than 8."""
    qwen = model_shape({**MOE, "num_hidden_layers": 2**50, "decoder_sparse_step": 2, "mlp_only_layers": [1, 2, 5]})
    assert qwen.moe_layers == 2**49 - 2  # layers 1, 3, 5, ... route; 1 and 5 of them are dense by mlp_only_layers
    deepseek = model_shape({**MLA, "num_hidden_layers": 2**50, "moe_layer_freq": 3, "first_k_dense_replace": 4})
    assert deepseek.moe_layers == len(range(6, 2**50, 3))


def test_placements_that_do_not_fit_are_refused_naming_what_overflows():
    model = CostModel(FACTORS_MID)
    big = {**BY_MODEL["Llama-3.1-8B"], "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
           "num_attention_heads": 128}
    with pytest.raises(PlanError, match="generator's weights"):
        model.predict(from_row(row(big, gpus=64, gen_tp=1, trainer={"tp": 8, "pp": 8})))
    with pytest.raises(PlanError, match="the trainer needs"):
        model.predict(from_row(row(big, gpus=64, gen_tp=16, trainer={"tp": 1, "pp": 1},
                                   batch={"train_global_batch": 64, "prompts": 16})))
    # Every published run fits.
    for r in PUBLISHED:
        model.predict(from_row(r))
    assert device("h100").name == "H100-SXM-80GB"


def test_plan_command(tmp_path):
    one = tmp_path / "one.json"
    one.write_text(json.dumps(PUBLISHED[1]))
    result = llamarl_here("plan", str(one), "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert {"step_time_s", "gen_time_s", "train_time_s", "sync_time_s", "memory_gib_per_gpu", "bottleneck",
            "assumptions"} <= set(out)
    assert set(out["memory_gib_per_gpu"]) == {"generator", "trainer"}
    model = Calibration.load(data_path(SHIPPED_CALIBRATION)).model()
    assert out["step_time_s"] == model.predict(from_row(PUBLISHED[1])).step_time_s
    table = llamarl_here("plan", str(data_path(PUBLISHED_RUNS)))
    assert table.returncode == 0 and "absolute error: median" in table.stdout
    chosen = llamarl_here("plan", str(one), "--choose", "--top", "2", "--json")
    assert chosen.returncode == 0 and len(json.loads(chosen.stdout)["best"]) == 2
    alone = llamarl_here("plan", str(one), "--top", "2")  # --top without --choose would print nothing more
    assert alone.returncode == 2 and "--top says how many placements --choose prints: it needs --choose" in alone.stderr
    paper = llamarl_here("plan", "--paper", "--json")
    assert paper.returncode == 0
    papers = json.loads(paper.stdout)
    assert len(papers["llamarl"]) == len(json.loads(data_path(PAPER_RUNS).read_text())["runs"])
    assert all(r["leave_one_out_step_time_s"] for r in papers["nemo_rl"])
    refit = {r["model"]: r for r in papers["weight_refit"]}
    assert refit["DeepSeek-V3"]["predicted_s"] > 0 and refit["Qwen3-4B"]["predicted_s"] > 0
    assert refit["Qwen3.5-397B"]["predicted_s"] is None
    # Bad input: one line naming it, exit status 2.
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**PUBLISHED[0], "gpu": "TPUv5"}))
    result = llamarl_here("plan", str(bad))
    assert result.returncode == 2 and "device 'TPUv5'" in result.stderr
    result = llamarl_here("plan", str(tmp_path / "missing.json"))
    assert result.returncode == 2 and "SCENARIO" in result.stderr
    # --choose where the given placement does not fit: said, and the placements that do.
    tight = tmp_path / "tight.json"
    tight.write_text(json.dumps({**PUBLISHED[2], "generator": {"tp": 8, "dtype": "bf16"}}))
    result = llamarl_here("plan", str(tight), "--choose", "--json")
    assert result.returncode == 0, result.stderr
    chosen = json.loads(result.stdout)
    assert "raise generator.tp" in chosen["given"]["does_not_fit"] and chosen["best"]
    bad_runs = tmp_path / "bad_runs.json"
    bad_runs.write_text(json.dumps({"runs": [5]}))
    result = llamarl_here("plan", "fit", str(bad_runs), "-o", str(tmp_path / "x.json"))
    assert result.returncode == 2 and "runs[0] is not a row" in result.stderr
    result = llamarl_here("plan", "fit", str(bad_runs), "-o", str(tmp_path / "no" / "x.json"))
    assert result.returncode == 2 and "its folder does not exist" in result.stderr
    result = llamarl_here("plan", "fit", str(bad_runs), "-o", str(tmp_path))  # before any fit
    assert result.returncode == 2 and f"-o {tmp_path}: a folder; name the calibration JSON" in result.stderr
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"runs": []}))
    for args in (["plan", str(empty)], ["plan", str(empty), "--json"],
                 ["plan", "fit", str(empty), "-o", str(tmp_path / "e.json")]):
        result = llamarl_here(*args)
        assert result.returncode == 2 and f"{empty}: runs holds no row" in result.stderr, result.stderr
    for measured in (5, {"step_time_s": float("inf")}, {"step_time_s": float("nan")}, {"step_time_s": -1}):
        bad_runs.write_text(json.dumps({"runs": [{**PUBLISHED[0], "measured": measured}, PUBLISHED[1]]}))
        result = llamarl_here("plan", "fit", str(bad_runs), "-o", str(tmp_path / "m.json"), "--no-leave-one-out")
        assert result.returncode == 2 and "measured.step_time_s must be a positive number" in result.stderr
        assert "Traceback" not in result.stderr and not (tmp_path / "m.json").exists()
    # A fit without leave-one-out on two runs writes a calibration that loads.
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps({"runs": PUBLISHED[:2]}))
    result = llamarl_here("plan", "fit", str(runs), "-o", str(tmp_path / "cal.json"), "--no-leave-one-out")
    assert result.returncode == 0, result.stderr
    assert "train_mfu_moe" in result.stdout and "(held, not fit)" in result.stdout
    assert "warning: 2 runs for" in result.stdout
    held = Calibration.load(tmp_path / "cal.json")
    assert held.factors["train_mfu_moe"] == 0.2 and held.factors["collective_latency_s"] == 2e-5
    moe = held.model().predict(from_row(PUBLISHED[6]))
    assert any("train_mfu_moe held at 0.2" in line for line in moe.assumptions)
