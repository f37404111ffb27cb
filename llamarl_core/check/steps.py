"""The steps of `llamarl check gpu`, each a command in a process of its own.

Each step runs its commands in process groups of their own, their output appended
to the check's log; at a step's timeout the whole group is killed and the step
fails (check/budget.py decides which steps start). Figures come back as JSON files
the benches write (--json-out) and become rows `name, value, unit, limit, ratio,
target` (check/figures.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from ..pipeline.gpu_share import CONTROL as MPS_CONTROL
from .budget import Outcome, Step
from .figures import figure, judged_summary

# The one test that moves weights between processes over CUDA IPC: what memcheck watches.
SANITIZED_TEST = ("test_gpu.py", "test_sync_between_processes_over_cuda_ipc")
_PYTEST_SUMMARY = re.compile(r"^=*\s*(.*\d+ (passed|failed|skipped|error).*?)\s*=*$", re.MULTILINE)
_SANITIZER_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")

# The default task's run: this many RL steps in each mode after its supervised warm-up;
# "learns": the last tenth of steps scores LEARNED_MARGIN more reward than the first.
PIPELINE_STEPS = 150
LEARNED_MARGIN = 0.1
# The ~1B Llama run (bench pipeline --device cuda): RL steps in each mode.
BIG_PIPELINE_STEPS = 8
# How the async run of the ~1B Llama shares the GPU where MPS is at hand: the generator's
# kernels capped at half the SMs, the trainer's at the other half (pipeline/gpu_share.py).
BIG_PIPELINE_SHARE = "mps:50"
# Timed repeats of each bench (medians): few, the check runs once in a short lease.
BENCH_REPEATS = 3
# Test processes pytest-xdist runs the gpu tests in, where it is installed (tests spread one by one:
# by file, test_gpu.py's and test_pipeline.py's ran one after the other, 150 s on an H200), the
# longest first (tests/conftest.py gpu_order; 16 cores on the lent machines).
TEST_WORKERS = 8
# Each gpu test's own limit (pytest-timeout, where installed): under the step's, so that a hang
# fails its test with its stack printed and the others' results are kept.
GPU_TEST_TIMEOUT_S = 150


# Every step's name (--skip names them): the GPU plan's, in order, and the check without a GPU.
STEP_NAMES = ("build", "cuda backend", "gpu tests", "memcheck", "default task", "bench kernels", "bench sync",
              "pipeline ~1B", "compile check")
# Where steps' commands append their output to the log at once (memcheck and the default task beside the gpu tests).
_LOG_LOCK = threading.Lock()


@dataclass
class Context:
    """Where the steps run: the Python that runs them, the source checkout (None for an
    installed package), the tests/ folder (None: not found), the log they append to,
    and a scratch folder for the benches' JSON."""

    python: str
    root: Path | None
    tests: Path | None
    log: Path
    scratch: Path
    arch: str | None  # the device's compute capability, "90" for an H100


def run_command(ctx: Context, title: str, cmd: list[str], timeout_s: float, *, cwd: Path | None = None,
                env: dict | None = None) -> tuple[int | None, str]:
    """Runs `cmd` in a process group of its own (in this session, so that whatever ends
    the check ends it too); returns (exit status, or None if it ran past `timeout_s`
    and its group was killed; its output), the output also appended to the log under
    `title`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            cwd=cwd or ctx.scratch, env={**os.environ, **(env or {})}, process_group=0)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        status: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a grandchild in a session of its own still holds the pipe
            proc.stdout.close()
            proc.wait()
            out = "(its output was lost: a process it started in a session of its own kept the pipe open)"
        status = None
    with _LOG_LOCK, ctx.log.open("a") as log:
        log.write(f"\n===== {title}: {' '.join(cmd)}\n{out}\n===== {title}: "
                  f"{'timed out' if status is None else f'exit {status}'}\n")
    return status, out


def _show_tail(title: str, out: str) -> None:
    """The last lines of a failed command's output on the terminal (the whole of it is in the log)."""
    tail = "\n".join(out.splitlines()[-25:])
    print(f"--- last lines of {title} ---\n{tail}", flush=True)


def _failed(title: str, status: int | None, out: str, timeout_s: float) -> Outcome:
    _show_tail(title, out)
    how = f"ran past its {timeout_s:.0f} s timeout" if status is None else f"exited {status}"
    return Outcome(False, f"{title} {how} (log: its output)")


def _build_env(ctx: Context) -> dict:
    """The build's environment: this Python's bin folder on PATH (cmake, ninja installed
    as packages), and Ninja as CMake's generator where there is no make."""
    env = {"PATH": f"{Path(ctx.python).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if shutil.which("make", path=env["PATH"]) is None and shutil.which("ninja", path=env["PATH"]) is not None:
        env["CMAKE_GENERATOR"] = "Ninja"
    return env


def build(ctx: Context) -> Step:
    """`pip install --no-build-isolation --no-deps -e ROOT` for this device's architecture
    alone (CUDAARCHS); if that build fails, the install without the CUDA backend
    (LLAMARL_SKIP_CUDA=1), so that the steps needing only Triton still run (the
    `cuda backend` step then fails)."""

    def run(timeout_s: float) -> Outcome:
        env = _build_env(ctx)
        tools = (f"import setuptools, shutil, sys; print('setuptools', setuptools.__version__, 'python', sys.version); "
                 f"print({{t: shutil.which(t, path={env['PATH']!r}) for t in ('make', 'ninja', 'cmake', 'nvcc')}})")
        run_command(ctx, "build tools", [ctx.python, "-c", tools], 30)
        cmd = [ctx.python, "-m", "pip", "install", "--disable-pip-version-check", "--no-build-isolation", "--no-deps",
               "-e", str(ctx.root)]  # nothing from an index: the machine may have no network
        status, out = run_command(ctx, "build", cmd, timeout_s, env={**env, "CUDAARCHS": f"{ctx.arch}-real"})
        if status == 0:
            return Outcome(True, f"installed, llamarl_core._C built for sm_{ctx.arch} alone")
        _show_tail("pip install -e", out)
        status, out = run_command(ctx, "build without CUDA", cmd, timeout_s, env={**env, "LLAMARL_SKIP_CUDA": "1"})
        if status != 0:
            return _failed("pip install -e (LLAMARL_SKIP_CUDA=1 too)", status, out, timeout_s)
        return Outcome(True, "the CUDA build FAILED (see the log); installed without the CUDA backend, so that the "
                             "Triton steps run")

    return Step("build", estimate_s=25, timeout_s=180, run=run)


def cuda_backend(ctx: Context, needs: tuple[str, ...]) -> Step:
    """The built module has its CUDA backend and sees the GPU."""

    def run(timeout_s: float) -> Outcome:
        probe = ("from llamarl_core._native import native_cuda; m = native_cuda(); "
                 "print(m.cuda_device_count(), 'CUDA device(s) seen by llamarl_core._C')")
        status, out = run_command(ctx, "cuda backend", [ctx.python, "-c", probe], timeout_s)
        if status != 0:
            return _failed("the CUDA backend's probe", status, out, timeout_s)
        return Outcome(True, out.strip().splitlines()[-1])

    return Step("cuda backend", estimate_s=5, timeout_s=60, run=run, needs=needs)


def gpu_tests(ctx: Context, needs: tuple[str, ...]) -> Step:
    def run(timeout_s: float) -> Outcome:
        workers = ["-n", str(TEST_WORKERS), "--dist", "load"] if _has_module(ctx, "xdist") else []
        # A hung test fails alone, its stack printed, before the step's own timeout ends the whole group.
        limit = [f"--timeout={GPU_TEST_TIMEOUT_S}"] if _has_module(ctx, "pytest_timeout") else []
        cmd = [ctx.python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "--durations=15", *workers,
               *limit, str(ctx.tests)]
        status, out = run_command(ctx, "gpu tests", cmd, timeout_s, cwd=ctx.tests.parent)
        summary = _PYTEST_SUMMARY.findall(out)
        line = summary[-1][0] if summary else "no pytest summary"
        if status != 0:
            _show_tail("pytest -m gpu", out)
        return Outcome(status == 0, f"pytest -m gpu{' -n ' + str(TEST_WORKERS) if workers else ''}: {line}")

    return Step("gpu tests", estimate_s=75, timeout_s=240, run=run, needs=needs)


def _has_module(ctx: Context, name: str) -> bool:
    out = subprocess.run([ctx.python, "-c", f"import importlib.util as u; print(u.find_spec({name!r}) is not None)"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() == "True"


def _bench(ctx: Context, title: str, args: list[str], timeout_s: float) -> tuple[Outcome | None, dict]:
    """Runs `llamarl bench ...` with --json-out; (None, its JSON) or (the failure, {})."""
    out_json = ctx.scratch / f"{title.replace(' ', '_')}.json"
    out_json.unlink(missing_ok=True)
    cmd = [ctx.python, "-m", "llamarl_core.cli", "bench", *args, "--json-out", str(out_json)]
    status, out = run_command(ctx, title, cmd, timeout_s)
    if status != 0 or not out_json.exists():
        return _failed(title, status, out, timeout_s), {}
    return None, json.loads(out_json.read_text())


def bench_gpu(ctx: Context, part: str, estimate_s: float, timeout_s: float, needs: tuple[str, ...]) -> Step:
    def run(timeout_s: float) -> Outcome:
        failure, result = _bench(ctx, f"bench gpu {part}",
                                 ["gpu", "--parts", part, "--repeats", str(BENCH_REPEATS)], timeout_s)
        if failure is not None:
            return failure
        return Outcome(True, f"{len(result['rows'])} figures, {judged_summary(result['rows'])}", result["rows"])

    return Step(f"bench {part}", estimate_s=estimate_s, timeout_s=timeout_s, run=run, needs=needs)


def big_pipeline(ctx: Context, needs: tuple[str, ...]) -> Step:
    """`llamarl bench pipeline --device cuda`: a Llama of about 1B parameters, random
    weights, trainer and generator processes on one GPU, in both modes; the async
    run shares the GPU through MPS where its control program is found."""

    def run(timeout_s: float) -> Outcome:
        share = BIG_PIPELINE_SHARE if shutil.which(MPS_CONTROL) else "none"
        failure, result = _bench(ctx, "bench pipeline 1B", ["pipeline", "--device", "cuda", "--steps",
                                                            str(BIG_PIPELINE_STEPS), "--gpu-share", share], timeout_s)
        if failure is not None:
            return failure
        modes = {"async": result["llamarl_async"], "sync": result["llamarl_sync"]}
        how = "time-sliced: no MPS control daemon here" if share == "none" else f"async with --gpu-share {share}"
        what = f"~1B Llama on one GPU ({how}), {BIG_PIPELINE_STEPS} steps"
        rows = [figure(f"{what}: async step time (limit: the sync step's)", modes["async"]["step_time_s"] * 1e3,
                       "ms", modes["sync"]["step_time_s"] * 1e3)]
        for mode, r in modes.items():
            rows += [figure(f"{mode} mode, {what}: generation, completion tokens/s while generating",
                            r["completion_tokens"] / BIG_PIPELINE_STEPS / r["gen_time_s"], "tok/s"),
                     figure(f"{mode} mode, {what}: weight sync (send) a step", r["sync_time_s"] * 1e3, "ms"),
                     figure(f"{mode} mode, {what}: generator stall a step", r["stall_time_s"] * 1e3, "ms"),
                     figure(f"{mode} mode, {what}: training time a step", r["train_time_s"] * 1e3, "ms"),
                     figure(f"{mode} mode, {what}: start-up, to the first weight sync", r["wall_time_s"] - r["rl_time_s"],
                            "s"),
                     figure(f"{mode} mode, {what}: after the last step (shutdown; no checkpoint or export)",
                            r["total_s"] - r["wall_time_s"], "s")]
        return Outcome(True, f"async / sync step time {rows[0]['value'] / rows[0]['limit']:.2f}x", rows)

    return Step("pipeline ~1B", estimate_s=110, timeout_s=300, run=run, needs=needs)


def default_task(ctx: Context, needs: tuple[str, ...], beside: str | None) -> Step:
    """`llamarl train --device cuda --compare` on the default task: whether the reward
    rose by LEARNED_MARGIN in both modes, and the async / sync step time. Beside the
    gpu tests where they run (`beside`; 80 s saved): its step times are then not
    the GPU's alone, and their row says so."""

    def run(timeout_s: float) -> Outcome:
        out_dir = ctx.scratch / "compare"
        shutil.rmtree(out_dir, ignore_errors=True)
        cmd = [ctx.python, "-m", "llamarl_core.cli", "train", "--device", "cuda", "--compare", "--quiet", "--steps",
               str(PIPELINE_STEPS), "--out", str(out_dir)]
        status, out = run_command(ctx, "train compare", cmd, timeout_s)
        if status != 0 or not (out_dir / "compare.json").exists():
            return _failed("llamarl train --device cuda --compare", status, out, timeout_s)
        result = json.loads((out_dir / "compare.json").read_text())
        what = f"default task on one GPU, {PIPELINE_STEPS} RL steps{', beside the gpu tests' if beside else ''}"
        rows = [figure(f"{what}: async step time (limit: the sync step's)", result["async"]["step_time_s"] * 1e3,
                       "ms", result["sync"]["step_time_s"] * 1e3)]
        learned = {}
        for mode in ("sync", "async"):
            gain = result[mode]["reward_last"] - result[mode]["reward_first"]
            learned[mode] = gain >= LEARNED_MARGIN
            rows.append(figure(f"{what}, {mode}: reward gain, last tenth of steps over the first", gain, "reward"))
        rewards = "; ".join(f"{mode} reward {result[mode]['reward_first']:.3f} -> {result[mode]['reward_last']:.3f}"
                            for mode in ("sync", "async"))
        verdict = "" if all(learned.values()) else f"; did not learn: {[m for m, ok in learned.items() if not ok]}"
        return Outcome(all(learned.values()), f"{rewards}; async / sync step time "
                                              f"{result['step_time_ratio']:.2f}x{verdict}", rows)

    return Step("default task", estimate_s=80, timeout_s=200, run=run, needs=needs, beside=beside)


def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH, beside nvcc, else in the CUDA toolkit ($CUDA_HOME, /usr/local/cuda)."""
    nvcc = shutil.which("nvcc")
    homes = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    folders = ([str(Path(nvcc).parent)] if nvcc else []) + [str(Path(home) / "bin") for home in homes if home]
    return shutil.which("compute-sanitizer") or shutil.which("compute-sanitizer", path=os.pathsep.join(folders))


def memcheck(ctx: Context, needs: tuple[str, ...]) -> Step:
    """compute-sanitizer memcheck on the sync test between processes, beside the gpu
    tests (neither measures anything: 37 s on an H200 saved); skipped (not failed)
    where the tool is missing or refuses the device (gVisor machines)."""

    def run(timeout_s: float) -> Outcome:
        sanitizer = find_sanitizer()
        if sanitizer is None:
            return Outcome(False, "compute-sanitizer not found (PATH, beside nvcc, $CUDA_HOME/bin, "
                                  "/usr/local/cuda/bin)", skipped=True)
        test_file, test_name = SANITIZED_TEST
        # --error-exitcode: a rank process with an error exits 1 (its test fails) even where it ends by os._exit,
        # which prints no summary.
        cmd = [sanitizer, "--tool", "memcheck", "--target-processes", "all", "--error-exitcode", "1", ctx.python,
               "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{ctx.tests / test_file}::{test_name}"]
        status, out = run_command(ctx, "memcheck", cmd, timeout_s, cwd=ctx.tests.parent)
        if "Device not supported" in out:
            return Outcome(False, "compute-sanitizer does not support this device here (\"Device not supported\")",
                           skipped=True)
        errors = [int(n) for n in _SANITIZER_SUMMARY.findall(out)]
        ok = status == 0 and not any(errors)
        if not ok:
            _show_tail("compute-sanitizer", out)
        return Outcome(ok, f"memcheck on {test_name}: {sum(errors)} errors in {len(errors)} processes, "
                           f"{'timed out' if status is None else f'exit {status}'}")

    return Step("memcheck", estimate_s=40, timeout_s=150, run=run, needs=needs, beside="gpu tests")


def gpu_plan(ctx: Context) -> list[Step]:
    """Every step, in priority order: the build and its CUDA backend (from a source
    checkout), the gpu tests with memcheck and the default task's compare run beside
    them (none of the three times the GPU alone), the kernel benches, the
    weight-sync benches, the ~1B pipeline."""
    steps = [build(ctx), cuda_backend(ctx, ("build",))] if ctx.root is not None else []
    built, cuda = (("build",), ("cuda backend",)) if steps else ((), ())
    if ctx.tests is not None:
        steps += [gpu_tests(ctx, built), memcheck(ctx, cuda)]
    steps += [default_task(ctx, cuda, "memcheck" if ctx.tests is not None else None),
              bench_gpu(ctx, "kernels", 15, 120, built), bench_gpu(ctx, "sync", 60, 240, cuda),
              big_pipeline(ctx, cuda)]
    return steps


def compile_check() -> Step:
    """Without a GPU: every Triton kernel variant compiled for sm_80, sm_90 and sm_100."""

    def run(timeout_s: float) -> Outcome:
        from llamarl_core.ops.kernel_check import compile_all

        rows = compile_all(timeout_s=timeout_s)
        failed = [r for r in rows if r.error is not None]
        by_kernel: dict[str, list] = {}
        for r in rows:
            by_kernel.setdefault(r.kernel, []).append(r)
        print("\n| kernel | variants x archs compiled | max registers / thread | spill bytes |\n|---|---|---|---|")
        for kernel, group in by_kernel.items():
            ok = [r for r in group if r.error is None]
            print(f"| {kernel} | {len(ok)} of {len(group)} | {max((r.registers for r in ok), default='-')} | "
                  f"{sum(r.spill_bytes for r in ok)} |")
        for r in failed:
            print(f"FAILED {r.name} on sm_{r.arch}: {r.error}")
        return Outcome(not failed, f"Compile check: {len(rows) - len(failed)} of {len(rows)} compiled "
                                   f"({'passed' if not failed else 'FAILED'}). Full table: python -m "
                                   "llamarl_core.ops.kernel_check")

    return Step("compile check", estimate_s=120, timeout_s=900, run=run)
