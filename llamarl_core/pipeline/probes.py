"""`llamarl plan calibrate`'s measurements, and a `llamarl train` run as the
planner's local model sees it (planner/local.py holds the arithmetic).

`measure_machine()` times fp32 matmuls (one thread, a thread per core) and a large
copy, and reads the memory. `calibrate()` adds short probe runs of the pipeline
(PROBES: sync and async, generator tp 1 and 2, 2 replicas, trainer world 2, at
model shapes and batches of their own, none the shape of the default run) and fits
the local factors on their measured step, generation, training and sync times.
`local_run(config)` reads what the model needs from a TrainConfig: the model's
shape, the task's prompt and answer lengths, each side's parallelism."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..planner.devices import PlanError
from ..planner.local import LocalCalibration, LocalRun, Machine, fit_local
from ..planner.shapes import model_shape
from .config import TrainConfig
from .data import RunData

# Probe runs: steps each, and the settings of each beside the defaults (the default task, warmed up as a run is).
PROBE_STEPS = 40
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2}
MEDIUM = {"hidden_size": 128, "intermediate_size": 256, "num_layers": 3}
LARGE = {"hidden_size": 192, "intermediate_size": 384, "num_layers": 3}
HUGE = {"hidden_size": 320, "intermediate_size": 640, "num_layers": 3}
PROBES = {
    "sync-small-p4": {"mode": "sync", "prompts_per_step": 4, **SMALL},
    "async-small-p16": {"mode": "async", "prompts_per_step": 16, **SMALL},
    "sync-large": {"mode": "sync", **LARGE},
    "async-large": {"mode": "async", **LARGE},
    "sync-tp2-medium-p4": {"mode": "sync", "generator_tp": 2, "prompts_per_step": 4, **MEDIUM},
    "async-tp2-small-p16": {"mode": "async", "generator_tp": 2, "prompts_per_step": 16, **SMALL},
    "async-world2-medium": {"mode": "async", "trainer_world": 2, **MEDIUM},
    "sync-world2-small-p16": {"mode": "sync", "trainer_world": 2, "prompts_per_step": 16, **SMALL},
    "async-replicas2-large-p4": {"mode": "async", "generator_replicas": 2, "prompts_per_step": 4, **LARGE},
    "sync-huge-p4": {"mode": "sync", "prompts_per_step": 4, **HUGE},
    "async-huge-p4": {"mode": "async", "prompts_per_step": 4, **HUGE},
}
FIGURES = ("step_time_s", "gen_time_s", "train_time_s", "sync_time_s")
# A dataset's (or a task's without reference answers) completions: assumed to fill this share of the budget.
UNKNOWN_LENGTH_SHARE = 0.5


def _timed(fn, seconds: float) -> float:
    """Calls of fn per second over about `seconds` (after one warm-up call)."""
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return calls / (time.perf_counter() - start)


def measure_machine(seconds: float = 0.5) -> Machine:
    """This machine's figures: fp32 matmul GFLOP/s of a (512 x 256) @ (256 x 512)
    product (the scale of the built-in model's) with one thread and with a thread
    per core, memcpy bytes read + written per second of 64 MiB, and total memory."""
    cores = len(os.sched_getaffinity(0))
    a, b = torch.randn(512, 256), torch.randn(256, 512)
    flops = 2 * 512 * 256 * 512
    threads = torch.get_num_threads()
    gflops = {}
    try:
        for n in (1, cores):
            torch.set_num_threads(n)
            gflops[n] = _timed(lambda: a @ b, seconds) * flops / 1e9
    finally:
        torch.set_num_threads(threads)
    src = torch.empty(16 * 2**20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    copy = _timed(lambda: dst.copy_(src), seconds) * 2 * src.numel() * 4 / 1e9
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return Machine(cores=cores, matmul_gflops_1=gflops[1], matmul_gflops_all=gflops[cores], copy_GBps=copy,
                   memory_GiB=memory)


def local_run(config: TrainConfig, name: str = "run", new_tokens: float | None = None) -> LocalRun:
    """`config` as the local model's LocalRun: PlanError naming what the model does
    not describe (a GPU run, a generator other than ours, FP8 weights, a GGUF
    file). The mean completion length is `new_tokens` when given (a run that was
    measured), else the task's reference answers' (eos included; said in the
    assumptions)."""
    run, gen = config.run, config.generator
    if run.device != "cpu":
        raise PlanError(f"{name}: device {run.device!r}: the local model is calibrated on this machine's CPU cores")
    if gen.backend != "llama":
        raise PlanError(f"{name}: generator {gen.backend!r}: the local model describes our generator ('llama')")
    if gen.fp8 is not None:
        raise PlanError(f"{name}: generator_fp8 {gen.fp8!r}: the local model prices the generator's weights in "
                        f"{run.dtype}, not FP8")
    if run.model is not None and not Path(run.model).is_dir():
        raise PlanError(f"{name}: model {run.model!r}: the planner reads a model folder's config.json (not a "
                        "GGUF file)")
    data = RunData(config)
    shape = model_shape(run.model if run.model is not None else data.model_config.to_dict())
    problems = [data.problem(i) for i in range(min(256, data.train_size or 256))]
    prompts = [len(data.tokenizer.encode(p.prompt)) for p in problems]
    cap = data.max_new_tokens
    assumptions = []
    if new_tokens is None:
        task = data.task
        if task is not None and task.reference is not None:
            lengths = [min(cap, len(data.tokenizer.encode(task.reference(p.prompt))) - 1 + 1) for p in problems]
            new_tokens = statistics.fmean(lengths)
            assumptions.append(("new_tokens", f"completions as long as the task's reference answers "
                                              f"({new_tokens:.1f} tokens with eos)"))
        else:
            new_tokens = UNKNOWN_LENGTH_SHARE * cap
            assumptions.append(("new_tokens", f"completions fill {UNKNOWN_LENGTH_SHARE:.0%} of the budget "
                                              f"({new_tokens:.0f} of {cap} tokens): no reference answers"))
    weight_bytes = 2 if run.torch_dtype == torch.bfloat16 else 4
    return LocalRun(name, shape, run.mode, run.prompts_per_step, run.samples_per_prompt,
                    statistics.fmean(prompts), float(new_tokens), cap, gen.segment_tokens, run.max_staleness,
                    gen.tp, gen.replicas, config.trainer.world, weight_bytes, config.loss.kl_coef > 0,
                    tuple(assumptions))


def probe_run(config: TrainConfig, out: Path) -> dict:
    """One run of `config` into `out`: its summary's FIGURES and mean completion tokens."""
    from .controller import Controller

    summary = Controller(config, out).run()
    return {**{key: summary[key] for key in FIGURES},
            "new_tokens": summary["completion_tokens"] / summary["samples"], "cpu_steal": summary["cpu_steal"]}


def calibrate(path: Path, steps: int = PROBE_STEPS, log=print) -> LocalCalibration:
    """Measure this machine, run PROBES, fit, and write the local calibration to `path`."""
    machine = measure_machine()
    log(f"machine: {machine.cores} cores, matmul {machine.matmul_gflops_1:.1f} GFLOP/s (1 thread) / "
        f"{machine.matmul_gflops_all:.1f} ({machine.cores} threads), copy {machine.copy_GBps:.1f} GB/s, "
        f"{machine.memory_GiB:.1f} GiB")
    runs, probes = [], []
    with tempfile.TemporaryDirectory(prefix="llamarl-calibrate-") as tmp:
        for name, settings in PROBES.items():
            config = TrainConfig(steps=steps, checkpoint_every=steps, **settings)
            start = time.monotonic()
            measured = probe_run(config, Path(tmp) / name)
            log(f"probe {name}: step {measured['step_time_s'] * 1e3:.1f} ms (gen {measured['gen_time_s'] * 1e3:.1f}, "
                f"train {measured['train_time_s'] * 1e3:.1f}, sync {measured['sync_time_s'] * 1e3:.2f}); "
                f"{time.monotonic() - start:.0f} s")
            runs.append((local_run(config, name, measured["new_tokens"]), measured))
            probes.append({"name": name, "settings": settings, "steps": steps, "measured": measured})
    result = fit_local(machine, runs)
    calibration = LocalCalibration(machine, result["factors"], result["fit"], probes)
    calibration.save(path)
    return calibration


def main_calibrate(out: Path, steps: int) -> int:
    start = time.monotonic()
    calibration = calibrate(out, steps, log=lambda line: print(line, file=sys.stderr, flush=True))
    fit = calibration.fit
    print(f"fit on {fit['runs']} probe runs: step time median error {fit['median_abs_step_error']:.1%}, largest "
          f"{fit['max_abs_step_error']:.1%}")
    for name, value in calibration.factors.items():
        print(f"  {name:22s} {value:.4g}")
    print(f"wrote {out} ({time.monotonic() - start:.0f} s)")
    return 0
