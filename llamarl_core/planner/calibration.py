"""One calibration per kind of device: the cost model's named factors (cost.FACTORS),
fit once on measured runs, never per row, and how far the fit lands.

`fit(runs)` minimises the sum over runs of log(predicted / measured step time)^2
(a run off by 2x weighs the same whichever way) over the factors within their
bounds, by Nelder-Mead from several starts in a space where each bound is
unreachable (a logistic map). `leave_one_out(runs)` refits without each run in
turn and predicts it: the error a new run of the kind may expect.

A calibration file (JSON): {"device", "factors": {name: value}, "fit": {...},
"device_specs": {...} (for "cpu": the machine's measured figures)}.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .cost import FACTORS, CostModel
from .devices import CPU, PlanError, device
from .scenario import Scenario, from_row

NAMES = tuple(FACTORS)


def to_factors(names, z, table: dict = FACTORS) -> dict:
    """Unbounded coordinates -> factor values within their bounds in `table` (a logistic map)."""
    out = {}
    for name, value in zip(names, z):
        lo, hi, _ = table[name]
        out[name] = min(hi, max(lo, lo + (hi - lo) / (1 + math.exp(-float(np.clip(value, -40, 40))))))
    return out


def from_factors(names, factors: dict, table: dict = FACTORS) -> np.ndarray:
    z = []
    for name in names:
        lo, hi, _ = table[name]
        u = min(max((factors[name] - lo) / (hi - lo), 1e-6), 1 - 1e-6)
        z.append(math.log(u / (1 - u)))
    return np.array(z)


def nelder_mead(fn, x0: np.ndarray, step: float = 1.0, iterations: int = 3000, tol: float = 1e-10):
    """Minimise fn from x0 (Nelder-Mead, standard coefficients); returns (x, fn(x))."""
    n = len(x0)
    simplex = [x0.copy()] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [fn(x) for x in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if abs(values[-1] - values[0]) < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = fn(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            fe = fn(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = fn(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [best + 0.5 * (x - best) for x in simplex[1:]]
                values = [values[0]] + [fn(x) for x in simplex[1:]]
    i = int(np.argmin(values))
    return simplex[i], values[i]


def read_calibration(path):
    """A calibration file's JSON: PlanError naming --calibration PATH when it cannot be read."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not text
        raise PlanError(f"--calibration {path}: {exc}") from None


def minimize(loss, starts: list, iterations: int):
    """(z, loss(z)): Nelder-Mead from each of `starts` for `iterations`, then the best
    restarted twice with smaller simplices (it stalls on ridges). Deterministic."""
    z, value = min((nelder_mead(loss, start, iterations=iterations) for start in starts), key=lambda pair: pair[1])
    for step in (0.5, 0.1):
        z, value = nelder_mead(loss, z, step=step, iterations=1000)
    return z, value


@dataclass
class Calibration:
    """A device kind's factors (cost.FACTORS), how the fit went, and for "cpu" the
    machine's measured figures (device_specs)."""

    device: str
    factors: dict
    fit: dict = field(default_factory=dict)
    device_specs: dict | None = None

    def model(self) -> CostModel:
        """The cost model of these factors; a factor the fit held is said with every prediction."""
        held = self.fit.get("held") or []
        return CostModel(self.factors, tuple(f"{name} held at {self.factors[name]:g}, not fit (no run of the fit "
                                                 "informs it)" for name in held))

    def scenario(self, row: dict, base=None) -> Scenario:
        """The Scenario of `row` (the published-runs format) under this calibration:
        a CPU row takes the measured figures; a GPU row under another GPU's factors
        says so in its assumptions; a CPU row under GPU factors (or the reverse) is
        a PlanError. base: the folder a relative hf_config path is read from."""
        cpu = str(row.get("gpu", "")).lower() == CPU if isinstance(row, dict) else False
        if cpu != (self.device == CPU):
            raise PlanError(f"{row.get('name', 'scenario')}: a {row.get('gpu')!r} scenario under a calibration "
                            f"of {self.device!r}: CPU and GPU factors do not carry over")
        scenario = from_row(row, self.device_specs if cpu else None, base)
        if not cpu and device(self.device).name != scenario.device.name:
            scenario = dataclasses.replace(scenario, assumptions=scenario.assumptions + ((
                "calibration", f"efficiencies fit on {self.device} runs, applied to {scenario.device.name}'s "
                "published peaks"),))
        return scenario

    def save(self, path) -> None:
        Path(path).write_text(json.dumps({"device": self.device, "factors": self.factors, "fit": self.fit,
                                          "device_specs": self.device_specs}, indent=1) + "\n")

    @classmethod
    def load(cls, path) -> "Calibration":
        data = read_calibration(path)
        if isinstance(data, dict) and data.get("kind") == "local":
            raise PlanError(f"--calibration {path}: a local calibration (`llamarl plan calibrate`): it predicts a "
                            "`llamarl train` run (its config.json), not rows in the published-runs format")
        if not isinstance(data, dict) or not isinstance(data.get("factors"), dict) or "device" not in data:
            raise PlanError(f"--calibration {path}: not a calibration (an object with device and factors)")
        factors, where = data["factors"], f"--calibration {path}"
        try:
            CostModel(factors)  # every factor present, a number within its bounds
        except PlanError as exc:
            raise PlanError(f"{where}: {exc}") from None
        fit_info = data.get("fit") or {}
        if not isinstance(fit_info, dict):
            raise PlanError(f"{where}: fit must be an object, got {type(fit_info).__name__}")
        held = fit_info.get("held") or []
        if not isinstance(held, list) or any(not isinstance(name, str) or name not in FACTORS for name in held):
            raise PlanError(f"{where}: fit.held must list factors of {list(FACTORS)}, got {held!r}")
        entries = fit_info.get("leave_one_out") or []
        if not isinstance(entries, list) or not all(_loo_entry(entry) for entry in entries):
            raise PlanError(f"{where}: fit.leave_one_out must be a list of objects with a name, predicted_s (a "
                            "positive number) and error (a number)")
        specs = data.get("device_specs")
        if specs is not None and not isinstance(specs, dict):
            raise PlanError(f"{where}: device_specs must be an object")
        if not isinstance(data["device"], str):
            raise PlanError(f"{where}: device must be a device's name, got {data['device']!r}")
        try:
            device(data["device"], specs if data["device"].lower() == CPU else None)
        except PlanError as exc:
            raise PlanError(f"{where}: {exc}") from None
        return cls(data["device"], factors, fit_info, specs)


def _loo_entry(entry) -> bool:
    """Whether `entry` is a leave-one-out result as fit writes it."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        return False
    predicted, error = entry.get("predicted_s"), entry.get("error")
    return (all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (predicted, error))
            and predicted > 0)


STARTS = ({"decode_bandwidth": 0.5, "generation_compute": 0.5, "decode_step_s": 0.005,
           "collective_latency_s": 2e-5, "train_mfu_dense": 0.4, "train_mfu_moe": 0.2, "link_efficiency": 0.5,
           "host_link_efficiency": 0.5, "step_overhead_s": 5.0, "length_shape": 1.0},
          {"decode_bandwidth": 0.8, "generation_compute": 0.3, "decode_step_s": 0.001,
           "collective_latency_s": 1e-5, "train_mfu_dense": 0.25, "train_mfu_moe": 0.1, "link_efficiency": 0.3,
           "host_link_efficiency": 0.3, "step_overhead_s": 1.0, "length_shape": 2.0},
          {"decode_bandwidth": 0.3, "generation_compute": 0.7, "decode_step_s": 0.01,
           "collective_latency_s": 5e-5, "train_mfu_dense": 0.5, "train_mfu_moe": 0.3, "link_efficiency": 0.7,
           "host_link_efficiency": 0.7, "step_overhead_s": 10.0, "length_shape": 1.5})


HELD = {"train_mfu_moe": 0.2, "host_link_efficiency": 0.5, "collective_latency_s": 2e-5}


def uninformed(runs: list[tuple[Scenario, float]]) -> dict:
    """Factors no run informs, at a middling value of their range (HELD): the MoE
    MFU without an MoE run, the colocated swap without a sync-mode run, the
    collective latency without tensor parallelism on either side."""
    held = {}
    if not any(s.model.moe for s, _ in runs):
        held["train_mfu_moe"] = HELD["train_mfu_moe"]
    if not any(s.mode == "sync" for s, _ in runs):
        held["host_link_efficiency"] = HELD["host_link_efficiency"]
    if not any(s.generator.tp > 1 for s, _ in runs):
        held["collective_latency_s"] = HELD["collective_latency_s"]
    return held


def fit(runs: list[tuple[Scenario, float]], device_name: str, fixed: dict | None = None) -> Calibration:
    """Factors for `runs` ((scenario, measured step seconds) of one device kind).
    `fixed`: factors held at a value; those no run informs (uninformed) are held
    too; the rest are fit. Deterministic: Nelder-Mead from each of STARTS, then
    the best restarted twice with smaller simplices. Fewer runs than free factors
    fit (the bounds keep it from running off) but are said in fit["warning"]."""
    if not runs:
        raise PlanError("fit: no runs")
    for name, value in (fixed or {}).items():
        if name not in FACTORS:
            raise PlanError(f"fit: unknown factor {name!r} to hold; one of {list(FACTORS)}")
        lo, hi, _ = FACTORS[name]
        if not lo <= value <= hi:
            raise PlanError(f"fit: {name} = {value!r} is outside [{lo}, {hi}]")
    fixed = {**uninformed(runs), **(fixed or {})}
    free = [name for name in NAMES if name not in fixed]

    def model_of(z):
        return CostModel({**to_factors(free, z), **fixed})

    def loss(z):
        model = model_of(z)
        return sum(math.log(model.predict(scenario).step_time_s / measured) ** 2 for scenario, measured in runs)

    z, value = minimize(loss, [from_factors(free, start) for start in STARTS], iterations=600)
    model = model_of(z)
    errors = [model.predict(s).step_time_s / measured - 1 for s, measured in runs]
    result = {"runs": len(runs), "free_factors": len(free), "rms_log_error": math.sqrt(value / len(runs)),
              "median_abs_error": statistics.median(abs(e) for e in errors), "held": sorted(fixed)}
    if len(runs) <= len(free):
        result["warning"] = (f"{len(runs)} runs for {len(free)} free factors: more than one set of factors fits "
                             "them; the bounds decide the rest")
    return Calibration(device_name, model.f, result)


def _held_out(args) -> dict:
    runs, i, device_name, fixed = args
    scenario, measured = runs[i]
    predicted = fit(runs[:i] + runs[i + 1:], device_name, fixed).model().predict(scenario).step_time_s
    return {"name": scenario.name, "measured_s": measured, "predicted_s": predicted, "error": predicted / measured - 1}


def leave_one_out(runs: list[tuple[Scenario, float]], device_name: str, fixed: dict | None = None,
                  workers: int = 1) -> list[dict]:
    """For each run: the fit on the others, its prediction of this one and the
    error, in the runs' order. workers > 1: the refits in that many processes
    (spawned: each imports the planner alone)."""
    if len(runs) < 2:
        raise PlanError(f"leave-one-out needs 2 runs or more, got {len(runs)}")
    jobs = [(runs, i, device_name, fixed) for i in range(len(runs))]
    if workers <= 1:
        return [_held_out(job) for job in jobs]
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(jobs)),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_held_out, jobs))
