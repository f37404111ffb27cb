"""`llamarl bench plan`: the local cost model's predictions against measured runs of
this machine, and `--choose`'s pick measured.

CONFIGS are `llamarl train` runs that no calibration probe ran (the probes,
pipeline/probes.py, use model shapes and batches of their own): sync and async,
generator tp 1 and 2, 2 replicas, trainer world 2, two model sizes. Each runs
--repeats times (seed r in repeat r, the configurations in rotating order); the
table gives the median measured step time beside the prediction made before any
run from the calibration alone (the completion lengths the task's reference
answers have: the prediction cannot know what the policy will write; the measured
mean is shown beside). Then `choose_local` ranks each model's placements; its
pick is measured (unless it is one of the configurations) and compared with the
default placement and the best configuration of the same model. Targets: each
prediction within 20% of the median, the median error within 10%; each pick no
slower than its model's default and within 10% of its best measured.

Without --calibration the bench runs `llamarl plan calibrate` first (about a
minute and a half here) and uses that.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

from llamarl_core.bench.harness import add_output_args, emit, record, table
from llamarl_core.cli import HelpFormatter
from llamarl_core.pipeline import Controller, TrainConfig
from llamarl_core.pipeline.plan_local import local_run
from llamarl_core.pipeline.probes import calibrate
from llamarl_core.planner.local import choose_local, describe_local
from llamarl_core.planner.local_calibration import LocalCalibration

BIG = {"hidden_size": 256, "intermediate_size": 512, "num_layers": 4}
CONFIGS = {
    "async": {"mode": "async"},
    "sync": {"mode": "sync"},
    "async tp2": {"mode": "async", "generator_tp": 2},
    "async 2 replicas": {"mode": "async", "generator_replicas": 2},
    "async trainer world 2": {"mode": "async", "trainer_world": 2},
    "async big": {"mode": "async", **BIG},
    "sync big": {"mode": "sync", **BIG},
}
# The configurations of each model, its default placement ("async") first: --choose is measured on both.
MODELS = {"default model": [name for name, settings in CONFIGS.items() if not set(settings) & set(BIG)],
          "big model": [name for name, settings in CONFIGS.items() if set(settings) & set(BIG)]}
TARGET_EACH, TARGET_MEDIAN, TARGET_PICK = 0.20, 0.10, 0.10


def measure(configs: dict[str, TrainConfig], repeats: int, tmp: Path) -> dict[str, list[dict]]:
    """Each config run `repeats` times (seed r in repeat r, rotating order): name -> summaries."""
    names = list(configs)
    out = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            config = configs[name].replace(seed=r)
            start = time.monotonic()
            summary = Controller(config, tmp / f"{name.replace(' ', '-')}-{r}").run()
            out[name].append(summary)
            print(f"  {name} seed {r}: step {summary['step_time_s'] * 1e3:.1f} ms ({time.monotonic() - start:.0f} s)",
                  file=sys.stderr, flush=True)
    return out


def _median(summaries: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in summaries)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="llamarl bench plan", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--calibration", type=Path, help="a local calibration (default: make one first)")
    p.add_argument("--steps", type=int, default=60, help="steps of each run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration (the median is compared)")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.steps < 5 or args.repeats < 1:
        p.error("--steps must be at least 5 and --repeats at least 1")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llamarl-bench-plan-") as tmp_name:
        tmp = Path(tmp_name)
        if args.calibration is None:
            print("calibrating (llamarl plan calibrate)...", file=sys.stderr, flush=True)
            calibration = calibrate(tmp / "cpu.json", log=lambda line: print(f"  {line}", file=sys.stderr,
                                                                               flush=True))
        else:
            calibration = LocalCalibration.load(args.calibration)
        model = calibration.model()
        configs = {name: TrainConfig(steps=args.steps, checkpoint_every=args.steps, **settings)
                   for name, settings in CONFIGS.items()}
        runs = {name: local_run(config, name) for name, config in configs.items()}
        predicted = {name: model.predict(run) for name, run in runs.items()}
        picks = {}
        for label, names in MODELS.items():
            pick, prediction = choose_local(model, runs[names[0]], top=1)[0]
            as_name = next((name for name in names if runs[name].placement() == pick.placement()), None)
            if as_name is None:  # a placement none of the configurations has: measured too
                as_name = f"pick, {label}: {describe_local(pick)}"
                configs[as_name] = configs[names[0]].replace(
                    mode=pick.mode, generator_tp=pick.generator_tp, generator_replicas=pick.generator_replicas,
                    trainer_world=pick.trainer_world)
            picks[label] = (pick, prediction, as_name)
        measured = measure(configs, args.repeats, tmp)
    rows = [["configuration", "measured step ms (median)", "predicted ms", "error", "gen ms meas / pred",
             "train ms meas / pred", "completion tokens meas / assumed"]]
    errors = {}
    for name in CONFIGS:
        m, pr = measured[name], predicted[name]
        step = _median(m, "step_time_s")
        errors[name] = pr.step_time_s / step - 1
        tokens = statistics.median(s["completion_tokens"] / s["samples"] for s in m)
        rows.append([name, f"{step * 1e3:.1f}", f"{pr.step_time_s * 1e3:.1f}", f"{errors[name]:+.1%}",
                     f"{_median(m, 'gen_time_s') * 1e3:.1f} / {pr.gen_time_s * 1e3:.1f}",
                     f"{_median(m, 'train_time_s') * 1e3:.1f} / {pr.train_time_s * 1e3:.1f}",
                     f"{tokens:.2f} / {runs[name].new_tokens:.2f}"])
    median_error = statistics.median(abs(e) for e in errors.values())
    worst = max(abs(e) for e in errors.values())
    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    choices, lines = {}, []
    for label, (pick, prediction, as_name) in picks.items():
        names = MODELS[label]
        best_name = min(names, key=lambda name: _median(measured[name], "step_time_s"))
        pick_step, default_step, best_step = (_median(measured[name], "step_time_s")
                                              for name in (as_name, names[0], best_name))
        choices[label] = {"placement": pick.placement(), "predicted_step_s": prediction.step_time_s,
                          "measured_step_s": pick_step, "default_step_s": default_step,
                          "best_measured": {"name": best_name, "step_s": best_step}}
        lines.append(
            f"--choose on the {label}'s run picks {describe_local(pick)} (predicted "
            f"{prediction.step_time_s * 1e3:.1f} ms), measured {pick_step * 1e3:.1f} ms"
            + (": the default placement itself" if as_name == names[0] else
               f"; the default ({names[0]}) {default_step * 1e3:.1f} ms ({verdict(pick_step <= default_step)}: "
               "no slower)")
            + f"; the best measured configuration of the model, {best_name}, {best_step * 1e3:.1f} ms "
            f"({verdict(pick_step <= best_step * (1 + TARGET_PICK))}: within {TARGET_PICK:.0%})")
    result = {
        "errors": errors, "median_abs_error": median_error, "max_abs_error": worst, "choose": choices,
        "factors": calibration.factors, "machine": dataclasses.asdict(calibration.machine),
        "seconds": time.monotonic() - start,
    }
    text = "\n".join([
        table(rows),
        "",
        f"median absolute error {median_error:.1%} (target <= {TARGET_MEDIAN:.0%}: "
        f"{verdict(median_error <= TARGET_MEDIAN)}); largest {worst:.1%} (each within {TARGET_EACH:.0%}: "
        f"{verdict(worst <= TARGET_EACH)})",
        *lines,
        "calibration factors: " + ", ".join(f"{k} {v:.3g}" for k, v in calibration.factors.items()),
        f"{args.repeats} runs of {args.steps} steps each; {result['seconds']:.0f} s in all",
    ])
    emit(args, result, text)
    record(args.record, "plan", {"median_abs_error": median_error, "max_abs_error": worst,
                                 **{f"error {name}": e for name, e in errors.items()}},
           {"steps": args.steps, "repeats": args.repeats}, "Planner, this machine (llamarl bench plan)", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
