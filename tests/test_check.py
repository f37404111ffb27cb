"""`llamarl check gpu`: its schedule under a budget (a plain class, random step lists),
its command line and JSON without a GPU, and the GPU bench's rows computed by the
same code at tiny shapes on the CPU."""

import json
import random
import subprocess
import sys
import tempfile

import pytest
from helpers import llamarl_here

from llamarl_core.check.budget import FAILED, PASSED, SKIPPED, BudgetRun, Outcome, Step


class Clock:
    """A clock the steps advance by the time they take."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _random_steps(rng, clock):
    steps, names = [], []
    for i in range(rng.randint(0, 8)):
        estimate = rng.uniform(1, 60)
        timeout = estimate * rng.uniform(1, 4)
        duration = rng.uniform(0, timeout)
        verdict = rng.choice(["pass", "fail", "raise"])
        needs = tuple(rng.sample(names, rng.randint(0, min(2, len(names)))))

        def run(timeout_s, duration=duration, verdict=verdict, timeout=timeout, name=f"step{i}"):
            assert timeout_s == timeout
            clock.now += duration
            if verdict == "raise":
                raise RuntimeError("broken step")
            return Outcome(verdict == "pass", verdict, [{"name": f"row of {name}"}])

        steps.append(Step(f"step{i}", estimate, timeout, run, needs))
        names.append(f"step{i}")
    return steps


def test_a_step_starts_only_when_the_budget_left_covers_it_and_its_needs_passed():
    rng = random.Random(0)
    for _ in range(3000):
        clock = Clock()
        spent_before = rng.uniform(0, 50)  # a build before the steps, counted in the budget
        start = clock.now
        clock.now += spent_before
        budget = rng.uniform(1, 200)
        steps = _random_steps(rng, clock)
        left_out = {s.name for s in steps if rng.random() < 0.15}  # --skip
        events = []
        runner = BudgetRun(budget, clock=clock, start=start, on_event=events.append, skip=left_out)
        left_at = {}
        original = {s.name: s.run for s in steps}

        def watched(step):
            def run(timeout_s):
                left_at[step.name] = budget - (clock.now - start)
                return original[step.name](timeout_s)
            return Step(step.name, step.estimate_s, step.timeout_s, run, step.needs)

        records = runner.run([watched(s) for s in steps])
        assert [r.name for r in records] == [s.name for s in steps]
        status, spent = {}, spent_before
        for step, record in zip(steps, records):
            needs_ok = all(status[n] == PASSED for n in step.needs)
            starts = step.name not in left_out and needs_ok and step.estimate_s <= budget - spent
            assert (record.status != SKIPPED) == starts, (step, record)
            if starts:
                assert left_at[step.name] == pytest.approx(budget - spent)
                assert record.status in (PASSED, FAILED) and record.seconds >= 0
                assert (record.status == PASSED) == (record.summary == "pass")
                if record.summary == "RuntimeError: broken step":  # a step that raised: failed, no figures
                    assert record.status == FAILED and record.rows == []
                else:
                    assert record.rows == [{"name": f"row of {step.name}"}]
            else:
                assert step.name not in left_at and record.seconds == 0 and record.rows == []
                if step.name in left_out:
                    assert record.summary == "skipped: left out (--skip)"
                else:
                    assert ("budget left" in record.summary) == needs_ok
            status[step.name] = record.status
            spent += record.seconds
        assert sum(r.seconds for r in records) == pytest.approx(clock.now - start - spent_before)
        assert len(events) == len(records) + sum(r.status != SKIPPED for r in records)


def test_a_skip_for_the_budget_names_the_estimate_and_what_is_left():
    clock = Clock()

    def slow(timeout_s):
        clock.now += 80
        return Outcome(True, "done")

    records = BudgetRun(100, clock=clock).run([Step("a", 50, 100, slow), Step("b", 30, 60, slow),
                                               Step("c", 10, 60, slow, needs=("b",))])
    assert [r.status for r in records] == [PASSED, SKIPPED, SKIPPED]
    assert records[1].summary == "skipped: needs about 30 s, 20 s of the budget left"
    assert records[2].summary == "skipped: needs b, which skipped"


def test_a_step_that_cannot_run_here_is_skipped_and_every_record_is_reported_as_it_comes():
    clock = Clock()
    seen = []
    no_tool = Step("memcheck", 5, 10, lambda timeout_s: Outcome(False, "tool not found", skipped=True))
    works = Step("bench", 5, 10, lambda timeout_s: Outcome(True, "ok", [{"name": "x"}]))
    records = BudgetRun(100, clock=clock, on_record=lambda so_far: seen.append([r.status for r in so_far])).run(
        [works, no_tool, Step("after", 500, 500, works.run)])
    assert [(r.status, r.summary) for r in records] == [(PASSED, "ok"), (SKIPPED, "tool not found"),
                                                         (SKIPPED, records[2].summary)]
    assert seen == [[PASSED], [PASSED, SKIPPED], [PASSED, SKIPPED, SKIPPED]]


def test_bad_steps_and_budgets_are_refused_by_name():
    run = lambda timeout_s: Outcome(True, "")  # noqa: E731
    with pytest.raises(ValueError, match="step 'x': needs 0 < estimate_s <= timeout_s"):
        Step("x", 10, 5, run)
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        BudgetRun(0)
    with pytest.raises(ValueError, match="step names must be unique"):
        BudgetRun(10).run([Step("x", 1, 1, run), Step("x", 1, 1, run)])
    with pytest.raises(ValueError, match="step 'y' needs 'z', which is not an earlier step"):
        BudgetRun(10).run([Step("y", 1, 1, run, needs=("z",))])
    with pytest.raises(ValueError, match=r"skip names no step: \['z'\] \(the steps: \['x'\]\)"):
        BudgetRun(10, skip=["z"]).run([Step("x", 1, 1, run)])


def test_step_names_are_those_the_plans_run(tmp_path):
    """--skip is checked against STEP_NAMES before anything runs: they are the GPU
    plan's steps (from a source checkout with its tests) and the compile check."""
    from pathlib import Path

    from llamarl_core.check.steps import STEP_NAMES, Context, compile_check, gpu_plan

    root = Path(__file__).resolve().parents[1]
    ctx = Context(python=sys.executable, root=root, tests=root / "tests", log=tmp_path / "log", scratch=tmp_path,
                  arch="90")
    assert [s.name for s in gpu_plan(ctx)] + [compile_check().name] == list(STEP_NAMES)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="with a GPU, llamarl check gpu runs the GPU steps")
def test_check_gpu_without_a_gpu_writes_its_json_and_skips_what_the_budget_does_not_cover(tmp_path):
    # A command of its own: the budget counts from the process's start, interpreter and imports included.
    out = subprocess.run([sys.executable, "-m", "llamarl_core.cli", "check", "gpu", "--budget", "5", "--json",
                          str(tmp_path / "gpu.json"), "--commit", "abc123"], capture_output=True, text=True,
                         timeout=120, cwd=tempfile.gettempdir())
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert set(result) == {"commit", "device", "driver", "torch", "triton", "seconds", "budget_s", "complete", "steps",
                           "rows"}
    assert result["commit"] == "abc123" and result["device"].startswith("none") and result["budget_s"] == 5
    assert result["complete"] is True
    assert result["steps"] == [{"name": "compile check", "status": "skipped", "seconds": 0.0, "estimate_s": 120,
                                "summary": result["steps"][0]["summary"]}]
    assert "needs about 120 s" in result["steps"][0]["summary"] and 0 < result["seconds"] < 60
    assert "| compile check | skipped |" in out.stdout and "llamarl check gpu: passed; skipped: compile check" in out.stdout
    assert (tmp_path / "gpu.log").exists()
    for flag, value, message in (("--budget", "-1", "--budget must be > 0 seconds"),
                                 ("--skip", "bench sync,benches", "--skip: 'benches' is not a step; the steps: build,"),
                                 ("--json", "/nonexistent/x.json", "--json: the folder /nonexistent does not exist")):
        bad = llamarl_here("check", "gpu", flag, value)
        assert bad.returncode == 2 and message in bad.stderr
    left_out = subprocess.run([sys.executable, "-m", "llamarl_core.cli", "check", "gpu", "--skip", "compile check",
                               "--json", str(tmp_path / "left.json")], capture_output=True, text=True, timeout=120,
                              cwd=tempfile.gettempdir())
    assert left_out.returncode == 0, left_out.stdout + left_out.stderr
    steps = json.loads((tmp_path / "left.json").read_text())["steps"]
    assert [(s["name"], s["status"], s["summary"]) for s in steps] == [
        ("compile check", "skipped", "skipped: left out (--skip)")]


def test_gpu_bench_rows_on_the_cpu_carry_their_limits_ratios_and_targets():
    """`llamarl bench gpu --device cpu --small --parts kernels`: the code a GPU runs, at
    tiny shapes. Every row has the JSON's six fields; a rate's ratio is value / limit,
    a time's limit / value; the judged rows carry the issue's targets."""
    from llamarl_core.bench import bench_gpu

    result = bench_gpu.run(bench_gpu.parse_args(["--device", "cpu", "--small", "--parts", "kernels", "--repeats", "1"]))
    rows = {r["name"]: r for r in result["rows"]}
    assert all(set(r) == {"name", "value", "unit", "limit", "ratio", "target"} for r in rows.values())
    for r in rows.values():
        assert r["value"] > 0
        if r["limit"] is not None:
            expected = r["limit"] / r["value"] if r["unit"] == "ms" else r["value"] / r["limit"]
            assert r["ratio"] == pytest.approx(expected)
    targets = {name.split(",")[0] + ("," + name.split(",")[1] if name.startswith("fp8") else ""): r["target"]
               for name, r in rows.items() if r["target"] is not None}
    assert targets == {"fp8 quantize, per tensor": 0.6, "fp8 quantize, per channel": 0.9,
                       "fp8 quantize, per block": 0.9, "aipo_loss fwd + bwd": 0.85,
                       "linear_aipo_loss fwd + bwd": pytest.approx(1 / 1.2)}
    from llamarl_core.ops.objectives import LOSS_TYPES

    for loss_type in LOSS_TYPES:
        assert any(f"loss_type={loss_type}," in name and r["target"] == 0.85 for name, r in rows.items()), loss_type
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--parts", "kernels,everything"])
