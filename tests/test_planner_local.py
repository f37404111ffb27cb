"""The local cost model (llamarl_core.planner.local): a `llamarl train` run on this
machine's cores. Its arithmetic alone (the step from its phases, monotonic in sizes
and rates, pinned async ranks unslowed, time-sharing when the ranks outnumber the
cores), the fit recovering known factors, the placement search against every
placement, bad input named; then a TrainConfig read as the model sees it, and the
commands (`llamarl plan RUN --calibration`, `llamarl train --auto-placement`)."""

import dataclasses
import json
import math
import os
import random
import subprocess
import sys

import pytest

from helpers import llamarl_here
from llamarl_core.pipeline.config import TrainConfig
from llamarl_core.pipeline.plan_local import auto_placement, local_run
from llamarl_core.planner import Calibration, PlanError, model_shape
from llamarl_core.planner.cli import SHIPPED_CALIBRATION, data_path
from llamarl_core.planner.local import LOCAL_FACTORS, LocalModel, LocalRun, Machine, choose_local, placements
from llamarl_core.planner.local_calibration import LocalCalibration, fit_local

CORES = len(os.sched_getaffinity(0))
MACHINE = Machine(cores=CORES, matmul_gflops_1=100.0, matmul_gflops_all=95.0 * CORES, copy_GBps=30.0, memory_GiB=24.0)
FACTORS = {"forward_s": 3e-4, "generation_efficiency": 0.6, "train_efficiency": 0.5, "collective_s": 1e-3,
           "fsdp_unit_s": 4e-3, "time_sharing": 0.8, "train_step_s": 0.01, "sample_s": 5e-5, "sync_s": 1e-3,
           "step_overhead_s": 0.006}


def toy(hidden=96, intermediate=192, layers=2, heads=4, kv_heads=2, vocab=12):
    return model_shape({"model_type": "llama", "hidden_size": hidden, "intermediate_size": intermediate,
                        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                        "vocab_size": vocab, "tie_word_embeddings": False})


def run(mode="async", tp=1, replicas=1, world=1, prompts=8, **shape) -> LocalRun:
    return LocalRun("case", toy(**shape), mode, prompts, 8, 6.5, 5.5, 7, 0 if mode == "sync" else 1, tp,
                    replicas, world, tp_choices=(1, 2))


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
    # Async with a rank a side on cores of their own: the trainer as fast as alone (one thread).
    assert both.train_time_s == pytest.approx(model.training(run(), model._rate(1), {}), rel=1e-12)


def test_monotonic_in_sizes_rates_and_ranks_beyond_the_cores():
    rng = random.Random(0)
    for _ in range(300):
        factors = _factors(rng)
        model = LocalModel(MACHINE, factors)
        base = run(rng.choice(["sync", "async"]), prompts=rng.choice([4, 8, 16]))
        bigger = dataclasses.replace(base, model=toy(hidden=192, intermediate=384, layers=3))
        longer = dataclasses.replace(base, new_tokens=base.new_tokens + 1, prompt_tokens=base.prompt_tokens + 2)
        p = model.predict(base)
        assert model.predict(bigger).step_time_s > p.step_time_s
        assert model.predict(longer).train_time_s > p.train_time_s
        faster = LocalModel(dataclasses.replace(MACHINE, matmul_gflops_1=200.0, matmul_gflops_all=190.0 * CORES),
                            factors)
        assert faster.predict(base).step_time_s < p.step_time_s
        # Async: ranks beyond the cores time-share them; the same ranks on twice the cores do not.
        crowded = base.with_placement("async", 1, CORES, 1)
        roomy = LocalModel(dataclasses.replace(MACHINE, cores=2 * CORES), factors)
        assert model.predict(crowded).train_time_s > roomy.predict(crowded).train_time_s
        # Micro-batches: less memory a trainer rank, more fixed cost.
        micro = dataclasses.replace(base, micro_batch=4)
        assert model.trainer_memory(micro) < model.trainer_memory(base)
        assert model.predict(micro).breakdown["training"]["forward fixed cost"] > \
            p.breakdown["training"]["forward fixed cost"]


def test_collectives_and_memory_by_hand():
    model = LocalModel(MACHINE, FACTORS)
    one, two = model.predict(run("sync")), model.predict(run("sync", tp=2))
    # tp 2: 7 forwards (a prefill, then 6) of 2 x 2 layers + 2 collectives each.
    assert two.breakdown["generation"]["tp collectives"] == pytest.approx(7 * 6 * FACTORS["collective_s"])
    assert one.breakdown["generation"]["tp collectives"] == 0
    world = model.predict(run("sync", world=2))
    shape = toy()
    assert world.breakdown["training"]["FSDP collectives"] == pytest.approx(
        3 * FACTORS["fsdp_unit_s"] + 3 * shape.total_params * 4 / 2 / 30e9)
    # KV cache by head_dim, not hidden / heads: 64 samples x (6.5 + 7) tokens x 2 layers x (k, v) x 2 kv heads
    # x head_dim 128 x 4 bytes.
    wide = dataclasses.replace(run(), model=model_shape({
        "model_type": "llama", "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 12,
        "tie_word_embeddings": False}))
    weights = wide.model.total_params * 4
    assert model.generator_memory(wide) * 2**30 == pytest.approx(weights + 64 * 13.5 * 2 * 2 * 2 * 128 * 4)


def test_fit_recovers_known_factors():
    truth = LocalModel(MACHINE, FACTORS)
    shapes = [{}, {"hidden": 192, "intermediate": 384, "layers": 3}, {"hidden": 64, "intermediate": 128}]
    runs = []
    for i, (mode, tp, replicas, world) in enumerate([("sync", 1, 1, 1), ("async", 1, 1, 1), ("sync", 2, 1, 1),
                                                    ("async", 2, 1, 1), ("async", 1, 1, 2), ("sync", 1, 1, 2),
                                                    ("async", 1, 2, 1), ("sync", 1, 1, 1), ("async", 1, 1, 1),
                                                    ("async", 1, CORES, 1), ("sync", 1, 2, 1)]):
        r = run(mode, tp, replicas, world, prompts=[4, 8, 16][i % 3], **shapes[i % 3])
        p = truth.predict(r)
        runs.append((r, {"step_time_s": p.step_time_s, "gen_time_s": p.gen_time_s,
                         "train_time_s": p.train_time_s, "sync_time_s": p.sync_time_s}))
    calibration = fit_local(MACHINE, runs)
    assert calibration.fit["max_abs_step_error"] < 0.01
    fitted = calibration.model()
    held_out = run("async", 2, 1, 1, prompts=8, hidden=128, intermediate=256, layers=2)
    assert fitted.predict(held_out).step_time_s == pytest.approx(truth.predict(held_out).step_time_s, rel=0.03)


def test_choose_ranks_every_placement_the_pipeline_takes():
    rng = random.Random(1)
    for _ in range(50):
        model = LocalModel(MACHINE, _factors(rng))
        base = run(rng.choice(["sync", "async"]), prompts=rng.choice([4, 6, 8]))
        best = choose_local(model, base, top=3)
        every = sorted(model.predict(r).step_time_s for r in placements(base, MACHINE.cores))
        assert [p.step_time_s for _, p in best] == every[:3]
        assert best[0][1].step_time_s <= model.predict(base).step_time_s
    # The tp sizes are the pipeline's own: the default model's 2 key / value heads replicate at tp 4; 6 heads
    # over a vocabulary padded to 64 take tp 1 and 2, not 3 or 6.
    assert local_run(TrainConfig()).tp_choices == (1, 2, 4)
    six = TrainConfig(prompts_per_step=6, num_heads=6, num_kv_heads=6)
    assert local_run(six).tp_choices == (1, 2)
    for placed in placements(local_run(six), 8):  # each one a config the pipeline takes
        TrainConfig(prompts_per_step=6, num_heads=6, num_kv_heads=6, **placed.placement())
    assert {r.trainer_world for r in placements(local_run(six), 8)} == {1, 2, 3, 6}  # dividing 6 prompts


@pytest.mark.parametrize("change, culprit", [
    ({"generator_tp": 3}, "generator tp 3 is not one the model takes"),
    ({"trainer_world": 3}, "trainer world 3 does not divide prompts_per_step 8"),
    ({"mode": "both"}, "mode must be sync or async"),
    ({"generator_replicas": 0}, "generator_replicas must be a positive integer"),
    ({"new_tokens": 9.0}, "mean completion tokens 9.0"),
    ({"prompt_tokens": float("nan")}, "prompt_tokens"),
    ({"samples_per_prompt": 1}, "samples_per_prompt must be >= 2"),
    ({"max_staleness": 0}, "max_staleness 0 with mode 'async'"),
    ({"micro_batch": -1}, "micro_batch must be an integer >= 0"),
])
def test_bad_runs_are_named(change, culprit):
    with pytest.raises(PlanError, match=culprit):
        dataclasses.replace(run(), **change)


def test_bad_machines_and_factors_are_named():
    with pytest.raises(PlanError, match="copy_GBps must be positive finite"):
        dataclasses.replace(MACHINE, copy_GBps=math.inf)
    with pytest.raises(PlanError, match=r"factor forward_s = 1.0 is outside"):
        LocalModel(MACHINE, {**FACTORS, "forward_s": 1.0})
    with pytest.raises(PlanError, match=r"missing \['sync_s'\]"):
        LocalModel(MACHINE, {k: v for k, v in FACTORS.items() if k != "sync_s"})


def test_a_run_that_does_not_fit_in_memory_is_refused():
    huge = dataclasses.replace(run(), model=toy(hidden=8192, intermediate=28672, layers=40, heads=64, kv_heads=8,
                                                vocab=128256))
    with pytest.raises(PlanError, match=r"GiB .* of this machine's 24.0 GiB"):
        LocalModel(MACHINE, FACTORS).predict(huge)
    with pytest.raises(PlanError, match="no placement fits on this machine"):
        choose_local(LocalModel(MACHINE, FACTORS), huge)


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
                            ({**data, "machine": {**data["machine"], "cores": 0}}, "must be positive"),
                            ({**data, "machine": {**data["machine"], "cores": 1.5}}, "cores must be an integer"),
                            ({**data, "factors": {k: v for k, v in FACTORS.items() if k != "sync_s"}},
                             r"missing \['sync_s'\]")):
        path.write_text(json.dumps(broken))
        with pytest.raises(PlanError, match=culprit):
            LocalCalibration.load(path)


def test_a_train_config_as_the_model_sees_it():
    config = TrainConfig(mode="sync", generator_tp=2, trainer_world=2, prompts_per_step=4, hidden_size=64,
                         intermediate_size=128, num_layers=3, micro_batch_size=8, kl_coef=0.1)
    r = local_run(config, "mine")
    assert (r.mode, r.generator_tp, r.generator_replicas, r.trainer_world, r.prompts, r.cap) == (
        "sync", 2, 1, 2, 4, 7)
    assert (r.model.hidden, r.model.layers, r.model.vocab, r.micro_batch, r.reference_pass) == (64, 3, 12, 8, True)
    # The default task's prompts are bos + 3-6 letters + "=", its answers the letters reversed + eos.
    assert 5.5 < r.prompt_tokens < 7.5 and 4.5 < r.new_tokens < 6.5
    assert any("reference answers" in text for _, text in r.assumptions)
    measured = local_run(config, new_tokens=6.25)
    assert measured.new_tokens == 6.25 and "new_tokens" not in dict(measured.assumptions)
    assert "checkpoint_every" in dict(measured.assumptions)  # every 50 of 1200 steps
    bf16 = local_run(TrainConfig(dtype="bfloat16", eval_every=5, step_hook="mymod:hook"))
    assert bf16.weight_bytes == 2 and {"dtype", "eval_every", "step_hook"} <= {key for key, _ in bf16.assumptions}
    for bad, culprit in (({"device": "cuda"}, "device 'cuda'"), ({"generator": "vllm"}, "generator 'vllm'"),
                         ({"generator_fp8": "channel"}, "generator_fp8 'channel'"),
                         ({"task": "no_such_module:task"}, "cannot load task"),
                         ({"model": "/no/such/model"}, "no such folder")):
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
    chosen = llamarl_here("plan", "--calibration", str(cal), str(folder / "config.json"), "--choose", "--json")
    assert chosen.returncode == 0, chosen.stderr
    best = json.loads(chosen.stdout)["best"]
    assert best[0]["step_time_s"] <= json.loads(chosen.stdout)["given"]["step_time_s"]
    text = llamarl_here("plan", str(folder), "--calibration", str(cal), "--choose")
    assert text.returncode == 0 and "best:" in text.stdout and "assumptions:" in text.stdout
    # A config.json of before the sections (flat names) is a run too.
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps(config.flat()))
    result = llamarl_here("plan", str(flat), "--calibration", str(cal), "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["step_time_s"] == out["step_time_s"]
    # Another machine's calibration: said with the prediction.
    other = tmp_path / "other.json"
    LocalCalibration(dataclasses.replace(MACHINE, cores=CORES + 2), FACTORS).save(other)
    result = llamarl_here("plan", str(folder), "--calibration", str(other), "--json")
    assert result.returncode == 0 and any(f"calibrated on {CORES + 2} cores" in line
                                          for line in json.loads(result.stdout)["assumptions"])
    # Bad input: one line saying what to do, exit status 2.
    for args, culprit in (([str(folder)], "llamarl plan calibrate -o"),
                          ([str(folder), "--calibration", str(data_path(SHIPPED_CALIBRATION))],
                           "not a local calibration"),
                          ([str(tmp_path), "--calibration", str(cal)], "holds no run (no config.json)")):
        result = llamarl_here("plan", *args)
        assert result.returncode == 2 and culprit in result.stderr, result.stderr
    for out, culprit in ((tmp_path, "a folder; name the calibration JSON"), (tmp_path / "no" / "c.json",
                                                                           "its folder does not exist")):
        result = llamarl_here("plan", "calibrate", "-o", str(out))  # before any probe runs
        assert result.returncode == 2 and f"-o {out}: {culprit}" in result.stderr, result.stderr
    binary = tmp_path / "binary.json"
    binary.write_bytes(bytes(range(128, 256)))
    result = llamarl_here("plan", str(binary))
    assert result.returncode == 2 and "not JSON" in result.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"run": {"steps": 0}, "generator": {}, "trainer": {}}))
    result = llamarl_here("plan", str(broken), "--calibration", str(cal))
    assert result.returncode == 2 and "steps must be >= 1" in result.stderr
    tiny = tmp_path / "tiny.json"
    LocalCalibration(dataclasses.replace(MACHINE, memory_GiB=1e-4), FACTORS).save(tiny)
    result = llamarl_here("plan", str(folder), "--calibration", str(tiny), "--choose")
    assert result.returncode == 2 and "no placement fits on this machine" in result.stderr
    with pytest.raises(PlanError, match=f"calibrated on {CORES + 2} cores"):
        auto_placement(config, str(other))


def test_train_with_auto_placement(tmp_path):
    cal = tmp_path / "cpu.json"
    LocalCalibration(MACHINE, FACTORS, {"max_abs_step_error": 0.1}).save(cal)
    out = tmp_path / "run"
    result = llamarl_here("train", "--auto-placement", "--calibration", str(cal), "--steps", "3", "--warmup-steps",
                          "0", "--prompts-per-step", "4", "--quiet", "--out", str(out))
    assert result.returncode == 0, result.stderr
    top = choose_local(LocalModel(MACHINE, FACTORS), local_run(TrainConfig(prompts_per_step=4)), top=1)[0][0]
    line = next(line for line in result.stdout.splitlines() if line.startswith("auto-placement: "))
    assert f"auto-placement: {top.mode} generator tp {top.generator_tp}" in line and "assuming" in line
    saved = TrainConfig.load(out / "config.json")
    assert (saved.run.mode, saved.generator.tp, saved.generator.replicas, saved.trainer.world) == (
        top.mode, top.generator_tp, top.generator_replicas, top.trainer_world)
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    for args, culprit in ((["--auto-placement"], "--calibration"),
                          (["--calibration", str(cal)], "--calibration takes effect with --auto-placement"),
                          (["--auto-placement", "--calibration", str(cal), "--compare"], "--compare"),
                          (["--auto-placement", "--calibration", str(cal), "--generator-tp", "2"],
                           "drop --generator-tp")):
        result = llamarl_here("train", "--steps", "2", "--out", str(tmp_path / "x"), *args)
        assert result.returncode != 0 and culprit in result.stderr, result.stderr
        assert not (tmp_path / "x").exists()


SYNC_THREADS = """
import torch
from llamarl_core.pipeline.config import TrainConfig
from llamarl_core.pipeline.executors.link import GENERATOR, TRAINER
from llamarl_core.pipeline.executors.resources import setup_threads
config = TrainConfig(mode="sync", generator_tp=2, trainer_world=1)
for role in (GENERATOR, TRAINER):
    setup_threads(config, role, 0, launched=False)
    print(torch.get_num_threads())
"""


def test_sync_mode_ranks_share_the_cores():
    # A process of its own: vLLM's CPU worker, once loaded in this one by another test, replaces
    # torch.set_num_threads.
    out = subprocess.run([sys.executable, "-c", SYNC_THREADS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(max(1, CORES // 2)), str(CORES)]
