"""`llamarl plan --choose`: the placements of a scenario's GPUs with the lowest
predicted step time that fit.

It searches the mode (sync; async at the scenario's staleness bound, or 1), the
generator / trainer split (async; in whole nodes once there are two or more, and the scenario's own), the
generator's tp (its replicas follow) and the trainer's tp / pp / ep (its dp
follows; cp kept as given). Each side's candidates are ranked by its own time
first (a side's time does not depend on the other side's parallelism), and the
best few of each are predicted together, so the search stays small at 1,024 GPUs.
The scenario's own placement is a candidate too. A placement that does not divide
or does not fit is left out; none fitting is a PlanError naming the scenario.
"""

from __future__ import annotations

import dataclasses
import itertools

from .cost import CostModel, Prediction
from .devices import PlanError
from .scenario import Scenario, Side, check_generator, check_trainer

POWERS = (1, 2, 4, 8, 16, 32, 64)
PIPELINES = (1, 2, 4, 8, 16)
KEEP = 4  # candidates per side predicted together
MAX_SPLITS = 32


def _fits(fn):
    """fn(), or None where it raises PlanError (a placement that does not divide or fit)."""
    try:
        return fn()
    except PlanError:
        return None


def _probe(s: Scenario, mode: str, staleness: int, generator: Side, trainer: Side) -> Scenario | None:
    """s with this placement, or None where it does not divide."""
    return _fits(lambda: s.with_placement(mode, generator, trainer, staleness))


def _alone(s: Scenario, mode: str, generator: Side, trainer: Side, check) -> Scenario | None:
    """s with this placement for timing one side, only that side checked (`check`), or None."""
    probe = dataclasses.replace(s, mode=mode, generator=generator, trainer=trainer)
    try:
        check(probe)
    except PlanError:
        return None
    return probe


def _generators(model: CostModel, s: Scenario, mode: str, gpus: int, others: int) -> list[Side]:
    """The generator sides of `gpus` GPUs that fit, fastest first (KEEP of them)."""
    ranked = []
    for tp in POWERS:
        side = Side(gpus=gpus, tp=tp, dtype=s.generator.dtype)
        probe = _alone(s, mode, side, dataclasses.replace(s.trainer, gpus=others), check_generator)
        if probe is not None and _fits(lambda: model.generator_memory(probe)) is not None:
            ranked.append((model.generation(probe, {}), side))
    return [side for _, side in sorted(ranked, key=lambda pair: pair[0])[:KEEP]]


def _trainers(model: CostModel, s: Scenario, mode: str, gpus: int, others: int) -> list[Side]:
    """The trainer sides of `gpus` GPUs that divide and fit, fastest first (KEEP of them)."""
    experts = (1,) + tuple(p for p in POWERS[1:] if s.model.moe and s.model.experts % p == 0)
    ranked = []
    for tp, pp, ep in itertools.product(POWERS[:4], PIPELINES, experts):
        side = Side(gpus=gpus, tp=tp, pp=pp, cp=s.trainer.cp, ep=ep, dtype=s.trainer.dtype)
        probe = _alone(s, mode, dataclasses.replace(s.generator, gpus=others), side, check_trainer)
        if probe is not None and _fits(lambda: model.trainer_memory(probe)) is not None:
            # Colocated, the trainer's state also sets the swap: ranked with it.
            ranked.append((model.training(probe, {}) + model.swap(probe), side))
    return [side for _, side in sorted(ranked, key=lambda pair: pair[0])[:KEEP]]


def splits(total: int, gpus_per_node: int) -> list[int]:
    """Generator GPU counts to try: whole nodes once there are two, at most MAX_SPLITS of them, evenly spread."""
    unit = gpus_per_node if total >= 2 * gpus_per_node else 1
    options = list(range(unit, total, unit))
    if len(options) > MAX_SPLITS:
        stride = len(options) / MAX_SPLITS
        options = sorted({options[int(i * stride)] for i in range(MAX_SPLITS)})
    return options


def choose(model: CostModel, s: Scenario, top: int = 5) -> list[tuple[Scenario, Prediction]]:
    """The `top` placements of s's GPUs with the lowest predicted step times, best
    first; s's own placement among the candidates. PlanError for a `top` that is
    not a positive integer."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise PlanError(f"top must be a positive integer, got {top!r}")
    total = s.gpus
    bound = s.max_staleness if s.mode == "async" and s.max_staleness >= 1 else 1
    found: list[tuple[Scenario, Prediction]] = []
    given = _fits(lambda: model.predict(s))
    if given is not None:
        found.append((s, given))
    async_splits = set(splits(total, s.gpus_per_node)) | ({s.generator.gpus} if s.mode == "async" else set())
    layouts = [("sync", 0, total, total)] + [("async", bound, g, total - g) for g in sorted(async_splits)]
    for mode, staleness, gen_gpus, train_gpus in layouts:
        generators = _generators(model, s, mode, gen_gpus, train_gpus)
        trainers = _trainers(model, s, mode, train_gpus, gen_gpus)
        for generator, trainer in itertools.product(generators, trainers):
            candidate = _probe(s, mode, staleness, generator, trainer)
            prediction = None if candidate is None else _fits(lambda: model.predict(candidate))
            if prediction is not None and candidate != s:
                found.append((candidate, prediction))
    if not found:
        raise PlanError(f"{s.name}: no placement of its {total} GPUs fits")
    # Ties (the slower side sets the step) go to the placement that leaves the other side least loaded.
    found.sort(key=lambda pair: (round(pair[1].step_time_s, 6), pair[1].gen_time_s + pair[1].train_time_s))
    return found[:top]


def describe(s: Scenario) -> str:
    """A placement in one line: "async gen 8x tp1 | train 8 tp1 pp1 ep1 dp8"."""
    g, t = s.generator, s.trainer
    gen = f"gen {g.gpus // g.tp}x tp{g.tp}"
    train = f"train {t.gpus} tp{t.tp}" + (f" cp{t.cp}" if t.cp > 1 else "") + f" pp{t.pp} ep{t.ep} dp{t.dp}"
    where = f"sync on {s.gpus}" if s.mode == "sync" else f"async {g.gpus}+{t.gpus} (staleness {s.max_staleness})"
    return f"{where}: {gen} | {train}"
