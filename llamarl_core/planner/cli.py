"""`llamarl plan`: predict a run's step time before it starts.

    llamarl plan SCENARIO.json [--calibration CAL.json] [--json] [--choose [--top N]]
    llamarl plan --paper [--calibration CAL.json] [--json]
    llamarl plan fit RUNS.json -o CAL.json [--no-leave-one-out]
    llamarl plan calibrate -o CAL.json
    llamarl plan RUN/config.json --calibration CAL.json [--json] [--choose [--top N]]

RUN/config.json (or the run folder): a `llamarl train` run, predicted on this
machine's CPU under the local calibration that `llamarl plan calibrate` writes.
SCENARIO.json: one row in the published-runs format (the field names of
llamarl_core/planner/data/nemo_rl_h100_runs.json; its `measured`, if any, shown
beside the prediction, never used), or a file of them ({"runs": [...]}), each
predicted. Without --calibration the H100 calibration that ships with the package
(fit on NeMo-RL's published H100 runs by `llamarl plan fit`) is used, for another
GPU of the table with that GPU's published peaks (said in the assumptions).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from importlib import resources
from pathlib import Path

from .calibration import Calibration, fit, leave_one_out
from .cost import FACTORS
from .devices import PlanError, positive_number
from .scenario import from_row
from .search import choose, describe

SHIPPED_CALIBRATION = "h100.json"
PUBLISHED_RUNS = "nemo_rl_h100_runs.json"
PAPER_RUNS = "llamarl_paper.json"
REFIT_MODELS = "refit_models.json"


def data_path(name: str) -> Path:
    return Path(str(resources.files("llamarl_core.planner") / "data" / name))


def _read_json(path: str, flag: str):
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise PlanError(f"{flag} {path}: {exc.strerror}") from None
    except ValueError as exc:  # not JSON, or not text
        raise PlanError(f"{flag} {path}: not JSON ({exc})") from None


def _rows(data, flag: str, path: str) -> list[dict]:
    if isinstance(data, dict) and isinstance(data.get("runs"), list):
        if not data["runs"]:
            raise PlanError(f"{flag} {path}: runs holds no row")
        for index, row in enumerate(data["runs"]):
            if not isinstance(row, dict):
                raise PlanError(f"{flag} {path}: runs[{index}] is not a row (a JSON object), got "
                                f"{type(row).__name__}")
        return data["runs"]
    if isinstance(data, dict):
        return [data]
    raise PlanError(f"{flag} {path}: a scenario is a JSON object (a row) or {{\"runs\": [rows]}}")


def _data(name: str) -> dict:
    """One of the package's data files (data/), read."""
    return json.loads(data_path(name).read_text())


def _loo_column(entry: dict | None) -> str:
    """A run's leave-one-out prediction and error, as the tables print it ("" without one)."""
    return f"  {entry['predicted_s']:8.1f} {entry['error']:+7.1%}" if entry else ""


def _measured(row: dict) -> float | None:
    """The row's measured.step_time_s where it is a positive number (shown beside a prediction), else None."""
    value = row["measured"].get("step_time_s") if isinstance(row.get("measured"), dict) else None
    return float(value) if positive_number(value) else None


def _calibration(path: str | None) -> Calibration:
    return Calibration.load(path or data_path(SHIPPED_CALIBRATION))


def _line(name: str, measured: float | None, p) -> str:
    error = f"{p.step_time_s / measured - 1:+7.1%}" if measured else "       "
    shown = f"{measured:8.1f}" if measured else "       -"
    return (f"{name[:44]:44s} {shown} {p.step_time_s:9.1f} {error} {p.gen_time_s:7.1f} {p.train_time_s:7.1f} "
            f"{p.sync_time_s:6.1f} {p.swap_time_s:6.1f}  {p.memory_gib_per_gpu['generator']:5.1f}/"
            f"{p.memory_gib_per_gpu['trainer']:5.1f}")


HEADER = (f"{'scenario':44s} {'measured':>8s} {'predicted':>9s} {'error':>7s} {'gen s':>7s} {'train s':>7s} "
          f"{'sync s':>6s} {'swap s':>6s}  GiB gen/train")


def print_assumptions(lines: list[str]) -> None:
    print("assumptions:")
    for line in lines:
        print(f"  - {line}")


def _print_one(scenario, prediction, measured: float | None) -> None:
    print(HEADER)
    print(_line(scenario.name, measured, prediction))
    print(f"bottleneck: {prediction.bottleneck}")
    print_assumptions(prediction.assumptions)


def _row_like(data) -> bool:
    """JSON that is a row or {"runs": [...]} by its own fields (no need to ask the
    pipeline, and to import it, whether it is a `llamarl train` run)."""
    return isinstance(data, dict) and bool({"hf_config", "runs", "placement", "batch"} & set(data))


def _predict(args, local) -> int:
    # A run's folder, or JSON read once: a row, or (the pipeline's side decides) a run's config.
    data = None if local is not None and Path(args.scenario).is_dir() else _read_json(args.scenario, "SCENARIO")
    if local is not None and (data is None or not _row_like(data) and local.is_run_config(data)):
        return local.predict(args.scenario, args.calibration, args.json, args.choose, args.top)
    calibration = _calibration(args.calibration)
    model = calibration.model()
    rows = _rows(data, "SCENARIO", args.scenario)
    scenarios = [(row, calibration.scenario(row, base=Path(args.scenario).parent)) for row in rows]
    if args.choose:
        if len(scenarios) != 1:
            raise PlanError(f"--choose takes one scenario; {args.scenario} holds {len(scenarios)}")
        return _choose(model, scenarios[0][1], args)
    results = [(row, scenario, model.predict(scenario)) for row, scenario in scenarios]
    if args.json:
        objects = [{"name": s.name, "measured_step_time_s": _measured(row), **p.as_json()} for row, s, p in results]
        print(json.dumps(objects[0] if len(objects) == 1 else {"runs": objects}, indent=1))
        return 0
    if len(results) == 1:
        row, scenario, prediction = results[0]
        _print_one(scenario, prediction, _measured(row))
        return 0
    print(HEADER)
    for row, scenario, prediction in results:
        print(_line(scenario.name, _measured(row), prediction))
    _print_errors([p.step_time_s / m - 1 for row, _, p in results if (m := _measured(row))])
    return 0


def _choose(model, scenario, args) -> int:
    """The given placement (or why it does not fit) beside the best few that do."""
    try:
        given, why = model.predict(scenario), None
    except PlanError as exc:
        given, why = None, str(exc)
    best = choose(model, scenario, top=args.top)
    return show_choice(scenario, given, why, best, describe=describe, placement=describe, as_json=args.json)


def show_choice(given_case, given, why, best, *, describe, placement, as_json: bool, unit: str = "s",
                scale: float = 1.0, width: int = 72, notes: list | None = None) -> int:
    """--choose's output: the given placement's prediction (or why it does not fit)
    beside the best few (case, prediction) pairs, as a table in `unit` (seconds x
    `scale`) or as JSON (placement(case) names each); notes (None: none): lines said
    after the best one's assumptions, and in the JSON."""
    if as_json:
        head = {"placement": placement(given_case), **(given.as_json() if given else {"does_not_fit": why})}
        print(json.dumps({"given": head, "best": [{"placement": placement(c), **p.as_json()} for c, p in best],
                          **({"notes": notes} if notes is not None else {})}, indent=1))
        return 0
    print(f"{'placement':{width + 6}s} {'step ' + unit:>8s} {'gen ' + unit:>8s} {'train ' + unit:>8s}")
    if given is None:
        print(f"given {describe(given_case)[:width]:{width}s} does not fit: {why}")
    rows = ([("given", given_case, given)] if given else []) + [(f"#{i + 1}", c, p) for i, (c, p) in enumerate(best)]
    for label, c, p in rows:
        print(f"{label:6s}{describe(c)[:width]:{width}s} {p.step_time_s * scale:8.1f} {p.gen_time_s * scale:8.1f} "
              f"{p.train_time_s * scale:8.1f}")
    print(f"best: {best[0][1].bottleneck}")
    if notes is not None:
        print_assumptions(best[0][1].assumptions + notes)
    return 0


def _print_errors(errors: list[float]) -> None:
    if errors:
        print(f"absolute error: median {statistics.median(abs(e) for e in errors):.1%}, "
              f"max {max(abs(e) for e in errors):.1%} over {len(errors)} measured")


def _parallel(text: str) -> dict:
    """"PP16xEP16" -> {"pp": 16, "ep": 16}."""
    return {part[:2].lower(): int(part[2:]) for part in text.split("x")}


def refits(calibration: Calibration, published: dict) -> list[dict]:
    """NeMo-RL's published weight-refit times (`published`: the published-runs file,
    read; context for the sync term, never fit on) beside the weight sync predicted
    for a colocated run of that resharding, for the models whose config the published
    runs or data/refit_models.json hold."""
    configs = {row["model"]: row for row in published["runs"]}
    template = published["runs"][0]  # batch and device of a published run; the refit does not depend on them
    for model_name, config in _data(REFIT_MODELS)["models"].items():
        configs.setdefault(model_name, {**template, "model": model_name, "hf_config": config})
    model = calibration.model()
    out = []
    for refit in published["weight_refit"]:
        entry = {"model": refit["model"], "from": refit["from"], "to": refit["to"], "published_s": refit["seconds"],
                 "predicted_s": None}
        base = configs.get(refit["model"])
        if base is not None:
            trainer, generator = _parallel(refit["from"]), _parallel(refit["to"])
            gpus = generator["tp"] * generator.get("dp", 1)
            row = {**base, "name": f"refit {refit['model']} {refit['from']} -> {refit['to']}",
                   "placement": {"mode": "sync", "gpus": gpus}, "generator": {"tp": generator["tp"]},
                   "trainer": {"tp": trainer.get("tp", 1), "pp": trainer.get("pp", 1), "ep": trainer.get("ep", 1)}}
            entry["predicted_s"] = model.sync(calibration.scenario(row))
        out.append(entry)
    return out


def _paper(args) -> int:
    calibration = _calibration(args.calibration)
    model = calibration.model()
    published = _data(PUBLISHED_RUNS)
    out = {"llamarl": [], "nemo_rl": []}
    for key, data in (("llamarl", _data(PAPER_RUNS)), ("nemo_rl", published)):
        for row in data["runs"]:
            scenario = calibration.scenario(row)
            out[key].append((row, scenario, model.predict(scenario)))
    loo = {r["name"]: r for r in calibration.fit.get("leave_one_out", [])}
    weight_refits = refits(calibration, published)
    if args.json:
        print(json.dumps({**{key: [{"name": s.name, "measured_step_time_s": _measured(row),
                                    "leave_one_out_step_time_s": loo.get(s.name, {}).get("predicted_s"),
                                    "notes": row.get("notes"), **p.as_json()} for row, s, p in rows]
                             for key, rows in out.items()}, "weight_refit": weight_refits}, indent=1))
        return 0
    print("LlamaRL (arXiv 2505.24034), step time sync baseline -> async, beside the prediction:")
    print(HEADER)
    for row, scenario, prediction in out["llamarl"]:
        print(_line(scenario.name, _measured(row), prediction))
    print(f"assumptions: {out['llamarl'][0][0]['notes']}")
    print(f"\nNeMo-RL v0.5 on H100 (the calibration's runs), in-sample and leave-one-out "
          f"({calibration.device} calibration):")
    print(HEADER + "  leave-one-out")
    for row, scenario, prediction in out["nemo_rl"]:
        print(_line(scenario.name, _measured(row), prediction) + _loo_column(loo.get(scenario.name)))
    _print_errors([p.step_time_s / m - 1 for row, _, p in out["nemo_rl"] if (m := _measured(row))])
    if loo:
        print(f"leave-one-out: median {statistics.median(abs(r['error']) for r in loo.values()):.1%}")
    print("\nNeMo-RL's published weight refits (context, not fit on) beside the predicted weight sync:")
    for entry in weight_refits:
        low, high = entry["published_s"]
        predicted = f"{entry['predicted_s']:6.2f} s" if entry["predicted_s"] is not None else \
            "(no config of this model: its architecture is not one the planner describes)"
        print(f"  {entry['model']:16s} {entry['from']:>14s} -> {entry['to']:10s} published {low}-{high} s, "
              f"predicted {predicted}")
    return 0


def check_out(out, parser: argparse.ArgumentParser) -> None:
    """-o OUT, before any work: its folder exists and OUT is not a folder itself."""
    if Path(out).is_dir():
        parser.error(f"-o {out}: a folder; name the calibration JSON to write")
    if not Path(out).resolve().parent.is_dir():
        parser.error(f"-o {out}: its folder does not exist")


def _hold(text: str) -> tuple[str, float]:
    name, _, value = text.partition("=")
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hold takes NAME=VALUE, got {text!r}") from None


def _fit(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llamarl plan fit", description=(
        "Fit the cost model's factors on measured runs of one device kind (RUNS.json: {\"runs\": [rows]}, each "
        "with measured.step_time_s), then refit without each run in turn to predict it (leave-one-out)."))
    parser.add_argument("runs", help="RUNS.json")
    parser.add_argument("-o", "--out", required=True, help="the calibration JSON to write")
    parser.add_argument("--hold", type=_hold, action="append", default=[], metavar="NAME=VALUE",
                        help="hold a factor at a value instead of fitting it (repeatable)")
    parser.add_argument("--no-leave-one-out", action="store_true",
                        help="skip the leave-one-out refits (one fit per run, spread over the cores: 3 minutes for "
                             "ten runs on 2 cores)")
    args = parser.parse_args(argv)
    check_out(args.out, parser)
    base = Path(args.runs).parent
    rows = _rows(_read_json(args.runs, "RUNS"), "RUNS", args.runs)
    runs, kinds = [], set()
    for row in rows:
        measured = _measured(row)
        if measured is None:
            raise PlanError(f"RUNS {args.runs}: {row.get('name', 'a row')}: measured.step_time_s must be a positive "
                            f"number, got {row.get('measured')!r} for measured")
        scenario = from_row(row, base=base)
        kinds.add(scenario.device.name)
        runs.append((scenario, measured))
    if len(kinds) != 1:
        raise PlanError(f"RUNS {args.runs}: one calibration per kind of device; these runs are on {sorted(kinds)}")
    kind = kinds.pop()
    held = dict(args.hold)
    calibration = fit(runs, kind, held)
    if not args.no_leave_one_out:
        calibration.fit["leave_one_out"] = leave_one_out(runs, kind, held, workers=os.cpu_count() or 1)
        calibration.fit["leave_one_out_median_abs_error"] = statistics.median(
            abs(r["error"]) for r in calibration.fit["leave_one_out"])
    calibration.save(args.out)
    print(f"{'factor':22s} {'value':>10s}  bounds, meaning")
    for name, value in calibration.factors.items():
        lo, hi, meaning = FACTORS[name]
        pinned = "  (at its bound)" if min(value - lo, hi - value) <= 1e-3 * (hi - lo) else ""
        note = "  (held, not fit)" if name in calibration.fit["held"] else pinned
        print(f"{name:22s} {value:10.4g}  [{lo:g}, {hi:g}] {meaning}{note}")
    if "warning" in calibration.fit:
        print(f"warning: {calibration.fit['warning']}")
    model = calibration.model()
    print(HEADER + ("  leave-one-out" if "leave_one_out" in calibration.fit else ""))
    held_out = calibration.fit.get("leave_one_out") or [None] * len(runs)
    for (scenario, measured), entry in zip(runs, held_out):
        print(_line(scenario.name, measured, model.predict(scenario)) + _loo_column(entry))
    print(f"in sample: median absolute error {calibration.fit['median_abs_error']:.1%}")
    if "leave_one_out" in calibration.fit:
        print(f"leave-one-out: median absolute error {calibration.fit['leave_one_out_median_abs_error']:.1%}")
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str], local=None) -> int:
    """`llamarl plan`. local: what predicts a `llamarl train` run and calibrates this
    machine (pipeline/plan_local.py: is_run_config, predict, calibrate; the CLI hands it
    over); None: rows only."""
    try:
        if argv[:1] == ["fit"]:
            return _fit(argv[1:])
        if argv[:1] == ["calibrate"]:
            if local is None:
                raise PlanError("calibrate: this machine's calibration runs the pipeline; call it as `llamarl plan "
                                "calibrate`")
            return local.calibrate(argv[1:])
        parser = argparse.ArgumentParser(prog="llamarl plan", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("scenario", nargs="?", help="SCENARIO.json: a row, or {\"runs\": [rows]}; or a `llamarl "
                                                        "train` run, its folder or config.json")
        parser.add_argument("--calibration", help="a calibration JSON (default: the shipped H100 fit; a `llamarl "
                                                  "train` run takes this machine's, from `llamarl plan calibrate`)")
        parser.add_argument("--json", action="store_true", help="print one JSON object")
        parser.add_argument("--choose", action="store_true",
                            help="search the mode, the split and each side's parallelism for the lowest step time")
        parser.add_argument("--top", type=int, help="placements --choose prints (default: 5)")
        parser.add_argument("--paper", action="store_true",
                            help="LlamaRL's table and NeMo-RL's calibration runs beside the predictions")
        args = parser.parse_args(argv)
        if args.top is not None and not args.choose:
            parser.error("--top says how many placements --choose prints: it needs --choose")
        args.top = 5 if args.top is None else args.top
        if args.top < 1:
            parser.error("--top must be at least 1")
        if args.paper == (args.scenario is not None):
            parser.error("give SCENARIO.json or --paper (one of them)")
        if args.paper and args.choose:
            parser.error("--choose takes a SCENARIO.json, not --paper")
        return _paper(args) if args.paper else _predict(args, local)
    except PlanError as exc:
        print(f"llamarl plan: {exc}", file=sys.stderr)
        return 2
