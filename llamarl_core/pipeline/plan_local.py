"""`llamarl plan` on a `llamarl train` run of this machine: `plan calibrate -o
CAL.json` (probes.calibrate), `plan RUN/config.json --calibration CAL.json
[--json] [--choose]` (the run predicted, or its placements ranked), and
`llamarl train --auto-placement`'s choice (auto_placement)."""

from __future__ import annotations

import json
from pathlib import Path

from ..planner.devices import PlanError
from ..planner.local import LocalCalibration, choose_local, describe_local
from .config import TrainConfig
from .probes import local_run


def load_run_config(path: str) -> TrainConfig:
    """A run's config.json (or its folder), checked as `llamarl train --resume` checks
    it: PlanError naming the file and what is wrong."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        return TrainConfig.load(file)
    except (OSError, json.JSONDecodeError, ValueError, TypeError) as exc:
        raise PlanError(f"SCENARIO {path}: {exc}") from None


def _calibration(path: str | None) -> LocalCalibration:
    if path is None:
        raise PlanError("a `llamarl train` run is predicted on this machine's own calibration: make one with "
                        "`llamarl plan calibrate -o cpu.json` (about 2 minutes) and pass --calibration cpu.json")
    return LocalCalibration.load(path)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f}"


def predict(path: str, calibration_path: str | None, as_json: bool, choose: bool, top: int) -> int:
    calibration = _calibration(calibration_path)
    model = calibration.model()
    run = local_run(load_run_config(path), name=str(path))
    given = model.predict(run)
    if choose:
        best = choose_local(model, run, top)
        if as_json:
            print(json.dumps({"given": {"placement": run.placement(), **given.as_json()},
                              "best": [{"placement": r.placement(), **p.as_json()} for r, p in best]}, indent=1))
            return 0
        print(f"{'placement':54s} {'step ms':>8s} {'gen ms':>8s} {'train ms':>8s}")
        for label, r, p in [("given", run, given)] + [(f"#{i + 1}", r, p) for i, (r, p) in enumerate(best)]:
            print(f"{label:6s}{describe_local(r):48s} {_ms(p.step_time_s)} {_ms(p.gen_time_s)} {_ms(p.train_time_s)}")
        print(f"best: {best[0][1].bottleneck}")
        return 0
    if as_json:
        print(json.dumps({"name": run.name, "placement": run.placement(), **given.as_json()}, indent=1))
        return 0
    print(f"{run.name}: {describe_local(run)}")
    print(f"step {given.step_time_s * 1e3:.1f} ms = gen {given.gen_time_s * 1e3:.1f} ms, train "
          f"{given.train_time_s * 1e3:.1f} ms, sync {given.sync_time_s * 1e3:.2f} ms "
          f"({'overlapped' if run.mode == 'async' else 'one after the other'}); memory GiB a rank: generator "
          f"{given.memory_gib_per_gpu['generator']:.3f}, trainer {given.memory_gib_per_gpu['trainer']:.3f}")
    print(f"bottleneck: {given.bottleneck}")
    print("assumptions:")
    for line in given.assumptions:
        print(f"  - {line}")
    return 0


def auto_placement(config: TrainConfig, calibration_path: str | None) -> tuple[TrainConfig, str]:
    """`config` with the placement (mode, generator tp and replicas, trainer world)
    of the lowest predicted step time, and a line saying what was chosen and why."""
    calibration = _calibration(calibration_path)
    model = calibration.model()
    run = local_run(config)
    given = model.predict(run)
    chosen, prediction = choose_local(model, run, top=1)[0]
    changes = {"mode": chosen.mode, "generator_tp": chosen.generator_tp, "generator_replicas": chosen.replicas,
               "trainer_world": chosen.trainer_world}
    if chosen.mode == "async":
        changes["max_staleness"] = config.run.max_staleness or 1
    why = (f"auto-placement: {describe_local(chosen)}, predicted step {prediction.step_time_s * 1e3:.1f} ms "
           f"(the given {describe_local(run)}: {given.step_time_s * 1e3:.1f} ms); bottleneck: {prediction.bottleneck}")
    return config.replace(**changes), why
