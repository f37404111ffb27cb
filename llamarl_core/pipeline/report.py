"""What a run writes: metrics.jsonl (a line per trainer step), summary.json, a PNG
of reward against time, and a Chrome-trace / Perfetto timeline."""

from __future__ import annotations

import json
import logging
import os
import statistics
from pathlib import Path

SUMMARY_TIMES = ("step_time_s", "gen_time_s", "train_time_s", "sync_time_s", "stall_time_s")


def cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs from /proc/stat ((0, 0) where there is none).
    Steal is time a virtual machine's CPUs were runnable but the host ran something
    else: on a shared host it slows every phase, so a run reports it."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def tenth_means(values: list[float]) -> tuple[float, float]:
    """Mean of the first and of the last tenth (at least one value each)."""
    if not values:
        raise ValueError("no values")
    k = max(1, len(values) // 10)
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:])


def summarize(mode: str, metrics: list[dict], wall_time_s: float, cpu_steal: float,
              evals: list[dict] | None = None) -> dict:
    """summary.json: reward_first / reward_last over the first / last tenth of
    steps; per-step times averaged over all steps but the first (which includes
    filling the pipeline); the greedy reward on the held-out prompts at the first
    and the last evaluation, if there were any."""
    if not metrics:
        raise ValueError("no trainer step finished: nothing to summarize")
    first, last = tenth_means([m["reward"] for m in metrics])
    steady = metrics[1:] or metrics
    summary = {
        "mode": mode,
        "steps": metrics[-1]["step"] + 1,  # a step lost with a crash before its record stays counted
        "samples": sum(m["samples"] for m in metrics),
        "reward_first": first,
        "reward_last": last,
        **{key: statistics.fmean(m[key] for m in steady) for key in SUMMARY_TIMES},
        "dropped_samples": sum(m["dropped"] for m in metrics),
        "max_staleness_seen": max(max(map(int, m["staleness"]), default=0) for m in metrics),
        "completion_tokens": sum(m["completion_tokens"] for m in metrics),
        "wall_time_s": wall_time_s,
        "cpu_steal": cpu_steal,  # fraction of CPU time the host took during the run
    }
    summary["overlap_efficiency"] = max(summary["gen_time_s"], summary["train_time_s"]) / summary["step_time_s"]
    summary["rl_time_s"] = metrics[-1]["rl_s"]  # from the first weight sync to the last step (no start-up)
    summary["completion_tokens_per_s"] = summary["completion_tokens"] / summary["rl_time_s"]
    summary["truncated_samples"] = sum(m["truncated"] for m in metrics)
    if evals:
        summary.update(eval_reward_first=evals[0]["reward"], eval_version_first=evals[0]["version"],
                       eval_reward_last=evals[-1]["reward"], eval_version_last=evals[-1]["version"])
    return summary


def step_line(m: dict) -> str:
    hist = " ".join(f"{k}:{v}" for k, v in sorted(m["staleness"].items(), key=lambda kv: int(kv[0])))
    return (f"step {m['step']:4d}  reward {m['reward']:.3f}  step {m['step_time_s']:.3f}s  "
            f"gen {m['gen_time_s']:.3f}s  train {m['train_time_s']:.3f}s  sync {m['sync_time_s'] * 1e3:.1f}ms  "
            f"stall {m['stall_time_s'] * 1e3:.1f}ms  "
            f"staleness [{hist}]  kl {m['mismatch_kl']:.2e}  dropped {m['dropped']}"
            + (f"  ref-kl {m['ref_kl']:.2e}" if m.get("ref_kl") is not None else ""))


class TraceWriter:
    """trace.json (chrome://tracing, ui.perfetto.dev), written as the run goes: one
    process row per executor role (named when it first appears), one thread row per
    rank. Each batch of spans (role, rank, name, start, end, args) is appended with
    one write that also rewrites the closing brackets after it, so the file is valid
    JSON after every write, and a run killed between two writes leaves every span
    received before the kill. (A kill that lands inside a write which spans two
    pages of the file can cut it there, Linux checking for a fatal signal between
    pages: the file then ends without its brackets, which Perfetto still loads.) A
    write that fails (a full disk) is logged and ends the trace, not the run.
    Nothing is kept in memory but the roles seen."""

    _HEAD = b'{"displayTimeUnit": "ms", "traceEvents": ['
    _TAIL = b"]}"

    def __init__(self, path: Path, t0: float):
        self.path, self.t0 = path, t0
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._end = 0
        self._write(self._HEAD + self._TAIL)
        self._end = len(self._HEAD)  # where the next event goes, the tail after it
        self._pids: dict[str, int] = {}

    def add(self, spans: list[tuple]) -> None:
        if self._fd is None or not spans:
            return
        events = []
        for role, rank, name, start, end, args in spans:
            if role not in self._pids:
                self._pids[role] = len(self._pids) + 1
                events.append({"name": "process_name", "ph": "M", "pid": self._pids[role], "args": {"name": role}})
            events.append({"name": name, "ph": "X", "pid": self._pids[role], "tid": rank, "ts": (start - self.t0) * 1e6,
                           "dur": max(end - start, 0.0) * 1e6, "args": args})
        data = ("" if self._end == len(self._HEAD) else ",\n").encode() + ",\n".join(map(json.dumps, events)).encode()
        if self._write(data + self._TAIL):
            self._end += len(data)

    def _write(self, data: bytes) -> bool:
        """`data` at the end of the events (one system call unless the kernel writes
        less); False, with the trace closed and the reason logged, if it fails."""
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(self._fd, data[done:], self._end + done)
            return True
        except OSError as exc:
            logging.getLogger(__name__).warning("%s: the trace stops here, a write failed: %s", self.path, exc)
            self.close()
            return False

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_lines(path: Path) -> list[dict]:
    """The records of the JSON-lines file `path` ([] if there is none)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def moving_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the up to window - 1 before it (a trailing window: the
    line at a step uses no later step)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_reward(path: Path, runs: dict[str, list[dict]], evals: dict[str, list[dict]] | None = None) -> None:
    """PNG: mean reward of each trainer step (faint points) and its moving mean
    (line) against the seconds since that run's RL began, one colour per run, and
    each run's greedy reward on the held-out prompts as points (evals). Each run
    starts at 0 from its own first step: start-up and the supervised warm-up are
    left out, so a cold first run and a warm second one (--compare) line up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    # About 20 windows over the run: 60 steps for the default 1200, steady enough to compare runs.
    window = max(1, max(len(metrics) for metrics in runs.values()) // 20)
    for label, metrics in runs.items():
        start = metrics[0]["wall_s"] - metrics[0]["rl_s"]  # the wall time at which this run's RL began
        seconds = [m["wall_s"] - start for m in metrics]
        rewards = [m["reward"] for m in metrics]
        line, = ax.plot(seconds, moving_mean(rewards, window), label=f"{label}: train (mean of {window} steps)",
                        linewidth=1.6)
        ax.plot(seconds, rewards, ".", color=line.get_color(), alpha=0.25, markersize=2)
        held_out = (evals or {}).get(label)
        if held_out:
            ax.plot([e["wall_s"] - start for e in held_out], [e["reward"] for e in held_out], "o--",
                    color=line.get_color(), label=f"{label}: held-out (greedy)", markersize=4)
    ax.set_title(f"{' vs '.join(runs)}: mean reward per trainer step")
    ax.set_xlabel("seconds since RL began (start-up and warm-up left out)")
    ax.set_ylabel("mean reward per step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
