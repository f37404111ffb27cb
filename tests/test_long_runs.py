"""Nothing grows with the number of steps, and a run killed at any moment leaves
what it wrote readable: `llamarl bench soak` on a short run (the Store's key count
and every process's open files and threads flat from the first sample on, in the
pipeline and in a sync-only loop), and a real `llamarl train` SIGKILLed mid-way
(trace.json parses, with a span for every step metrics.jsonl records; every line
of metrics.jsonl parses)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from helpers import killed_process_env

# The executors run the CPU paths of the kernels, as a user's run does.
RUN_ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def test_soak_keeps_the_store_files_and_threads_flat(tmp_path):
    """90 steps of the default pipeline without its warm-up (a checkpoint every 15, an
    evaluation every 30) and 90 syncs, sampled every 30 steps: from the first sample to the last the
    Store holds the same keys (2 of slack: messages in flight), and no process gains
    a file descriptor or a thread (1 of slack). Before ticket keys were deleted, the
    sync alone left 3 keys per version (180 more here)."""
    done = subprocess.run([sys.executable, "-m", "llamarl_core.bench.bench_soak", "--steps", "90", "--every", "30",
                           "--from", "30", "--checkpoint-every", "15", "--warmup-steps", "0", "--json",
                           "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600, env=RUN_ENV, cwd=tmp_path)
    results = json.loads(done.stdout.splitlines()[-1]) if done.stdout.strip() else None
    assert results is not None, done.stderr[-3000:]
    for loop in ("sync", "pipeline"):
        rows = results[loop]["rows"]
        print(loop, json.dumps(rows))
        assert [r["step"] for r in rows] == [30, 60, 90]
        verdict = results[loop]["verdict"]
        counts = [k for k in verdict if k == "keys" or k.endswith((" fds", " threads"))]
        assert "keys" in counts and len(counts) >= 5, counts  # the keys, and two or more processes' fds and threads
        for key in counts:
            assert verdict[key]["flat"], (loop, key, verdict[key], rows)


def test_a_killed_run_leaves_a_trace_and_metrics_that_parse(tmp_path):
    """SIGKILL to a real run's whole process group once it has recorded 20 steps:
    trace.json is valid JSON (as Perfetto reads it) holding complete events only,
    with a "train step" span for every step in metrics.jsonl, and every line of
    metrics.jsonl parses."""
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"
    with killed_process_env(RUN_ENV) as env:
        proc = subprocess.Popen([sys.executable, "-m", "llamarl_core.cli", "train", "--out", str(out), "--steps",
                                 "1000", "--warmup-steps", "5", "--quiet"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env=env, cwd=tmp_path, start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while not (metrics.exists() and metrics.read_text().count("\n") >= 20):
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
                assert time.monotonic() < deadline, "20 steps did not come within 180 s"
                time.sleep(0.05)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the controller and its executors at once, mid-step
            proc.wait(timeout=30)
    lines = metrics.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) >= 20 and [r["step"] for r in records] == list(range(len(records)))
    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"]
    assert all(e["ph"] in ("X", "M") for e in events) and all(e["dur"] >= 0 for e in events if e["ph"] == "X")
    trained = {e["args"]["step"] for e in events if e["name"] == "train step"}
    missing = sorted({r["step"] for r in records} - trained)
    assert not missing, f"steps in metrics.jsonl without their train span: {missing}"
    print(f"killed after {len(records)} recorded steps: {len(events)} trace events")


def test_the_trace_is_valid_json_after_every_write(tmp_path):
    """report.TraceWriter: after each batch of spans the file parses and holds
    every span so far, in order, its roles named once."""
    import random

    from llamarl_core.pipeline.report import TraceWriter

    path = tmp_path / "trace.json"
    writer = TraceWriter(path, t0=100.0)
    assert json.loads(path.read_text())["traceEvents"] == []
    rng, spans = random.Random(), []
    for _ in range(50):
        batch = [(rng.choice(["trainer", "generator", "reward"]), rng.randrange(3), rng.choice(["a", "b"]),
                  100 + rng.random(), 101 + rng.random(), {"step": rng.randrange(9)}) for _ in range(rng.randrange(4))]
        writer.add(batch)
        spans += batch
        events = json.loads(path.read_text())["traceEvents"]
        names = [e["args"]["name"] for e in events if e["ph"] == "M"]
        assert sorted(names) == sorted({s[0] for s in spans}) and len(names) == len(set(names))
        got = [(e["name"], e["tid"], e["args"]) for e in events if e["ph"] == "X"]
        assert got == [(s[2], s[1], s[5]) for s in spans]
    writer.close()
