"""`llamarl plan calibrate`: this machine measured, and the local model fit on it
(planner/local.py holds the arithmetic, planner/local_calibration.py the fit).

`measure_machine()` times fp32 matmuls (one thread, a thread per core) and a large
copy, and reads the memory. `calibrate()` adds short probe runs of the pipeline
(PROBES: sync and async, generator tp 1 and 2, 2 replicas, trainer world 2, at
model shapes and batches of their own, none the shape of the default run) and fits
the local factors on their measured step, generation, training and sync times."""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..planner.cli import check_out
from ..planner.devices import PlanError
from ..planner.local import Machine
from ..planner.local_calibration import LocalCalibration, fit_local
from .config import TrainConfig
from .plan_local import local_run

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


def probe_run(config: TrainConfig, out: Path) -> dict:
    """One run of `config` into `out`: its summary's FIGURES (each a mean over the
    steps but the first, which fills the pipeline: what summary.json and `llamarl
    bench plan` report), the mean completion tokens, and the run's CPU steal."""
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
            try:
                measured = probe_run(config, Path(tmp) / name)
            except Exception as exc:  # the run's own error (PipelineError, a ValueError), as one line
                raise PlanError(f"calibrate: probe {name} stopped: {type(exc).__name__}: {exc}") from exc
            steal = f", CPU steal {measured['cpu_steal']:.0%}: the host took cores" if measured["cpu_steal"] > 0.05 \
                else ""
            log(f"probe {name}: step {measured['step_time_s'] * 1e3:.1f} ms (gen {measured['gen_time_s'] * 1e3:.1f}, "
                f"train {measured['train_time_s'] * 1e3:.1f}, sync {measured['sync_time_s'] * 1e3:.2f}); "
                f"{time.monotonic() - start:.0f} s{steal}")
            runs.append((local_run(config, name, measured["new_tokens"]), measured))
            probes.append({"name": name, "settings": settings, "steps": steps, "measured": measured})
    calibration = dataclasses.replace(fit_local(machine, runs), probes=probes)
    calibration.save(path)
    return calibration


def main_calibrate(argv: list[str]) -> int:
    """`llamarl plan calibrate -o CAL.json [--steps N]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="llamarl plan calibrate", description=(
        "Calibrate the local model on this machine: time matmuls and a copy, run short probes of the pipeline "
        "(sync and async, generator tp 1 and 2, 2 replicas, trainer world 2, at model shapes and batches of their "
        "own), fit the local factors on their step, generation, training and sync times, and write CAL.json for "
        "`llamarl plan RUN --calibration CAL.json` and `llamarl train --auto-placement`."))
    parser.add_argument("-o", "--out", required=True, type=Path, help="the calibration JSON to write")
    parser.add_argument("--steps", type=int, default=PROBE_STEPS, help="steps of each probe run")
    args = parser.parse_args(argv)
    if args.steps < 5:
        parser.error(f"--steps must be at least 5 (the first step fills the pipeline), got {args.steps}")
    check_out(args.out, parser)
    start = time.monotonic()
    calibration = calibrate(args.out, args.steps, log=lambda line: print(line, file=sys.stderr, flush=True))
    fit = calibration.fit
    print(f"fit on {fit['runs']} probe runs: step time median error {fit['median_abs_step_error']:.1%}, largest "
          f"{fit['max_abs_step_error']:.1%}")
    for name, value in calibration.factors.items():
        print(f"  {name:22s} {value:.4g}")
    print(f"wrote {args.out} ({time.monotonic() - start:.0f} s)")
    return 0
