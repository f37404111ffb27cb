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
    steps, names, group = [], [], []
    for i in range(rng.randint(0, 8)):
        estimate = rng.uniform(1, 60)
        timeout = estimate * rng.uniform(1, 4)
        duration = rng.uniform(0, timeout)
        verdict = rng.choice(["pass", "fail", "raise"])
        # Beside the step before it: it runs in a thread within that one's time (its clock stays), and
        # needs none of the steps it runs with.
        beside = names[-1] if names and rng.random() < 0.3 else None
        group = group + [names[-1]] if beside else []
        needs = tuple(rng.sample([n for n in names if n not in group], rng.randint(0, min(2, len(names) - len(group)))))
        duration = 0.0 if beside else duration

        def run(timeout_s, duration=duration, verdict=verdict, timeout=timeout, name=f"step{i}"):
            assert timeout_s == timeout
            clock.now += duration
            if verdict == "raise":
                raise RuntimeError("broken step")
            return Outcome(verdict == "pass", verdict, [{"name": f"row of {name}"}])

        steps.append(Step(f"step{i}", estimate, timeout, run, needs, beside))
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
            return Step(step.name, step.estimate_s, step.timeout_s, run, step.needs, step.beside)

        records = runner.run([watched(s) for s in steps])
        assert [r.name for r in records] == [s.name for s in steps]
        status, spent, group_spent = {}, spent_before, spent_before
        for step, record in zip(steps, records):
            if step.beside is None:  # a new group: decided on the time spent before it
                group_spent = spent
            needs_ok = all(status[n] == PASSED for n in step.needs)
            starts = step.name not in left_out and needs_ok and step.estimate_s <= budget - group_spent
            assert (record.status != SKIPPED) == starts, (step, record)
            if starts:
                if step.beside is None:  # a step beside it may start first, its clock never moving
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
            if step.beside is None:
                spent += record.seconds
        leaders = [r.seconds for r, s in zip(records, steps) if s.beside is None]
        assert sum(leaders) == pytest.approx(clock.now - start - spent_before)
        assert len(events) == len(records) + sum(r.status != SKIPPED for r in records)


def test_a_step_beside_another_is_decided_alone_and_runs_at_the_same_time():
    """Real threads and a real clock: two steps that each wait for the other to have
    started can end only side by side; the next step starts after both, decided on
    the budget left then; the records keep the plan's order."""
    import threading
    import time

    started = {name: threading.Event() for name in ("tests", "memcheck")}
    order = []

    def waits_for(other, name):
        def run(timeout_s):
            started[name].set()
            ok = started[other].wait(5)
            time.sleep(0.2)
            order.append(name)
            return Outcome(ok, f"{name} saw {other} running: {ok}")
        return run

    steps = [Step("tests", 1, 10, waits_for("memcheck", "tests")),
             Step("memcheck", 2, 10, waits_for("tests", "memcheck"), beside="tests"),
             Step("bench", 1, 10, lambda timeout_s: order.append("bench") or Outcome(True, "after both"))]
    began = time.monotonic()
    records = BudgetRun(60).run(steps)
    assert time.monotonic() - began < 2  # side by side: one after the other would wait 5 s
    assert [(r.name, r.status) for r in records] == [("tests", PASSED), ("memcheck", PASSED), ("bench", PASSED)]
    assert order[2] == "bench" and all(0.2 <= r.seconds < 2 for r in records[:2])
    # Each decided alone: a step beside one whose needs failed, or past the budget, is skipped by itself.
    clock = Clock()
    fail = Step("build", 1, 1, lambda timeout_s: Outcome(False, "broken"))
    records = BudgetRun(10, clock=clock).run([
        fail, Step("tests", 5, 5, lambda t: Outcome(True, "ran"), needs=("build",)),
        Step("memcheck", 5, 5, lambda t: Outcome(True, "ran"), beside="tests"),
        Step("big", 20, 20, lambda t: Outcome(True, "ran"), beside="memcheck")])
    assert [(r.name, r.status) for r in records] == [("build", FAILED), ("tests", SKIPPED), ("memcheck", PASSED),
                                                     ("big", SKIPPED)]
    assert records[3].summary == "skipped: needs about 20 s, 10 s of the budget left"


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
    with pytest.raises(ValueError, match="step 'y' runs beside 'z', which is not the step before it"):
        BudgetRun(10).run([Step("z", 1, 1, run), Step("x", 1, 1, run), Step("y", 1, 1, run, beside="z")])
    with pytest.raises(ValueError, match="step 'y' runs beside 'x', which is not the step before it"):
        BudgetRun(10).run([Step("y", 1, 1, run, beside="x")])
    with pytest.raises(ValueError, match="step 'z' needs 'x', which it runs beside"):
        BudgetRun(10).run([Step("x", 1, 1, run), Step("y", 1, 1, run, beside="x"),
                           Step("z", 1, 1, run, needs=("x",), beside="y")])


def test_step_names_are_those_the_plans_run(tmp_path):
    """--skip is checked against STEP_NAMES before anything runs: they are the GPU
    plan's steps (from a source checkout with its tests) and the compile check."""
    from pathlib import Path

    from llamarl_core.check.steps import STEP_NAMES, Context, compile_check, gpu_plan

    root = Path(__file__).resolve().parents[1]
    ctx = Context(python=sys.executable, root=root, tests=root / "tests", log=tmp_path / "log", scratch=tmp_path,
                  arch="90")
    assert [s.name for s in gpu_plan(ctx)] + [compile_check().name] == list(STEP_NAMES)


def test_the_gpu_tests_are_handed_out_longest_first_each_beside_a_short_one():
    """`pytest -m gpu` (check gpu's command, less its workers) collects the tests marked
    gpu(seconds=N) first, longest first, each followed by an unmarked one: xdist's
    load scheduling then starts every long test at once on a worker of its own."""
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    files = ["test_gpu_share.py", "test_gpu.py", "test_pipeline.py"]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                          *files], capture_output=True, text=True, timeout=120, cwd=tests)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ids = [line.split("::", 1)[1] for line in out.stdout.splitlines() if "::" in line]
    assert ids[0::2][:5] == ["test_train_run_on_cuda[float32-1e-05-False]", "test_train_run_on_cuda[auto-0.05-True]",
                             "test_the_daemon_serves_a_capped_client_and_quits",
                             "test_fp8_triton_kernel_on_gpu_matches_reference[tensor]",
                             "test_fp8_triton_kernel_on_gpu_matches_reference[channel]"]
    assert not any(name.startswith(("test_train_run_on_cuda", "test_fp8_triton", "test_the_daemon"))
                   for name in ids[1:10:2])
    assert len(ids) == len(set(ids)) and "test_copy_kernel_launch_is_captured_in_a_cuda_graph" in ids


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
