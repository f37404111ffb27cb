"""Layouts, presets and the planner, executed in one process against plain torch."""

import collections
import dataclasses
import itertools
import random
import zlib

import pytest
import torch
import transformers

from helpers import CONFIG_KINDS, MODEL_CLASSES, hf_state_dict, local_tensors, random_placement, small_config
from sync_checks import mismatches, poisoned_destination
from llamarl_core.sync import Fused, Layout, ParamSpec, Replicate, Shard, plan_transfer
from llamarl_core.sync.layout import FusedPart
from llamarl_core.sync.plan import bipartite_rounds
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp
from llamarl_core.sync.reference import reference_fsdp_shards, reference_vllm_fp8_shards, reference_vllm_tp_shards


@pytest.mark.parametrize("kind", CONFIG_KINDS)
def test_hf_preset_matches_the_real_model(kind):
    config = small_config(kind)
    model = MODEL_CLASSES[config.model_type](config)
    layout = hf_llama_fsdp(config, 3, torch.float32)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == {n: s.shape for n, s in layout.params.items()}
    for name, p in model.named_parameters():
        pieces = torch.chunk(p, 3)
        for rank in range(3):
            expected = tuple(pieces[rank].shape) if rank < len(pieces) else (0, *p.shape[1:])
            assert layout.local_shape(name, rank) == expected, (name, rank)


@pytest.mark.parametrize("kind", CONFIG_KINDS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vllm_preset_local_shapes_match_the_reference(kind, tp):
    config = small_config(kind)
    ref = reference_vllm_tp_shards(hf_state_dict(config, 0), config, tp, torch.bfloat16)
    layout = vllm_llama_tp(config, tp, torch.bfloat16)
    for rank in range(tp):
        assert {n: layout.local_shape(n, rank) for n in layout.params} == {n: tuple(t.shape) for n, t in ref[rank].items()}
    assert ("lm_head.weight" in layout.params) == (not config.tie_word_embeddings)
    assert layout.local_shape("model.embed_tokens.weight", 0)[0] == 1024 // tp  # 1001 padded to 1024


MATRIX = list(itertools.product(CONFIG_KINDS, [1, 2, 3], [1, 2, 4], [torch.float32, torch.bfloat16]))


@pytest.mark.parametrize("kind, fsdp, tp, src_dtype", MATRIX)
def test_execute_local_equals_reference(kind, fsdp, tp, src_dtype):
    config = small_config(kind)
    seed = zlib.crc32(f"{kind}{fsdp}{tp}{src_dtype}".encode())
    state = hf_state_dict(config, seed)
    dst_layout = vllm_llama_tp(config, tp, torch.bfloat16)
    plan = plan_transfer(hf_llama_fsdp(config, fsdp, src_dtype), dst_layout)
    dst = {r: poisoned_destination(dst_layout, r) for r in range(tp)}
    written = plan.execute_local(reference_fsdp_shards(state, fsdp, src_dtype), dst)
    assert written == plan.nbytes == sum(row["bytes"] for row in plan.summary())
    ref = reference_vllm_tp_shards(state, config, tp, torch.bfloat16)
    for rank in range(tp):
        assert mismatches(ref[rank], dst[rank]) == []


@pytest.mark.parametrize("kind", ["qwen2", "llama_tied"])
def test_reference_shards_of_a_tied_model_keep_the_first_name(kind):
    """A tied model's own state_dict() (lm_head.weight is model.embed_tokens.weight):
    sharded once, under the names named_parameters() yields, in its order; the
    shards go through the tied preset's plan and land as the vLLM reference's."""
    config = small_config(kind)
    torch.manual_seed(5)
    model = MODEL_CLASSES[config.model_type](config)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # really tied
    params = {name: p.detach() for name, p in model.named_parameters()}
    shards = reference_fsdp_shards(state, 2, torch.float32)
    for rank in range(2):
        assert list(shards[rank]) == list(params)
        assert mismatches({n: torch.chunk(p, 2)[rank] for n, p in params.items()}, shards[rank]) == []
    dst_layout = vllm_llama_tp(config, 2, torch.bfloat16)
    dst = {r: poisoned_destination(dst_layout, r) for r in range(2)}
    plan_transfer(hf_llama_fsdp(config, 2, torch.float32), dst_layout).execute_local(shards, dst)
    ref = reference_vllm_tp_shards(params, config, 2, torch.bfloat16)
    assert all(mismatches(ref[r], dst[r]) == [] for r in range(2))


def test_reference_shards_refuse_what_they_cannot_describe():
    """Views of one buffer that do not overlap are distinct tensors, kept; a tensor
    overlapping another without being the same view, a 0-dim tensor and a meta
    tensor raise ValueError naming them."""
    flat = torch.arange(12.0)
    shards = reference_fsdp_shards({"a": flat[:6].view(2, 3), "b": flat[6:].view(3, 2)}, 2, torch.float32)
    assert torch.equal(shards[1]["b"], flat[6:].view(3, 2)[2:])
    cases = [({"a": flat.view(3, 4), "b": flat[4:].view(2, 4)}, r"'b' overlaps 'a' in memory"),
             ({"a": flat.view(3, 4), "b": flat.view(4, 3)}, r"'b' overlaps 'a' in memory"),
             ({"a": flat.view(3, 4), "b": flat.view(3, 4).view(torch.int32)}, r"'b' overlaps 'a' in memory"),
             ({"w": flat, "scale": torch.tensor(2.0)}, r"'scale' is 0-dim"),
             ({"w": torch.empty(4, device="meta")}, r"'w' is a meta tensor")]
    for state, message in cases:
        with pytest.raises(ValueError, match=message):
            reference_fsdp_shards(state, 2, torch.float32)


def test_small_buckets_split_segments_and_stay_exact():
    config = small_config("llama_gqa_bias")
    state = hf_state_dict(config, 3)
    dst_layout = vllm_llama_tp(config, 2, torch.bfloat16)
    plan = plan_transfer(hf_llama_fsdp(config, 3, torch.float32), dst_layout, bucket_bytes=1000)
    assert all(sum(s.nbytes for s in b) <= 1000 for buckets in plan.buckets.values() for b in buckets)
    dst = {r: poisoned_destination(dst_layout, r) for r in range(2)}
    plan.execute_local(reference_fsdp_shards(state, 3, torch.float32), dst)
    ref = reference_vllm_tp_shards(state, config, 2, torch.bfloat16)
    assert all(mismatches(ref[r], dst[r]) == [] for r in range(2))


def test_summary_counts_bytes_per_rank_pair():
    config = small_config("llama_tied")
    plan = plan_transfer(hf_llama_fsdp(config, 2, torch.float32), vllm_llama_tp(config, 2, torch.bfloat16))
    rows = plan.summary()
    assert {(r["src_rank"], r["dst_rank"]) for r in rows} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    dst_layout = plan.dst_layout
    # Every destination element except padding is written once.
    expected = sum(
        (torch.Size(dst_layout.local_shape(n, r)).numel() - (lambda p: (p[1] - p[0]) * 96)(dst_layout.padding_rows(n, r)))
        * 2
        for n in dst_layout.params for r in range(2)
    )
    assert sum(r["bytes"] for r in rows) == plan.nbytes == expected
    assert all(r["segments"] >= r["buckets"] >= 1 for r in rows)


def test_replicated_source_is_spread_over_holders():
    src = Layout(2, [ParamSpec("w", (8, 4), torch.float32, Replicate())])
    dst = Layout(4, [ParamSpec("w", (8, 4), torch.float32, Shard(0))])
    plan = plan_transfer(src, dst)
    assert sorted((s.src_rank, s.dst_rank) for s in plan.segments) == [(0, 0), (0, 2), (1, 1), (1, 3)]


def test_custom_2d_resharding_row_to_column_split():
    src = Layout(3, [ParamSpec("w", (7, 10), torch.float32, Shard(0))])
    dst = Layout(2, [ParamSpec("w", (7, 10), torch.bfloat16, Shard(1))])
    full = torch.randn(7, 10)
    src_shards = {r: {"w": torch.chunk(full, 3)[r].contiguous()} for r in range(3)}
    dst_shards = {r: {"w": torch.full((7, 5), float("nan"), dtype=torch.bfloat16)} for r in range(2)}
    plan_transfer(src, dst).execute_local(src_shards, dst_shards)
    for r in range(2):
        assert torch.equal(dst_shards[r]["w"], torch.chunk(full, 2, dim=1)[r].to(torch.bfloat16))


# ----------------------------------------------------------------------------- refusals


def _tiny():
    config = small_config("llama_gqa_bias")
    return config, hf_llama_fsdp(config, 2, torch.float32), vllm_llama_tp(config, 2, torch.bfloat16)


def _replace(layout: Layout, name: str, **changes) -> Layout:
    return Layout(layout.world_size, [dataclasses.replace(s, **changes) if s.name == name else s for s in layout.params.values()])


def test_refuses_shape_mismatch_naming_the_parameter():
    _, src, dst = _tiny()
    bad = _replace(src, "model.layers.1.mlp.down_proj.weight", shape=(96, 343))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*shape"):
        plan_transfer(bad, dst)


def test_refuses_missing_source_parameter():
    _, src, dst = _tiny()
    missing = Layout(2, [s for n, s in src.params.items() if n != "model.layers.0.self_attn.k_proj.weight"])
    with pytest.raises(ValueError, match=r"qkv_proj\.weight.*model\.layers\.0\.self_attn\.k_proj\.weight"):
        plan_transfer(missing, dst)


def test_refuses_unused_source_parameter():
    _, src, dst = _tiny()
    extra = Layout(2, [*src.params.values(), ParamSpec("model.extra.weight", (4, 4), torch.float32, Shard(0))])
    with pytest.raises(ValueError, match=r"model\.extra\.weight.*not used"):
        plan_transfer(extra, dst)


@pytest.mark.parametrize("src_dtype, dst_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16), (torch.float32, torch.float16)])
def test_refuses_unsupported_casts(src_dtype, dst_dtype):
    config = small_config("mistral")
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight.*cannot cast"):
        plan_transfer(hf_llama_fsdp(config, 1, src_dtype), vllm_llama_tp(config, 1, dst_dtype))


def test_refuses_overlapping_destination_writes():
    class Overlap(Layout):  # a custom layout whose first fragment is listed twice
        def fragments(self, name, rank):
            frags = super().fragments(name, rank)
            return frags + frags[:1]

    with pytest.raises(ValueError, match=r"'w' rank 0: overlapping writes"):
        plan_transfer(Layout(1, [ParamSpec("w", (4, 3), torch.float32)]), Overlap(1, [ParamSpec("w", (4, 3), torch.float32)]))


def test_refuses_gaps_in_destination():
    class Gap(Layout):
        def fragments(self, name, rank):
            frag = super().fragments(name, rank)[0]
            return [dataclasses.replace(frag, num_rows=frag.num_rows - 1)]

    with pytest.raises(ValueError, match=r"'w' rank 0: 3 of 12 elements would never be written"):
        plan_transfer(Layout(1, [ParamSpec("w", (4, 3), torch.float32)]), Gap(1, [ParamSpec("w", (4, 3), torch.float32)]))


def test_layout_validation_names_the_parameter():
    with pytest.raises(ValueError, match=r"'a'.*cannot split dim 1 of shape \(4,\)"):
        Layout(2, [ParamSpec("a", (4,), torch.float32, Shard(1))])
    with pytest.raises(ValueError, match=r"'b'.*listed twice"):
        Layout(1, [ParamSpec("b", (1,), torch.float32), ParamSpec("b", (1,), torch.float32)])
    with pytest.raises(ValueError, match=r"'c'.*outside"):
        Layout(1, [ParamSpec("c", (4, 2), torch.float32, Fused((FusedPart("x", (4, 2), ((0, 5),)),)))])
    with pytest.raises(ValueError, match="tp_size 3"):
        vllm_llama_tp(small_config("llama_tied"), 3, torch.bfloat16)
    # Dtypes a sync between processes does not carry still copy locally, byte for byte
    # (offline resharding); WeightSender / WeightReceiver refuse them (test_sync).
    for dtype in (torch.bool, torch.int16, torch.complex64):
        src, dst = Layout(2, [ParamSpec("d", (6, 2), dtype, Shard(0))]), Layout(1, [ParamSpec("d", (6, 2), dtype)])
        whole = torch.randn(6, 2, dtype=torch.complex64 if dtype == torch.complex64 else torch.float32).to(dtype)
        out = {0: {"d": torch.zeros(6, 2, dtype=dtype)}}
        plan_transfer(src, dst).execute_local({r: {"d": whole[3 * r:3 * r + 3].clone()} for r in range(2)}, out)
        assert torch.equal(out[0]["d"].view(torch.uint8), whole.view(torch.uint8)), dtype


def test_plan_refuses_one_logical_tensor_held_in_two_dtypes_and_bad_bucket_sizes():
    """Two source parameters holding one logical tensor: the copy reads one of them
    and casts by one dtype, so they must agree (float16 and float32 holders read
    float16 bytes as float32, past the end of the tensor)."""
    src = Layout(1, [ParamSpec("a", (8,), torch.float16, source="x"),
                     ParamSpec("b", (8,), torch.float32, source="x")])
    dst = Layout(1, [ParamSpec("x", (8,), torch.bfloat16)])
    with pytest.raises(ValueError, match=r"source parameters 'a' \(torch.float16\) and 'b' \(torch.float32\) hold 'x' "
                                         "in different dtypes"):
        plan_transfer(src, dst)
    same = Layout(1, [ParamSpec("x", (8,), torch.float32)])
    for bad in (0, -1, 1.5, float("nan"), True, "64"):
        with pytest.raises(ValueError, match=f"bucket_bytes must be an int >= 1, got {bad!r}"):
            plan_transfer(same, same, bucket_bytes=bad)


def test_execute_local_refuses_bad_tensors_before_copying():
    config, src, dst = _tiny()
    plan = plan_transfer(src, dst)
    state = hf_state_dict(config, 1)
    src_shards = reference_fsdp_shards(state, 2, torch.float32)
    dst_shards = {r: poisoned_destination(dst, r) for r in range(2)}
    before = {r: {n: t.clone() for n, t in d.items()} for r, d in dst_shards.items()}
    bad = dict(src_shards[1])
    bad["model.norm.weight"] = bad["model.norm.weight"][:-1].clone()
    with pytest.raises(ValueError, match=r"source rank 1: 'model\.norm\.weight' has shape"):
        plan.execute_local({0: src_shards[0], 1: bad}, dst_shards)
    wrong_dtype = dict(dst_shards[1])
    wrong_dtype["model.norm.weight"] = torch.zeros(96, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"destination rank 1: 'model\.norm\.weight' has dtype"):
        plan.execute_local(src_shards, {0: dst_shards[0], 1: wrong_dtype})
    # Destinations written twice (two ranks handed one dict), or written while read (the sources handed
    # as destinations), and a thread count of 0; sources sharing memory with one another are read only.
    with pytest.raises(ValueError, match=r"execute_local: 'destination rank 0: .*' and 'destination rank 1: .*' share "
                                         "memory"):
        plan.execute_local(src_shards, {0: dst_shards[0], 1: dst_shards[0]})
    same = plan_transfer(src, src)
    with pytest.raises(ValueError, match=r"'(source|destination) rank (0|1): .*' and '(source|destination) rank (0|1): .*' "
                                         "share memory .*a sync would write bytes it reads; give each destination"):
        same.execute_local(src_shards, src_shards)  # "a sync would write bytes it reads"
    with pytest.raises(ValueError, match="num_threads must be"):
        plan.execute_local(src_shards, dst_shards, num_threads=0)
    for r in range(2):
        assert all(torch.equal(before[r][n].view(torch.uint8), dst_shards[r][n].view(torch.uint8)) for n in before[r])
    # Sources sharing memory (rank 1 reading rank 0's tensor of one shape) are only read: accepted.
    tied = {r: dict(shards) for r, shards in src_shards.items()}
    name = next(n for n in tied[1] if tied[1][n].shape == tied[0][n].shape)
    tied[1][name] = tied[0][name]
    assert tied[1][name].data_ptr() == tied[0][name].data_ptr()
    assert plan.execute_local(tied, dst_shards) > 0


def test_layout_round_trips_through_json():
    _, src, dst = _tiny()
    assert Layout.from_json(dst.to_json()) == dst
    assert Layout.from_json(src.to_json()) == src
    assert Layout.from_json(src.to_json()) != dst


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_execute_local_into_fp8_destinations_equals_reference(granularity, tp):
    config = small_config("llama_gqa_bias" if tp != 2 else "qwen2")
    state = hf_state_dict(config, 40 + tp)
    dst_layout = vllm_llama_tp(config, tp, torch.bfloat16, fp8=granularity)
    plan = plan_transfer(hf_llama_fsdp(config, 3, torch.float32), dst_layout)
    dst = {r: poisoned_destination(dst_layout, r) for r in range(tp)}
    plan.execute_local(reference_fsdp_shards(state, 3, torch.float32), dst)
    ref = reference_vllm_fp8_shards(state, config, tp, granularity, source_dtype=torch.float32)
    for rank in range(tp):
        assert mismatches(ref[rank], dst[rank]) == []
    scale = "weight_scale_inv" if granularity == "block" else "weight_scale"
    assert dst[0]["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
    assert f"model.layers.0.mlp.down_proj.{scale}" in dst[0]
    if granularity == "tensor":  # one scale per fused part
        assert dst[0][f"model.layers.0.self_attn.qkv_proj.{scale}"].shape == (3,)


def test_fp8_destination_refuses_nan_before_writing_fp8_weights():
    config = small_config("mistral")
    state = hf_state_dict(config, 9)
    state["model.layers.1.mlp.up_proj.weight"][5, 7] = float("nan")
    dst_layout = vllm_llama_tp(config, 2, torch.bfloat16, fp8="block")
    dst = {r: poisoned_destination(dst_layout, r) for r in range(2)}
    fp8_before = {r: {n: t.clone() for n, t in d.items() if t.dtype == torch.float8_e4m3fn} for r, d in dst.items()}
    with pytest.raises(ValueError, match=r"source rank 0: source .model\.layers\.1\.mlp\.up_proj\.weight. \(for FP8 destination .model\.layers\.1\.mlp\.gate_up_proj\.weight. on rank 0\) contains NaN or inf"):
        plan_transfer(hf_llama_fsdp(config, 2, torch.float32), dst_layout).execute_local(
            reference_fsdp_shards(state, 2, torch.float32), dst)
    for r in range(2):
        assert all(torch.equal(t.view(torch.uint8), dst[r][n].view(torch.uint8)) for n, t in fp8_before[r].items())


def test_fp8_registration_expects_weight_and_scale():
    config = small_config("mistral")
    layout = vllm_llama_tp(config, 1, torch.bfloat16, fp8="channel")
    specs = layout.local_tensor_specs(0)
    assert specs["model.layers.0.self_attn.o_proj.weight"] == ((96, 96), torch.float8_e4m3fn)
    assert specs["model.layers.0.self_attn.o_proj.weight_scale"] == ((96, 1), torch.float32)
    assert specs["model.norm.weight"] == ((96,), torch.bfloat16)
    assert Layout.from_json(layout.to_json()) == layout


def _check_rounds(pairs, rounds):
    """Every pair in exactly one round, no rank twice in a round, as many rounds as
    the busiest rank has pairs (no schedule can take fewer)."""
    assert sorted(p for r in rounds for p in r) == sorted(set(pairs))
    for r in rounds:
        assert r and len({s for s, _ in r}) == len(r) == len({d for _, d in r}), r
    degrees = [*collections.Counter(s for s, _ in set(pairs)).values(), *collections.Counter(d for _, d in set(pairs)).values()]
    assert len(rounds) == max(degrees, default=0)


def test_bipartite_rounds_reach_the_bound_on_random_pairs():
    for seed in range(3000):
        rng = random.Random(seed)
        num_src, num_dst = rng.randint(1, 12), rng.randint(1, 12)
        pairs = [(rng.randrange(num_src), rng.randrange(num_dst)) for _ in range(rng.randint(0, 2 * num_src * num_dst))]
        rng.shuffle(pairs)
        rounds = bipartite_rounds(pairs)
        _check_rounds(pairs, rounds)
        assert bipartite_rounds(reversed(pairs)) == rounds  # every rank computes the same schedule


@pytest.mark.parametrize("num_src, num_dst", [(8, 8), (64, 8), (3, 4)])
def test_point_to_point_schedule_of_a_plan(num_src, num_dst):
    """FSDP -> TP plans whose every sender writes to every receiver: max(senders,
    receivers) rounds (the old sorted-order receivers with rotating senders took 22
    rounds for 8 x 8 and 134 for 64 x 8)."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=8, num_key_value_heads=8, vocab_size=1024)
    plan = plan_transfer(hf_llama_fsdp(config, num_src, torch.float32), vllm_llama_tp(config, num_dst, torch.bfloat16))
    assert len(plan.pairs) == num_src * num_dst
    rounds = bipartite_rounds(plan.pairs)
    _check_rounds(plan.pairs, rounds)
    assert len(rounds) == max(num_src, num_dst)


def test_replicas_cost_the_trainer_ranks_nothing_and_relay_rank_to_rank():
    """The bytes each trainer rank sends are the same for 1, 2 and 4 replicas; every
    replica but 0 gets exactly one copy of each rank's tensors from its parent."""
    config = small_config("llama_gqa_bias")
    src, dst = hf_llama_fsdp(config, 3, torch.float32), vllm_llama_tp(config, 2, torch.bfloat16)
    plans = {r: plan_transfer(src, dst, num_replicas=r) for r in (1, 2, 4)}
    assert plans[1].bytes_sent_by_src_rank() == plans[2].bytes_sent_by_src_rank() == plans[4].bytes_sent_by_src_rank()
    per_rank = {d: sum(torch.Size(s).numel() * t.itemsize for s, t in dst.local_tensor_specs(d).values()) for d in range(2)}
    for num_replicas, plan in plans.items():
        relayed = [row for row in plan.summary() if row["src_replica"] is not None]
        assert sorted((row["dst_replica"], row["dst_rank"]) for row in relayed) == [
            (rep, d) for rep in range(1, num_replicas) for d in range(2)]
        assert all(row["src_rank"] == row["dst_rank"] and row["bytes"] <= per_rank[row["dst_rank"]] for row in relayed)
        fed = [row for row in plan.summary() if row["src_replica"] is None]
        assert {row["dst_replica"] for row in fed} == {0}
    assert plans[4].relays == {0: [1, 2], 1: [3], 2: [], 3: []}


def _fp8_expected(full: torch.Tensor, placement, world: int, granularity: str):
    """What an FP8 destination rank holds, from plain torch: torch.chunk's local
    piece quantized by ops.fp8's reference, with the groups vLLM's layout gives
    (per tensor and, split on dim 1, per channel: amaxes of the whole tensor / rows)."""
    from llamarl_core.ops.fp8 import cast_fp8_ref, fp8_amax_ref, quantize_fp8_ref, scale_from_amax

    spans = world > 1 and not isinstance(placement, Replicate)
    out = []
    for local in local_tensors(full, placement, world):
        if granularity == "tensor" and spans:
            scale = scale_from_amax(fp8_amax_ref(full, "tensor"))
            out.append((cast_fp8_ref(local, scale), scale))
        elif granularity == "channel" and spans and placement.dim == 1:
            scale = scale_from_amax(fp8_amax_ref(full, "channel"))
            out.append((cast_fp8_ref(local, scale), scale))
        else:
            out.append(quantize_fp8_ref(local, granularity))
    return out


def _random_fp8_case(rng: random.Random, case: int, max_world: int, dtypes: list):
    """A random 2-D tensor (up to 300 x 300) of one of `dtypes`, split or replicated
    over 1-`max_world` source ranks, into 1-`max_world` FP8 destination ranks of a
    random granularity: (full, source shards, destination layout, plan, description)."""
    shape = (rng.randint(1, 300), rng.randint(1, 300))
    src_dtype = rng.choice(dtypes)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(case)).to(src_dtype)
    src_world, dst_world = rng.randint(1, max_world), rng.randint(1, max_world)
    src_p, dst_p = random_placement(rng, 2), random_placement(rng, 2)
    granularity = rng.choice(["tensor", "channel", "block"])
    dst = Layout(dst_world, [ParamSpec("t", shape, torch.bfloat16, dst_p, fp8=granularity)])
    plan = plan_transfer(Layout(src_world, [ParamSpec("t", shape, src_dtype, src_p)]), dst,
                         bucket_bytes=rng.choice([64, 1 << 20]))
    src_shards = {r: {"t": t} for r, t in enumerate(local_tensors(full, src_p, src_world))}
    return full, src_shards, dst, plan, (case, shape, src_dtype, src_world, src_p, dst_world, dst_p, granularity)


def test_random_fp8_plans_quantize_as_the_destination_groups_say(monkeypatch):
    """1000 random 2-D tensors (up to 300 x 300: blocks cut by shard edges on both
    sides) from 1-4 source ranks (split on either dim or replicated, fp32 or bf16)
    into 1-4 FP8 destination ranks (either dim or replicated), each granularity:
    every FP8 weight and scale equals the plain-torch reference bit for bit, and
    the groups the plan says senders share are exactly those two senders touch.
    The quantization runs on ops.fp8's torch path (its Triton kernels against the
    same reference: test_fp8.py): this is about the groups and who sends what."""
    from llamarl_core.ops.fp8_format import fp8_scale_name

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rng = random.Random(7)
    for case in range(1000):
        full, src_shards, dst, plan, where = _random_fp8_case(rng, case, 4, [torch.float32, torch.bfloat16])
        dst_world, (dst_p, granularity) = dst.world_size, where[-2:]
        dst_shards = {r: poisoned_destination(dst, r) for r in range(dst_world)}
        plan.execute_local(src_shards, dst_shards)
        scale_name = fp8_scale_name("t", granularity)
        for r, (q, scale) in enumerate(_fp8_expected(full, dst_p, dst_world, granularity)):
            assert torch.equal(dst_shards[r]["t"].view(torch.uint8), q.view(torch.uint8)), where + (r,)
            assert torch.equal(dst_shards[r][scale_name].reshape(scale.shape), scale), where + (r,)
        touched = {}
        for rect, box in zip(plan.fp8.rects, plan.fp8.boxes):
            cells = plan.fp8.cells(torch.arange(plan.fp8.num_cells), box).reshape(-1).tolist()
            for cell in cells:
                touched.setdefault(cell, set()).add(rect.src_rank)
        assert plan.fp8.shared.tolist() == sorted(c for c, ranks in touched.items() if len(ranks) > 1), where


def test_fp8_replicas_relay_their_weights_and_scales_byte_for_byte(monkeypatch):
    """300 random FP8 destinations (as above, and one in four split on dim 0 with
    padding rows after the tensor, as vLLM pads a vocabulary), two parameters each:
    the trainer's plan writes every scale (a group holding padding rows only gets
    1.0, the scale of an amax of 0; no NaN of the poisoned destination is left),
    and the relay plan from that replica into another (plan_transfer of the layout
    to itself) quantizes nothing and leaves the second replica byte for byte equal
    to the first, padding rows untouched; rows two destination ranks hold are
    copied from each rank's own. A replica's layout into any other layout is
    refused, naming the FP8 parameter."""
    from llamarl_core.ops.fp8_format import fp8_scale_name

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rng = random.Random(11)
    for case in range(300):
        world = rng.randint(1, 4)
        params, fulls = [], {}
        for name in ("a", "b"):
            shape = (rng.randint(1, 300), rng.randint(1, 300))
            fulls[name] = torch.randn(shape, generator=torch.Generator().manual_seed(case * 2 + len(fulls)))
            placement = random_placement(rng, 2)
            if rng.random() < 0.25:
                placement = Shard(0, padded_size=shape[0] + rng.randint(1, 300))
            params.append(ParamSpec(name, shape, torch.bfloat16, placement, fp8=rng.choice(["tensor", "channel", "block"])))
        dst = Layout(world, params)
        src = Layout(1, [ParamSpec(n, tuple(t.shape), torch.float32) for n, t in fulls.items()])
        first = {r: poisoned_destination(dst, r) for r in range(world)}
        plan_transfer(src, dst).execute_local({0: fulls}, first)
        for r in range(world):
            for spec in params:
                scale = first[r][fp8_scale_name(spec.name, spec.fp8)]
                assert not scale.isnan().any(), (case, r, spec)
                start, stop = dst.padding_rows(spec.name, r)
                if spec.fp8 == "channel" and stop > start:
                    assert (scale[start:stop] == 1.0).all(), (case, r, spec)
                if spec.fp8 == "block" and stop > start:
                    assert (scale[-(-start // 128):] == 1.0).all(), (case, r, spec)
        relay = plan_transfer(dst, dst)
        assert relay.fp8 is None and {seg.cast for seg in relay.segments} <= {False}, case
        assert {(seg.src_rank, seg.dst_rank) for seg in relay.segments} <= {(r, r) for r in range(world)}, case
        second = {r: poisoned_destination(dst, r) for r in range(world)}
        relay.execute_local(first, second)
        for r in range(world):
            for name, t in first[r].items():
                assert torch.equal(second[r][name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), \
                    (case, r, name)
    other = Layout(dst.world_size, [dataclasses.replace(params[0], fp8=None), params[1]])
    with pytest.raises(ValueError, match="source parameter 'a' is held in FP8: it can only be copied as it is"):
        plan_transfer(dst, other)
    # Rows two ranks hold (k's rows 4-8 on ranks 1 and 2, not where rank % 2 would
    # look): their FP8 bytes differ with each rank's block scales, so each rank is
    # filled from its own copy.
    fused = Fused((FusedPart("q", (12, 256), ((0, 4), (4, 8), (8, 12))),
                   FusedPart("k", (8, 256), ((0, 4), (4, 8), (4, 8)))))
    for granularity in ("block", "channel", "tensor"):
        dst = Layout(3, [ParamSpec("qk", (20, 256), torch.bfloat16, fused, fp8=granularity)])
        fulls = {n: torch.randn(shape, generator=torch.Generator().manual_seed(i)) * (1 + 100 * i)
                 for i, (n, shape) in enumerate({"q": (12, 256), "k": (8, 256)}.items())}
        first = {r: poisoned_destination(dst, r) for r in range(3)}
        plan_transfer(Layout(1, [ParamSpec(n, tuple(t.shape), torch.float32) for n, t in fulls.items()]),
                      dst).execute_local({0: fulls}, first)
        relay = plan_transfer(dst, dst)
        assert {(seg.src_rank, seg.dst_rank) for seg in relay.segments} == {(0, 0), (1, 1), (2, 2)}, granularity
        second = {r: poisoned_destination(dst, r) for r in range(3)}
        relay.execute_local(first, second)
        for r in range(3):
            for name, t in first[r].items():
                assert torch.equal(second[r][name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), \
                    (granularity, r, name)


def test_fp8_grouped_kernels_equal_the_torch_path(monkeypatch):
    """The grouped Triton kernels (kernels/fp8_sync.py: one launch per pass for all
    of a sender's rectangles, run here by Triton's interpreter) against ops.fp8's
    torch path, a rectangle at a time: 30 random plans as above, every FP8 weight
    and scale bit for bit; and a NaN reaches the same refusal."""
    rng = random.Random(3)
    for case in range(30):
        _, src_shards, dst, plan, where = _random_fp8_case(rng, case, 3, [torch.float32, torch.bfloat16, torch.float16])
        dst_world = dst.world_size
        results = []
        for interpret in ("1", "0"):  # the grouped kernels, then the torch path
            monkeypatch.setenv("TRITON_INTERPRET", interpret)
            dst_shards = {r: poisoned_destination(dst, r) for r in range(dst_world)}
            plan.execute_local(src_shards, dst_shards)
            results.append(dst_shards)
        for r in range(dst_world):
            for name, got in results[0][r].items():
                assert torch.equal(got.reshape(-1).view(torch.uint8), results[1][r][name].reshape(-1).view(torch.uint8)), \
                    where + (name, r)
    # Several tensors a sender, of two dtypes: each dtype's tiles reach its tensors
    # through their distance from one of them (other allocations).
    shapes = {"a": (150, 90), "b": (70, 260), "c": (40, 40)}
    dtypes = {"a": torch.float32, "b": torch.bfloat16, "c": torch.float32}
    kinds = {"a": "block", "b": "channel", "c": "tensor"}
    src = Layout(2, [ParamSpec(n, shapes[n], dtypes[n], Shard(0)) for n in shapes])
    dst = Layout(2, [ParamSpec(n, shapes[n], torch.bfloat16, Shard(1 if n == "b" else 0), fp8=kinds[n]) for n in shapes])
    fulls = {n: torch.randn(shapes[n], generator=torch.Generator().manual_seed(i)).to(dtypes[n])
             for i, n in enumerate(shapes)}
    src_shards = {r: {n: torch.chunk(fulls[n], 2)[r].contiguous() for n in shapes} for r in range(2)}
    plan = plan_transfer(src, dst)
    results = []
    for interpret in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        dst_shards = {r: poisoned_destination(dst, r) for r in range(2)}
        plan.execute_local(src_shards, dst_shards)
        results.append(dst_shards)
    for r in range(2):
        assert mismatches(results[1][r], results[0][r]) == []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    full = torch.randn(100, 200)
    full[73, 5] = float("nan")
    dst = Layout(2, [ParamSpec("t", (100, 200), torch.bfloat16, Shard(0), fp8="block")])
    with pytest.raises(ValueError, match=r"source rank 1: source 't' \(for FP8 destination 't' on rank 1\) contains NaN"):
        plan_transfer(Layout(2, [ParamSpec("t", (100, 200), torch.float32, Shard(0))]), dst).execute_local(
            {r: {"t": piece.contiguous()} for r, piece in enumerate(torch.chunk(full, 2))},
            {r: poisoned_destination(dst, r) for r in range(2)})
