"""What a run writes into its folder as it goes, apart from the controller that
decides what runs: each record is appended and its file closed at once, so a run
killed at any moment leaves lines that parse, and the run keeps no record in
memory (summary.json and reward.png are made from the files).

    metrics.jsonl   a line per trainer step, once the weights it made have landed
    eval.jsonl      a line per evaluated version (greedy completions of held-out prompts)
    rollouts.jsonl  every scored sample of a step (TrainConfig.log_rollouts)
    trace.json      the executors' spans (report.TraceWriter)

A resumed run keeps the lines of the steps before its checkpoint and drops the
rest (the steps after it are trained again), and its clocks go on from the kept
steps' (wall_s: since the run first started; rl_s: since its first sync). Which
versions are evaluated is decided here too: every eval_every versions and the
last, each once.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .config import TrainConfig
from .data import RunData
from .report import TraceWriter, plot_reward, read_lines, summarize


def _keep_lines(path: Path, keep) -> list[dict]:
    """Rewrite the JSON-lines file `path` (if there is one) with only the records
    `keep` accepts; returns them."""
    if not path.exists():
        return []
    kept = [record for line in path.read_text().splitlines() if line.strip() and keep(record := json.loads(line))]
    path.write_text("".join(json.dumps(record) + "\n" for record in kept))
    return kept


class RunRecorder:
    """The records of one run in `out` (a fresh trace from now on, also on resume).
    on_step(record) is called with each metrics line, on_event(text) with each
    evaluation's line for the log."""

    def __init__(self, out: Path, config: TrainConfig, data: RunData, on_step, on_event):
        self.out, self.config, self.data = out, config, data
        self.on_step, self.on_event = on_step, on_event
        self.t0 = self.rl_start = time.monotonic()
        self.trace = TraceWriter(out / "trace.json", self.t0)
        self.resumed_wall = self.resumed_rl = 0.0  # what the kept steps took
        self.evals: dict[int, list] = {}  # version -> its evaluated samples so far, until its record is written
        self.last_evaluated = -1  # the last version whose evaluation was recorded

    def keep_until(self, step: int) -> None:
        """RL starts (or goes on) at `step`: the metrics and rollouts of the steps
        before it are kept, and the evaluations of the versions before it, the rest
        dropped (a fresh run's files: nothing)."""
        kept = _keep_lines(self.out / "metrics.jsonl", lambda m: m["step"] < step)
        evaluated = _keep_lines(self.out / "eval.jsonl", lambda e: e["version"] < step)
        _keep_lines(self.out / "rollouts.jsonl", lambda r: r["step"] < step)
        self.last_evaluated = max((e["version"] for e in evaluated), default=-1)
        self.resumed_wall, self.resumed_rl = (kept[-1]["wall_s"], kept[-1]["rl_s"]) if kept else (0.0, 0.0)

    def rl_started(self, now: float) -> None:
        """RL's clock starts at `now` (the first sync begun)."""
        self.rl_start = now

    def wall_s(self, now: float) -> float:
        return now - self.t0 + self.resumed_wall

    def clocks(self, now: float) -> dict:
        """A step record's clocks at `now`: wall_s (since the run first started) and rl_s
        (since its first sync), the kept steps' seconds included."""
        return {"wall_s": self.wall_s(now), "rl_s": now - self.rl_start + self.resumed_rl}

    def step(self, record: dict) -> None:
        """Append a step's record."""
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        self.on_step(record)

    def rollouts(self, step: int, samples: list) -> None:
        with open(self.out / "rollouts.jsonl", "a") as f:
            for x in samples:
                f.write(json.dumps({"step": step, "group": x.group, "prompt": self.data.problem(x.group).prompt,
                                    "completion": self.data.tokenizer.decode(x.tokens), "reward": x.reward,
                                    "finished": x.finished, "versions": [min(x.versions), max(x.versions)]}) + "\n")

    # -- evaluations ---------------------------------------------------------------------
    def eval_prompts(self, version: int) -> list | None:
        """The held-out prompts (index, token ids) the generator completes greedily with
        weights `version`: every eval_every versions and at the last, once each; else None."""
        every = self.config.run.eval_every
        if not every or (version % every and version != self.config.run.steps) or version in self.evals \
                or version <= self.last_evaluated:
            return None
        self.evals[version] = []
        return [(i, self.data.prompt_ids(i, eval=True)) for i in range(self.data.eval_size)]

    def evaluated(self, samples: list) -> None:
        """Evaluated samples of one version; its record once they are all in."""
        version = samples[0].versions[0]
        done = self.evals.get(version)
        if done is None:
            return  # asked of a generator since replaced (its evaluation is asked again)
        done.extend(samples)
        if len(done) < self.data.eval_size:
            return
        record = {"version": version, "reward": sum(x.reward for x in done) / len(done), "samples": len(done),
                  "truncated": sum(not x.finished for x in done),
                  "completion_tokens": sum(len(x.tokens) for x in done) / len(done),
                  "wall_s": self.wall_s(time.monotonic())}
        # Its samples go: versions only grow (a re-sync evaluates the current one), so the last
        # version evaluated is all that must be remembered.
        del self.evals[version]
        self.last_evaluated = max(self.last_evaluated, version)
        with open(self.out / "eval.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        self.on_event(f"eval v{version}: greedy reward {record['reward']:.3f} on {len(done)} held-out prompts")

    def evals_pending(self) -> bool:
        return any(len(done) < self.data.eval_size for done in self.evals.values())

    def drop_pending_evals(self) -> None:
        """The evaluations not complete are lost (with generator replica 0); a re-sync
        evaluates its own version if due."""
        for version in [v for v, done in self.evals.items() if len(done) < self.data.eval_size]:
            del self.evals[version]

    # -- the end -----------------------------------------------------------------------
    def summary(self, steal: float) -> dict:
        """The run's figures (report.summarize) from its files, `steal` the CPU steal fraction."""
        return summarize(self.config.run.mode, read_lines(self.out / "metrics.jsonl"), self.wall_s(time.monotonic()),
                         steal, read_lines(self.out / "eval.jsonl"))

    def close(self) -> None:
        """The trace closed; reward.png drawn if any step was recorded."""
        self.trace.close()
        metrics = read_lines(self.out / "metrics.jsonl")
        if metrics:
            plot_reward(self.out / "reward.png", {self.config.run.mode: metrics},
                        {self.config.run.mode: read_lines(self.out / "eval.jsonl")})
