"""The local cost model (llamarl_core.planner.local): a `llamarl train` run on this
machine's cores. Its arithmetic alone (the step from its phases, monotonic in sizes
and rates, pinned async ranks unslowed, time-sharing when the ranks outnumber the
cores), the fit recovering known factors, the placement search against every
placement, bad input named; then a TrainConfig read as the model sees it, and the
commands (`llamarl plan RUN --calibration`, `llamarl train --auto-placement`)."""

import dataclasses
import json
import math
import random

import pytest

from helpers import llamarl_here
from llamarl_core.pipeline.config import TrainConfig
from llamarl_core.pipeline.plan_local import auto_placement
from llamarl_core.pipeline.probes import local_run
from llamarl_core.planner import Calibration, PlanError, model_shape
from llamarl_core.planner.cli import SHIPPED_CALIBRATION, data_path
from llamarl_core.planner.local import (LOCAL_FACTORS, LocalCalibration, LocalModel, LocalRun, Machine,
                                        choose_local, fit_local, placements)

MACHINE = Machine(cores=2, matmul_gflops_1=100.0, matmul_gflops_all=190.0, copy_GBps=30.0, memory_GiB=24.0)
FACTORS = {"forward_s": 3e-4, "generation_efficiency": 0.6, "train_efficiency": 0.5, "collective_s": 1e-3,
           "fsdp_unit_s": 4e-3, "time_sharing": 0.8, "train_step_s": 0.01, "sample_s": 5e-5, "sync_s": 1e-3,
           "step_overhead_s": 0.006}


def toy(hidden=96, intermediate=192, layers=2, heads=4, kv_heads=2, vocab=12):
    return model_shape({"model_type": "llama", "hidden_size": hidden, "intermediate_size": intermediate,
                        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                        "vocab_size": vocab, "tie_word_embeddings": False})


def run(mode="async", tp=1, replicas=1, world=1, prompts=8, **shape) -> LocalRun:
    return LocalRun("case", toy(**shape), mode, prompts, 8, 6.5, 5.5, 7, 4, 0 if mode == "sync" else 1, tp,
                    replicas, world)


def _factors(rng):
    return {name: math.exp(rng.uniform(math.log(max(lo, 1e-6)), math.log(hi))) for name, (lo, hi, _) in
            LOCAL_FACTORS.items()}


def test_the_step_is_built_from_its_phases():
    model = LocalModel(MACHINE, FACTORS)
    sync = model.predict(run("sync"))
    assert sync.step_time_s == pytest.approx(sync.gen_time_s + sync.train_time_s + sync.sync_time_s
                                             + FACTORS["step_overhead_s"], rel=1e-12)
    both = model.predict(run("async"))
    assert both.step_time_s == pytest.approx(max(both.gen_time_s, both.train_time_s) + both.sync_time_s
                                             + FACTORS["step_overhead_s"], rel=1e-12)
    for p in (sync, both):  # each phase is the sum of its parts
        assert p.gen_time_s == pytest.approx(sum(p.breakdown["generation"].values()), rel=1e-12)
        assert p.train_time_s == pytest.approx(sum(p.breakdown["training"].values()), rel=1e-12)
    # Async on 2 cores with one rank a side: each pinned to a core, no slower than alone (one thread each).
    alone = LocalModel(MACHINE, FACTORS)
    gen_alone = alone.generation(run(), alone._rate(1), {})
    assert both.gen_time_s == pytest.approx(gen_alone, rel=1e-12)


def test_monotonic_in_sizes_rates_and_ranks_beyond_the_cores():
    rng = random.Random(0)
    for _ in range(300):
        factors = _factors(rng)
        model = LocalModel(MACHINE, factors)
        mode = rng.choice(["sync", "async"])
        base = run(mode, prompts=rng.choice([4, 8, 16]))
        bigger = dataclasses.replace(base, model=toy(hidden=192, intermediate=384, layers=3))
        longer = dataclasses.replace(base, new_tokens=base.new_tokens + 1, prompt_tokens=base.prompt_tokens + 2)
        p = model.predict(base)
        assert model.predict(bigger).step_time_s > p.step_time_s
        assert model.predict(longer).train_time_s > p.train_time_s
        faster = LocalModel(dataclasses.replace(MACHINE, matmul_gflops_1=200.0, matmul_gflops_all=380.0), factors)
        assert faster.predict(base).step_time_s < p.step_time_s
        # Async: a third rank on 2 cores time-shares them; the same ranks on 4 cores do not.
        crowded = base.with_placement("async", 1, 2, 1)
        roomy = LocalModel(dataclasses.replace(MACHINE, cores=4), factors)
        assert model.predict(crowded).gen_time_s >= roomy.predict(crowded).gen_time_s


def test_more_collectives_cost_more():
    model = LocalModel(MACHINE, FACTORS)
    one, two = model.predict(run("sync")), model.predict(run("sync", tp=2))
    assert two.breakdown["generation"]["tp collectives"] > 0 == one.breakdown["generation"]["tp collectives"]
    world = model.predict(run("sync", world=2))
    assert world.breakdown["training"]["FSDP collectives"] > 0


def test_fit_recovers_known_factors():
    truth = LocalModel(MACHINE, FACTORS)
    shapes = [{}, {"hidden": 192, "intermediate": 384, "layers": 3}, {"hidden": 64, "intermediate": 128}]
    runs = []
    for i, (mode, tp, replicas, world) in enumerate([("sync", 1, 1, 1), ("async", 1, 1, 1), ("sync", 2, 1, 1),
                                                    ("async", 2, 1, 1), ("async", 1, 1, 2), ("sync", 1, 1, 2),
                                                    ("async", 1, 2, 1), ("sync", 1, 1, 1), ("async", 1, 1, 1)]):
        r = run(mode, tp, replicas, world, prompts=[4, 8, 16][i % 3], **shapes[i % 3])
        p = truth.predict(r)
        runs.append((r, {"step_time_s": p.step_time_s, "gen_time_s": p.gen_time_s,
                         "train_time_s": p.train_time_s, "sync_time_s": p.sync_time_s}))
    result = fit_local(MACHINE, runs)
    assert result["fit"]["max_abs_step_error"] < 0.01
    fitted = LocalModel(MACHINE, result["factors"])
    held_out = run("async", 2, 1, 1, prompts=8, hidden=128, intermediate=256, layers=2)
    assert fitted.predict(held_out).step_time_s == pytest.approx(truth.predict(held_out).step_time_s, rel=0.03)


def test_choose_is_the_best_of_every_placement():
    rng = random.Random(1)
    for _ in range(50):
        model = LocalModel(MACHINE, _factors(rng))
        base = run(rng.choice(["sync", "async"]), prompts=rng.choice([4, 6, 8]))
        best = choose_local(model, base, top=3)
        every = sorted(model.predict(r).step_time_s for r in placements(base, MACHINE.cores))
        assert [p.step_time_s for _, p in best] == every[:3]
        assert best[0][1].step_time_s <= model.predict(base).step_time_s
    kinds = {(r.mode, r.generator_tp, r.replicas, r.trainer_world) for r in placements(run(prompts=6), 2)}
    assert ("sync", 2, 1, 2) in kinds and ("async", 1, 2, 1) in kinds
    assert all(r_world != 4 for *_, r_world in kinds)  # 4 does not divide 6, and exceeds the cores


@pytest.mark.parametrize("change, culprit", [
    ({"generator_tp": 3}, "generator tp 3 does not divide"),
    ({"trainer_world": 3}, "trainer world 3 does not divide prompts_per_step 8"),
    ({"mode": "both"}, "mode must be sync or async"),
    ({"replicas": 0}, "replicas must be a positive integer"),
    ({"new_tokens": 9.0}, "mean completion tokens 9.0"),
])
def test_bad_runs_are_named(change, culprit):
    with pytest.raises(PlanError, match=culprit):
        LocalModel(MACHINE, FACTORS).predict(dataclasses.replace(run(), **change))


def test_a_run_that_does_not_fit_in_memory_is_refused():
    huge = dataclasses.replace(run(), model=toy(hidden=8192, intermediate=28672, layers=40, heads=64, kv_heads=8,
                                                vocab=128256))
    with pytest.raises(PlanError, match=r"GiB .* of this machine's 24.0 GiB"):
        LocalModel(MACHINE, FACTORS).predict(huge)


def test_calibration_files_are_checked(tmp_path):
    path = tmp_path / "cpu.json"
    LocalCalibration(MACHINE, FACTORS, {"max_abs_step_error": 0.1}).save(path)
    loaded = LocalCalibration.load(path)
    assert loaded.machine == MACHINE and loaded.factors == FACTORS
    with pytest.raises(PlanError, match="not a local calibration"):
        LocalCalibration.load(data_path(SHIPPED_CALIBRATION))
    with pytest.raises(PlanError, match="a local calibration"):
        Calibration.load(path)
    data = json.loads(path.read_text())
    for broken, culprit in (({**data, "factors": {**FACTORS, "forward_s": 1.0}}, "forward_s = 1.0 is outside"),
                            ({**data, "factors": {**FACTORS, "speed": 1}}, "unknown factor 'speed'"),
                            ({**data, "machine": {**data["machine"], "cores": 0}}, "machine needs a positive"),
                            ({**data, "factors": {k: v for k, v in FACTORS.items() if k != "sync_s"}},
                             r"missing \['sync_s'\]")):
        path.write_text(json.dumps(broken))
        with pytest.raises(PlanError, match=culprit):
            LocalCalibration.load(path)


def test_a_train_config_as_the_model_sees_it():
    config = TrainConfig(mode="sync", generator_tp=2, trainer_world=2, prompts_per_step=4, hidden_size=64,
                         intermediate_size=128, num_layers=3)
    r = local_run(config, "mine")
    assert (r.mode, r.generator_tp, r.replicas, r.trainer_world, r.prompts, r.cap) == ("sync", 2, 1, 2, 4, 7)
    assert (r.model.hidden, r.model.layers, r.model.vocab) == (64, 3, 12)
    # The default task's prompts are bos + 3-6 letters + "=", its answers the letters reversed + eos.
    assert 5 < r.prompt_tokens < 8 and 4 < r.new_tokens < 7.01
    assert any("reference answers" in text for _, text in r.assumptions)
    assert local_run(config, new_tokens=6.25).new_tokens == 6.25 and not local_run(config, new_tokens=6.25).assumptions
    for bad, culprit in (({"device": "cuda"}, "device 'cuda'"), ({"generator": "vllm"}, "generator 'vllm'"),
                         ({"generator_fp8": "channel"}, "generator_fp8 'channel'")):
        with pytest.raises(PlanError, match=culprit):
            local_run(TrainConfig(**bad))


def test_plan_and_auto_placement_commands(tmp_path):
    cal = tmp_path / "cpu.json"
    LocalCalibration(MACHINE, FACTORS, {"max_abs_step_error": 0.1}).save(cal)
    folder = tmp_path / "run"
    folder.mkdir()
    config = TrainConfig(steps=20, prompts_per_step=4)
    config.save(folder / "config.json")
    result = llamarl_here("plan", str(folder), "--calibration", str(cal), "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["step_time_s"] == LocalModel(MACHINE, FACTORS).predict(local_run(config, str(folder))).step_time_s
    assert {"generator", "trainer"} == set(out["memory_gib_per_gpu"]) and out["bottleneck"] and out["assumptions"]
    chosen = llamarl_here("plan", str(folder / "config.json"), "--calibration", str(cal), "--choose", "--json")
    assert chosen.returncode == 0, chosen.stderr
    best = json.loads(chosen.stdout)["best"]
    assert best[0]["step_time_s"] <= json.loads(chosen.stdout)["given"]["step_time_s"]
    text = llamarl_here("plan", str(folder), "--calibration", str(cal))
    assert text.returncode == 0 and "bottleneck:" in text.stdout and "assumptions:" in text.stdout
    # Without a local calibration, or with a GPU one: one line saying what to do.
    result = llamarl_here("plan", str(folder))
    assert result.returncode == 2 and "llamarl plan calibrate -o" in result.stderr
    result = llamarl_here("plan", str(folder), "--calibration", str(data_path(SHIPPED_CALIBRATION)))
    assert result.returncode == 2 and "not a local calibration" in result.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"run": {"steps": 0}, "generator": {}, "trainer": {}}))
    result = llamarl_here("plan", str(broken), "--calibration", str(cal))
    assert result.returncode == 2 and "steps must be >= 1" in result.stderr
    # --auto-placement: the placement of the lowest predicted step, said with why.
    placed, why = auto_placement(config, str(cal))
    top = choose_local(LocalModel(MACHINE, FACTORS), local_run(config), top=1)[0][0]
    assert (placed.run.mode, placed.generator.tp, placed.generator.replicas, placed.trainer.world) == (
        top.mode, top.generator_tp, top.replicas, top.trainer_world)
    assert why.startswith("auto-placement: ") and "predicted step" in why and "bottleneck" in why
    for args, culprit in ((["--auto-placement"], "--calibration"),
                          (["--calibration", str(cal)], "--calibration takes effect with --auto-placement"),
                          (["--auto-placement", "--calibration", str(cal), "--compare"], "--compare")):
        result = llamarl_here("train", "--steps", "2", "--out", str(tmp_path / "x"), *args)
        assert result.returncode != 0 and culprit in result.stderr, result.stderr
        assert not (tmp_path / "x").exists()
