"""The control plane's speed (`llamarl bench control`): a message's hop, and what
the gaps between the executors' work cost a run.

- hop: --messages messages, one in flight at a time, through the run's own queue
  (control/queues.py StoreQueue over a TCPStore, HMAC tags, the data-only wire):
  from one process to another (one queue), and from an executor through the
  controller to the next executor (two queues and a process that forwards, as
  the controller does); the time from put to get, median and 90th percentile,
  beside one Store round trip (an `add`) measured in the same run: the floor of
  any message.
- runs: --runs runs of `llamarl train --compare --steps S` (the default task),
  one after another; from each run's trace.json, over the middle half of its RL
  steps: the sync-mode step against the time the executors' spans cover (their
  union: what is left is the control plane's gaps, broken down by the span before
  and after each gap), and the async run's overlap efficiency (summary.json).
  Medians over the runs.
- --trace DIR ...: the same reading of existing run folders (a `--compare`
  folder, or a sync or async run's), nothing run.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import multiprocessing as mp
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from llamarl_core.bench.harness import add_output_args, emit, record, table
from llamarl_core.control import StoreQueue, new_secret

HOP_LIMIT_MS = 2.0  # a hop from one executor to the next through the controller
RATIO_LIMIT = 1.15  # the sync-mode step against the time the spans cover
OVERLAP_FLOOR = 0.85  # the async run's max(gen, train) / step
# Spans that are not part of an RL step's work (before the RL steps, or beside them).
NOT_STEP_WORK = ("supervised warm-up", "evaluate", "checkpoint")


# ----------------------------------------------------------------------------- hop


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))


def _producer(port: int, secret: bytes, first: str, count: int) -> None:
    store = _client(port)
    out, back = StoreQueue(store, first, secret), StoreQueue(store, "back", secret)
    for i in range(count):
        out.put(("message", {"sent": time.monotonic(), "i": i}))
        if back.get(30) is None:
            raise SystemExit(f"no answer to message {i} within 30 s")


def _forwarder(port: int, secret: bytes, count: int) -> None:
    store = _client(port)
    events, inbox = StoreQueue(store, "events", secret), StoreQueue(store, "inbox", secret)
    for i in range(count):
        message = events.get(30)
        if message is None:
            raise SystemExit(f"the forwarder got no message {i} within 30 s")
        inbox.put(message)


def _consumer(port: int, secret: bytes, count: int, results) -> None:
    store = _client(port)
    inbox, back = StoreQueue(store, "inbox", secret), StoreQueue(store, "back", secret)
    latencies = []
    for _ in range(count):
        message = inbox.get(30)
        latencies.append(time.monotonic() - message[1]["sent"])  # CLOCK_MONOTONIC: one clock for the host
        back.put("next")
    results.put(latencies)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hop_latencies(count: int, forwarded: bool) -> list[float]:
    """Seconds from put to get of `count` messages, one in flight at a time, with
    (forwarded) or without a process forwarding them from one queue to another.
    The processes fork before this one starts the Store's server: a fork beside the
    server's thread can inherit a lock it holds, and hang."""
    context, secret, port = mp.get_context("fork"), new_secret(), _free_port()
    results = context.Queue()
    processes = [context.Process(target=_producer, args=(port, secret, "events" if forwarded else "inbox", count)),
                 context.Process(target=_consumer, args=(port, secret, count, results))]
    if forwarded:
        processes.append(context.Process(target=_forwarder, args=(port, secret, count)))
    for process in processes:
        process.start()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    try:
        latencies = results.get(timeout=60 + count)
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
        del server
    return latencies


def round_trips(count: int) -> list[float]:
    """Seconds of one Store request (`add`) answered, `count` times."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = _client(server.port)
    times = []
    for _ in range(count):
        start = time.perf_counter()
        client.add("bench/round-trip", 1)
        times.append(time.perf_counter() - start)
    return times


def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median_ms": statistics.median(ordered) * 1e3, "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3}


# ----------------------------------------------------------------------------- a run's trace


def trace_gaps(events: list[dict]) -> dict:
    """Read a run's trace events (trace.json's "traceEvents"): over the middle half
    of its RL steps (from the first "train step" span's start to the last one's
    end), the time per step, the time per step that the union of the executors'
    spans covers, their ratio, and each gap between covered stretches by the span
    that ends before it and the one that starts after it ("role:name"), in ms per
    step. Spans outside an RL step's work (NOT_STEP_WORK) count as gaps."""
    roles = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    spans = sorted((e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3, f"{roles.get(e['pid'], e['pid'])}:{e['name']}")
                   for e in events if e.get("ph") == "X" and e["name"] not in NOT_STEP_WORK)
    trains = [(start, end) for start, end, name in spans if name.endswith(":train step")]
    if len(trains) < 4:
        raise ValueError(f"{len(trains)} train step spans: too few to read the middle half of a run")
    first, last = trains[0][0], trains[-1][1]
    low, high = first + (last - first) / 4, first + 3 * (last - first) / 4
    steps = sum(low <= start < high for start, _ in trains)
    if not steps:
        raise ValueError("no train step starts in the middle half of the run: too few steps to read")
    covered, gaps = 0.0, collections.defaultdict(float)
    reach, reach_name = None, None
    for start, end, name in spans:
        start, end = max(start, low), min(end, high)
        if end <= start:
            continue
        if reach is None or start > reach:
            if reach is not None:
                gaps[f"{reach_name} -> {name}"] += start - reach
            covered += end - start
            reach, reach_name = end, name
        elif end > reach:
            covered += end - reach
            reach, reach_name = end, name
    if not covered:
        raise ValueError("no span covers the middle half of the run")
    step = (high - low) / steps
    return {"steps": steps, "step_ms": step, "covered_ms": covered / steps, "ratio": step / (covered / steps),
            "gaps_ms": {k: v / steps for k, v in sorted(gaps.items(), key=lambda kv: -kv[1])}}


def read_run(folder: Path) -> dict:
    """The sync run's trace_gaps and the async run's overlap efficiency of a
    `--compare` folder (or of one run's folder: what its mode gives)."""
    runs = {mode: folder / mode for mode in ("sync", "async") if (folder / mode / "trace.json").exists()}
    if not runs and (folder / "trace.json").exists():
        runs = {json.loads((folder / "summary.json").read_text())["mode"]: folder}
    if not runs:
        raise ValueError(f"{folder}: no trace.json there, nor in sync/ or async/ under it")
    out = {}
    for mode, path in runs.items():
        summary = json.loads((path / "summary.json").read_text())
        out[mode] = {**trace_gaps(json.loads((path / "trace.json").read_text())["traceEvents"]),
                     "overlap_efficiency": summary["overlap_efficiency"], "reward_last": summary["reward_last"]}
    return out


def compare_run(steps: int, folder: Path) -> dict:
    command = [sys.executable, "-m", "llamarl_core.cli", "train", "--compare", "--steps", str(steps), "--quiet",
               "--out", str(folder)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return read_run(folder)


# ----------------------------------------------------------------------------- the command


def _gap_rows(runs: list[dict], mode: str) -> list[list[str]]:
    names = {name for run in runs for name in run[mode]["gaps_ms"]}
    medians = {name: statistics.median(run[mode]["gaps_ms"].get(name, 0.0) for run in runs) for name in names}
    top = sorted(medians.items(), key=lambda kv: -kv[1])[:8]
    return [[f"{mode}: {name}", f"{value:.2f}"] for name, value in top]


def main(argv=None) -> int:
    from llamarl_core.cli import HelpFormatter

    parser = argparse.ArgumentParser(prog="llamarl bench control", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--messages", type=int, default=200, help="messages per hop measurement")
    parser.add_argument("--runs", type=int, default=3, help="`llamarl train --compare` runs (0: none)")
    parser.add_argument("--steps", type=int, default=400, help="RL steps of each run")
    parser.add_argument("--trace", type=Path, nargs="+", metavar="DIR",
                        help="read these run folders instead of running (the hop is still measured); default: "
                             "none, --runs runs are made")
    add_output_args(parser)
    args = parser.parse_args(argv)
    for flag, value, low in (("--messages", args.messages, 10), ("--runs", args.runs, 0), ("--steps", args.steps, 40)):
        if value < low:
            parser.error(f"{flag} must be at least {low}, got {value}")

    result = {"round_trip": _ms(round_trips(args.messages)), "one_queue": _ms(hop_latencies(args.messages, False)),
              "hop": _ms(hop_latencies(args.messages, True))}
    if args.trace:
        runs = [read_run(folder) for folder in args.trace]
    else:
        with tempfile.TemporaryDirectory(prefix="llamarl-bench-control-") as tmp:
            runs = [compare_run(args.steps, Path(tmp) / f"run{k}") for k in range(args.runs)]
    result["runs"] = runs
    rows = [["figure", "median", "limit / peer"],
            ["Store round trip (add)", f"{result['round_trip']['median_ms']:.3f} ms", "the floor of a message"],
            ["one queue, put -> get", f"{result['one_queue']['median_ms']:.3f} ms (p90 "
                                      f"{result['one_queue']['p90_ms']:.3f})", ""],
            ["executor -> controller -> executor", f"{result['hop']['median_ms']:.3f} ms (p90 "
                                                   f"{result['hop']['p90_ms']:.3f})", f"<= {HOP_LIMIT_MS} ms"]]
    figures = {"round_trip_ms": result["round_trip"]["median_ms"], "one_queue_ms": result["one_queue"]["median_ms"],
               "hop_ms": result["hop"]["median_ms"]}
    if any("sync" in run for run in runs):
        ratio = statistics.median(run["sync"]["ratio"] for run in runs if "sync" in run)
        rows.append([f"sync step / spans' time ({sum('sync' in r for r in runs)} runs)", f"{ratio:.3f}",
                     f"<= {RATIO_LIMIT}"])
        figures["sync_step_over_spans"] = ratio
    if any("async" in run for run in runs):
        overlap = statistics.median(run["async"]["overlap_efficiency"] for run in runs if "async" in run)
        rows.append([f"async overlap efficiency ({sum('async' in r for r in runs)} runs)", f"{overlap:.3f}",
                     f">= {OVERLAP_FLOOR}"])
        figures["async_overlap"] = overlap
    per_run = [[f"run {k}", " ".join(f"{mode}: step {r['step_ms']:.1f} ms, spans {r['covered_ms']:.1f} ms, ratio "
                                     f"{r['ratio']:.3f}, overlap {r['overlap_efficiency']:.3f}"
                                     for mode, r in run.items())] for k, run in enumerate(runs)]
    gaps = [["gap (span before -> span after)", "ms per step, median over runs"]]
    for mode in ("sync", "async"):
        if all(mode in run for run in runs) and runs:
            gaps += _gap_rows(runs, mode)
    text = "\n\n".join([table(rows), table([["run", "middle half of its RL steps"], *per_run]) if runs else "",
                        table(gaps) if len(gaps) > 1 else ""]).strip()
    emit(args, result, text)
    record(args.record, "control", figures, {"messages": args.messages, "runs": args.runs, "steps": args.steps},
           "Control plane: a message's hop, and the gaps between the executors' work", text)
    return 0


if __name__ == "__main__":
    from llamarl_core.cli import run_command

    run_command(main)
