"""The check's schedule: steps in priority order under one time budget (a plain class).

A step starts only if the budget left covers its estimate and every step it needs
passed; otherwise it is recorded as skipped, with the reason. A started step runs
to its end under its own timeout (the step enforces it): the budget never cuts a
step half way. The steps that start fit the budget by their estimates, so the whole
run overruns it by no more than the started steps overrun their estimates, and
never by more than the largest timeout_s - estimate_s of a step (the last one
started can take its whole timeout). A step may also find it cannot run here (a
tool missing): its Outcome says skipped, with the reason. Steps named in `skip`
are recorded as skipped, left out by the caller (a rerun measuring only what changed).

A step `beside` the step before it starts with that one, in a thread of its own
(steps that measure nothing, such as tests beside a sanitizer run): each of the
two is decided as if it started alone, and the next step starts once both end.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Collection

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclass
class Outcome:
    """What a step's run reports: passed or not (or skipped: it cannot run here), one
    line, and the figures it measured (dicts of `name, value, unit, limit, ratio, target`)."""

    passed: bool
    summary: str
    rows: list[dict] = field(default_factory=list)
    skipped: bool = False


@dataclass(frozen=True)
class Step:
    """One step: `run(timeout_s)` does the work and returns an Outcome; it must stop
    (and clean up) by `timeout_s`. `estimate_s`: its expected time on the target GPU,
    which decides whether it starts. `needs`: names of earlier steps that must have
    passed (a step needing a skipped or failed one is skipped). `beside`: the name of
    the step right before this one, which this one runs beside (see above)."""

    name: str
    estimate_s: float
    timeout_s: float
    run: Callable[[float], Outcome]
    needs: tuple[str, ...] = ()
    beside: str | None = None

    def __post_init__(self):
        if not self.estimate_s > 0 or not self.timeout_s >= self.estimate_s:
            raise ValueError(f"step {self.name!r}: needs 0 < estimate_s <= timeout_s, got "
                             f"estimate_s={self.estimate_s}, timeout_s={self.timeout_s}")


@dataclass
class Record:
    name: str
    status: str  # PASSED | FAILED | SKIPPED
    seconds: float
    estimate_s: float
    summary: str
    rows: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "seconds": round(self.seconds, 2),
                "estimate_s": self.estimate_s, "summary": self.summary}


class BudgetRun:
    """Runs steps in order within `budget_s` seconds of `clock` counted from `start`
    (default: now), so that time spent before the steps (a build) can be counted."""

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic, start: float | None = None,
                 on_event: Callable[[str], None] | None = None, on_record: Callable[[list], None] | None = None,
                 skip: Collection[str] = ()):
        if not budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {budget_s}")
        self.budget_s = budget_s
        self.skip = frozenset(skip)
        self.clock = clock
        self.start = clock() if start is None else start
        self.on_event = on_event or (lambda line: None)
        self.on_record = on_record or (lambda records: None)  # after each step: the records so far
        self.records: list[Record] = []

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def decide(self, step: Step) -> str | None:
        """Why `step` must not start now (None: it starts)."""
        if step.name in self.skip:
            return "left out (--skip)"
        status = {r.name: r.status for r in self.records}
        for need in step.needs:
            if need not in status:
                raise ValueError(f"step {step.name!r} needs {need!r}, which is not an earlier step")
            if status[need] != PASSED:
                return f"needs {need}, which {status[need]}"
        left = self.left()
        if step.estimate_s > left:
            return f"needs about {step.estimate_s:.0f} s, {max(left, 0):.0f} s of the budget left"
        return None

    def run(self, steps: list[Step]) -> list[Record]:
        names = [s.name for s in steps]
        if len(set(names)) != len(names):
            raise ValueError(f"step names must be unique, got {names}")
        unknown = sorted(self.skip - set(names))
        if unknown:
            raise ValueError(f"skip names no step: {unknown} (the steps: {names})")
        groups: list[list[Step]] = []
        for step in steps:
            if step.beside is None:
                groups.append([step])
            elif not groups or groups[-1][-1].name != step.beside:
                raise ValueError(f"step {step.name!r} runs beside {step.beside!r}, which is not the step before it")
            else:
                together = [s.name for s in groups[-1] if s.name in step.needs]
                if together:
                    raise ValueError(f"step {step.name!r} needs {together[0]!r}, which it runs beside")
                groups[-1].append(step)
        for group in groups:
            self._run_group(group)
        return self.records

    def _run_group(self, group: list[Step]) -> None:
        """A step and the steps beside it: each decided now, those that start run side
        by side (threads), their records kept in the group's order."""
        reasons = [self.decide(step) for step in group]
        starting = [step for step, reason in zip(group, reasons) if reason is None]
        for step in starting:
            self.on_event(f"[{self.elapsed():6.1f} s] {step.name}: started (about {step.estimate_s:.0f} s, "
                          f"at most {step.timeout_s:.0f} s)")
        outcomes: dict[str, tuple[Outcome, float]] = {}
        threads = [threading.Thread(target=self._run_step, args=(step, outcomes), name=f"check: {step.name}")
                   for step in starting[1:]]
        for thread in threads:
            thread.start()
        if starting:
            self._run_step(starting[0], outcomes)
        for thread in threads:
            thread.join()  # each step stops by its own timeout
        for step, reason in zip(group, reasons):
            if reason is not None:
                self.records.append(Record(step.name, SKIPPED, 0.0, step.estimate_s, f"skipped: {reason}"))
                self.on_event(f"[{self.elapsed():6.1f} s] {step.name}: skipped ({reason})")
            else:
                outcome, seconds = outcomes[step.name]
                status = SKIPPED if outcome.skipped else PASSED if outcome.passed else FAILED
                self.records.append(Record(step.name, status, seconds, step.estimate_s, outcome.summary, outcome.rows))
                self.on_event(f"[{self.elapsed():6.1f} s] {step.name}: {status} in {seconds:.1f} s: {outcome.summary}")
            self.on_record(self.records)

    def _run_step(self, step: Step, outcomes: dict[str, tuple[Outcome, float]]) -> None:
        began = self.clock()
        try:
            outcome = step.run(step.timeout_s)
        except Exception as exc:  # a step's own error fails that step, not the run
            outcome = Outcome(False, f"{type(exc).__name__}: {exc}")
        outcomes[step.name] = (outcome, self.clock() - began)
