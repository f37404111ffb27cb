"""A local calibration: this machine's figures (local.Machine), the local model's
factors (local.LOCAL_FACTORS) fit on the probe runs `llamarl plan calibrate` made
(pipeline/probes.py), and those probes, in one JSON file (kind "local")."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from .calibration import from_factors, minimize, read_calibration, to_factors
from .cost import Prediction
from .devices import PlanError
from .local import LOCAL_FACTORS, LocalModel, LocalRun, Machine

# The figures of a probe run the fit weighs, and how much: the step and each phase; the sync, a few
# milliseconds, at a quarter.
FIT_WEIGHTS = {"step_time_s": 1.0, "gen_time_s": 1.0, "train_time_s": 1.0, "sync_time_s": 0.25}
LOCAL_STARTS = ({"forward_s": 1e-4, "generation_efficiency": 0.3, "train_efficiency": 0.3, "collective_s": 1e-4,
                 "fsdp_unit_s": 1e-3, "time_sharing": 0.5, "train_step_s": 0.01, "sample_s": 1e-4, "sync_s": 1e-3,
                 "step_overhead_s": 0.005},
                {"forward_s": 3e-4, "generation_efficiency": 0.6, "train_efficiency": 0.6, "collective_s": 1e-3,
                 "fsdp_unit_s": 5e-3, "time_sharing": 0.9, "train_step_s": 0.003, "sample_s": 3e-5, "sync_s": 3e-4,
                 "step_overhead_s": 0.002})
KIND = "local"


def _figures(prediction: Prediction) -> dict:
    return {"step_time_s": prediction.step_time_s, "gen_time_s": prediction.gen_time_s,
            "train_time_s": prediction.train_time_s, "sync_time_s": prediction.sync_time_s}


def fit_local(machine: Machine, runs: list[tuple[LocalRun, dict]]) -> "LocalCalibration":
    """The calibration of `runs` ((run, its measured FIT_WEIGHTS figures) on `machine`):
    the factors minimising the weighted sum of log(predicted / measured)^2 over the
    figures (calibration.minimize from LOCAL_STARTS), and how the fit went (its
    median and largest step-time errors); no probes recorded (calibrate adds them)."""
    if not runs:
        raise PlanError("fit: no probe runs")
    names = tuple(LOCAL_FACTORS)

    def model_of(z):
        return LocalModel(machine, to_factors(names, z, LOCAL_FACTORS))

    def loss(z):
        model, total = model_of(z), 0.0
        for run, measured in runs:
            predicted = _figures(model.predict(run))
            total += sum(weight * math.log(predicted[key] / measured[key]) ** 2 for key, weight in FIT_WEIGHTS.items())
        return total

    z, _ = minimize(loss, [from_factors(names, start, LOCAL_FACTORS) for start in LOCAL_STARTS], iterations=800)
    model = model_of(z)
    errors = [model.predict(run).step_time_s / measured["step_time_s"] - 1 for run, measured in runs]
    return LocalCalibration(machine, model.f, {
        "runs": len(runs), "free_factors": len(names), "median_abs_step_error": statistics.median(map(abs, errors)),
        "max_abs_step_error": max(map(abs, errors)), "step_errors": {run.name: e for (run, _), e in zip(runs, errors)}})


@dataclass
class LocalCalibration:
    """This machine's figures, the local factors fit on its probe runs, and the probes
    (each one's placement, shape and measured figures)."""

    machine: Machine
    factors: dict
    fit: dict = field(default_factory=dict)
    probes: list = field(default_factory=list)

    def model(self) -> LocalModel:
        worst = self.fit.get("max_abs_step_error")
        return LocalModel(self.machine, self.factors, (
            f"local calibration: {len(self.probes)} probe runs on the calibrated machine"
            + (f", step time within {worst:.0%} of each probe" if isinstance(worst, (int, float)) else ""),))

    def save(self, path) -> None:
        Path(path).write_text(json.dumps({"kind": KIND, "device": "cpu", "machine": dataclasses.asdict(self.machine),
                                          "factors": self.factors, "fit": self.fit, "probes": self.probes},
                                         indent=1) + "\n")

    @classmethod
    def from_dict(cls, data, where: str) -> "LocalCalibration":
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise PlanError(f"{where}: not a local calibration (`llamarl plan calibrate` writes one); a GPU "
                            "calibration predicts rows in the published-runs format, not a `llamarl train` run")
        machine = Machine.from_dict(data.get("machine"), where)
        factors = data.get("factors")
        if not isinstance(factors, dict):
            raise PlanError(f"{where}: factors must be an object")
        try:
            LocalModel(machine, factors)  # every factor present, known and within its bounds
        except PlanError as exc:
            raise PlanError(f"{where}: {exc}") from None
        fit_info, probes = data.get("fit") or {}, data.get("probes") or []
        if not isinstance(fit_info, dict) or not isinstance(probes, list):
            raise PlanError(f"{where}: fit must be an object and probes a list")
        return cls(machine, dict(factors), fit_info, probes)

    @classmethod
    def load(cls, path) -> "LocalCalibration":
        return cls.from_dict(read_calibration(path), f"--calibration {path}")
