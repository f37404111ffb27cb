"""Soak: does anything grow with the number of steps? (`llamarl bench soak`)

Two loops, each run for --steps steps with a sample every --every steps:
- pipeline: the default `llamarl train` run (the Controller API, the built-in
  task and model, a checkpoint every 50 steps; --warmup-steps), with an evaluation on the
  held-out prompts at every sample, sampled from its on_step callback;
- sync: a WeightSender in this process and a WeightReceiver in another (forked
  from the forkserver the pipeline's executors fork from),
  one version per step over shared memory (the pipeline's own transport on one
  host), at the default task's model size.
Each sample reads, for the controller (this process) and every executor (their
pids from the run folder's executors.json): RSS, open file descriptors and
threads (/proc); the Store's key count (TCPStore.num_keys, every key of the run:
queues, heartbeats, the weight sync's); and the step time, averaged over the
steps since the last sample. The verdict compares the last sample with the first
at or after --from (1,000 steps by default, after warm-up): a quantity is flat
within 5% (an absolute slack for counts: a message in flight, a thread that comes
and goes), and the step time's trend (a Theil-Sen line through the samples from
--from on) must not rise by more than 5%. Each sample also gives the mean time of
a step's parts (the pipeline's generation, training and sync) and the CPU steal of
the machine over its window, to read the step time by.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from llamarl_core import forkserver
from llamarl_core.bench.harness import add_output_args, emit, record, share_secret, table
from llamarl_core.pipeline.report import cpu_times, steal_fraction

FLAT = 0.05  # relative change allowed from --from to the end
SLACK = {"keys": 2, "fds": 1, "threads": 1}  # absolute slack for counts (a message in flight, a passing thread)


def process_stats(pid: int) -> dict[str, float]:
    """RSS (MiB), open file descriptors and threads of process `pid`, read from /proc."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"])}


class Sampler:
    """Samples every `every` steps: step time (mean since the last sample), and of
    the parts given (`parts`: name -> seconds, e.g. the trainer's step), the CPU
    steal of the machine (the share of CPU time its host gave to others: what slows
    everything on a shared machine), the Store's keys, and process_stats of each
    named process."""

    def __init__(self, every: int):
        self.every = every
        self.rows: list[dict] = []
        self._times: list[float] = []
        self._parts: dict[str, list[float]] = {}
        self._cpu = cpu_times()

    def step(self, step: int, seconds: float, store: dist.Store, pids: dict[str, int],
             parts: dict[str, float] | None = None) -> None:
        self._times.append(seconds)
        for name, value in (parts or {}).items():
            self._parts.setdefault(name, []).append(value)
        if (step + 1) % self.every:
            return
        cpu = cpu_times()
        row = {"step": step + 1, "step_ms": 1e3 * statistics.fmean(self._times),
               **{f"{name}_ms": 1e3 * statistics.fmean(values) for name, values in self._parts.items()},
               "steal_pct": 100 * steal_fraction(self._cpu, cpu), "keys": store.num_keys()}
        self._cpu, self._parts = cpu, {}
        for name, pid in pids.items():
            try:
                row.update({f"{name} {k}": v for k, v in process_stats(pid).items()})
            except (OSError, KeyError):  # it exited meanwhile (a replaced generator): not sampled
                pass
        self._times = []
        self.rows.append(row)


def verdict(rows: list[dict], start: int) -> dict[str, dict]:
    """Per quantity: its value at the first sample at or after step `start` and at
    the last, the relative change, and whether it is flat. The step time, a mean
    over each sampling window that a shared machine makes jump by 10% from one
    window to the next, is judged by its trend instead (`trend`, through the
    windows from `start` on): its rise from the first to the last window must not
    exceed 5% of where it starts ("from" and "end" are the trend's). The parts of
    a step and the machine's CPU steal are there to read the step time by, not judged."""
    since = [r for r in rows if r["step"] >= start]
    if len(since) < 2:
        raise ValueError(f"no two samples from step {start} on: run more --steps or sample more often (--every)")
    base, last = since[0], since[-1]
    out = {}
    for key in base:
        if key in ("step", "steal_pct") or (key.endswith("_ms") and key != "step_ms") or key not in last:
            continue
        first, end = base[key], last[key]
        if key == "step_ms":
            first, end = trend([r["step"] for r in since], [r[key] for r in since])
            flat = end <= first * (1 + FLAT)
        else:
            slack = next(s for k, s in SLACK.items() if key.endswith(k)) if key.endswith(tuple(SLACK)) else 0
            flat = abs(end - first) <= FLAT * first + slack
        out[key] = {"from": first, "end": end, "change": (end - first) / first if first else float(end != first),
                    "flat": flat}
    return out


def trend(x: list[float], y: list[float]) -> tuple[float, float]:
    """The Theil-Sen line through (x, y) (the median of the pairwise slopes, through
    the median point: one window slowed by the host moves it little), at the first
    and the last x."""
    slope = statistics.median((y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in itertools.combinations(zip(x, y), 2))
    at = statistics.median(b - slope * a for a, b in zip(x, y))
    return at + slope * x[0], at + slope * x[-1]


# ----------------------------------------------------------------------------- the pipeline


def soak_pipeline(config, every: int, out: Path) -> list[dict]:
    """The pipeline loop: a run of `config` (a TrainConfig), sampled every `every` steps."""
    from llamarl_core.pipeline.controller import Controller

    sampler = Sampler(every)
    holder: list[Controller] = []

    def on_step(record: dict) -> None:
        pids = json.loads((out / "executors.json").read_text())
        sampler.step(record["step"], record["step_time_s"], holder[0].store, {"controller": os.getpid(), **pids},
                     {"gen": record["gen_time_s"], "train": record["train_time_s"], "sync": record["sync_time_s"]})

    controller = Controller(config, out, on_step=on_step, on_event=lambda line: None)
    holder.append(controller)
    summary = controller.run()
    print(f"pipeline: {summary['steps']} steps, reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f}",
          file=sys.stderr)
    return sampler.rows


# ----------------------------------------------------------------------------- the sync alone


def _layouts():
    from llamarl_core.pipeline.data import RunData
    from llamarl_core.pipeline.config import TrainConfig
    from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp

    config = RunData(TrainConfig()).model_config  # the default task's model
    return hf_llama_fsdp(config, 1, torch.float32), vllm_llama_tp(config, 1, torch.float32)


def _receiver(port: int, steps: int) -> None:
    from llamarl_core.sync import WeightReceiver

    torch.set_num_threads(1)
    _, dst = _layouts()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    params = {n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in dst.local_tensor_specs(0).items()}
    with WeightReceiver(store, dst, 0, params, name="soak", transport="shm", timeout=120) as receiver:
        for version in range(1, steps + 1):
            if receiver.receive() != version:
                raise RuntimeError(f"received version {receiver.version}, expected {version}")
        store.wait(["soak/sampled"])  # the last sample is taken of a receiver still open, not of one closing


def soak_sync(steps: int, every: int) -> list[dict]:
    from llamarl_core.sync import WeightSender

    torch.set_num_threads(1)
    src, _ = _layouts()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    proc = forkserver.context().Process(target=_receiver, args=(store.port, steps), daemon=True)
    proc.start()
    gen = torch.Generator().manual_seed(0)
    shards = {n: torch.randn(src.local_shape(n, 0), generator=gen) for n in src.params}
    sampler = Sampler(every)
    try:
        with WeightSender(store, src, 0, shards, name="soak", transport="shm", timeout=120) as sender:
            for version in range(1, steps + 1):
                start = time.perf_counter()
                sender.send(version)
                sampler.step(version - 1, time.perf_counter() - start, store,
                             {"sender": os.getpid(), "receiver": proc.pid})
            store.set("soak/sampled", "1")
        proc.join(timeout=60)
        if proc.exitcode != 0:
            raise RuntimeError(f"the receiver process exited with {proc.exitcode}")
    finally:
        if proc.is_alive():
            proc.kill()
    return sampler.rows


# ----------------------------------------------------------------------------- report


def report(name: str, rows: list[dict], start: int) -> tuple[str, dict]:
    """The samples as a table, and the verdict (printed under it)."""
    keys = list(rows[0])
    lines = [["step", *[k for k in keys if k != "step"]]]
    for row in rows:
        lines.append([str(row["step"]), *[f"{row[k]:.1f}" if isinstance(row.get(k), float) else str(row.get(k, "-"))
                                          for k in keys if k != "step"]])
    judged = verdict(rows, start)
    flat = [["quantity", f"at step >= {start}", "end", "change", "flat"]]
    for key, v in judged.items():
        flat.append([key, f"{v['from']:.1f}", f"{v['end']:.1f}", f"{100 * v['change']:+.1f}%", "yes" if v["flat"] else "NO"])
    return f"### {name}\n\n{table(lines)}\n\n{table(flat)}\n", judged


def main(argv=None) -> int:
    from llamarl_core.pipeline.config import RunConfig, TrainConfig, TrainerConfig
    from llamarl_core.spelling import flag_spelling

    parser = argparse.ArgumentParser(prog="llamarl bench soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000, help="steps of each loop (default 10000)")
    parser.add_argument("--every", type=int, default=500, help="a sample every this many steps (default 500)")
    parser.add_argument("--from", dest="start", type=int, default=1_000,
                        help="the first step the verdict compares against (default 1000: after warm-up)")
    parser.add_argument("--only", choices=["pipeline", "sync"], help="run one loop only (default: both)")
    parser.add_argument("--checkpoint-every", type=int, default=RunConfig.checkpoint_every,
                        help=f"the pipeline's checkpoint interval in steps (default {RunConfig.checkpoint_every})")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help=f"the pipeline's supervised steps before RL (default {TrainerConfig.warmup_steps})")
    parser.add_argument("--out", type=Path, help="the pipeline run's folder (default: a temporary one)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.every < 1 or args.every > args.steps:
        parser.error(f"need 1 <= --every <= --steps, got --every {args.every} --steps {args.steps}")
    config = None  # the pipeline loop's: `llamarl train`'s defaults, but for these; an evaluation at every sample
    if args.only == "sync":
        if args.warmup_steps is not None:
            parser.error("--warmup-steps is the pipeline loop's: not with --only sync")
    else:
        warmup = {} if args.warmup_steps is None else {"warmup_steps": args.warmup_steps}
        try:
            with flag_spelling():
                config = TrainConfig(steps=args.steps, eval_every=args.every, checkpoint_every=args.checkpoint_every,
                                     **warmup)
        except ValueError as exc:
            parser.error(str(exc))
    share_secret()
    results, bodies = {}, []
    with tempfile.TemporaryDirectory(prefix="llamarl-soak-") as tmp:
        for name in ("sync", "pipeline"):
            if args.only not in (None, name):
                continue
            rows = soak_sync(args.steps, args.every) if name == "sync" else \
                soak_pipeline(config, args.every, args.out or Path(tmp) / "run")
            body, judged = report(name, rows, args.start)
            bodies.append(body)
            results[name] = {"rows": rows, "verdict": judged}
    emit(args, results, "\n".join(bodies), indent=None)
    figures = {f"{name} {key} change": v["change"] for name, r in results.items() for key, v in r["verdict"].items()}
    record(args.record, "soak", figures, {"steps": args.steps, "every": args.every}, "Soak: flat over thousands of steps",
           "\n".join(bodies))
    flat = all(v["flat"] for r in results.values() for v in r["verdict"].values())
    return 0 if flat else 1


if __name__ == "__main__":
    from llamarl_core.cli import run_command

    run_command(main)  # as `llamarl bench soak` ends: without the interpreter's teardown of torch
