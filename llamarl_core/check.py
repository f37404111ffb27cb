"""`llamarl check gpu`: everything that needs a GPU, in one command and one table.

With a CUDA device: every test marked `gpu` (the Triton kernels on CUDA tensors,
the CUDA copy engine, weight sync over CUDA IPC between processes), the GPU
benches (`llamarl bench gpu`: FP8 quantization and the AIPO kernels beside the
device's copy bandwidth and naive torch, weight sync beside cudaMemcpy), each
ratio beside the figure it should reach (TARGETS), a short `llamarl train
--device cuda --compare` run of the default task on this one GPU (trainer and
generator processes sharing it: does the reward rise in both modes, and the
async / sync step-time ratio), and `compute-sanitizer --tool memcheck` on the
sync test where it is installed.
Without one it says so and runs what needs no GPU: every Triton kernel variant
compiled for sm_80 / sm_90 / sm_100 (llamarl_core.ops.kernel_check).
Exit status 0 when everything it ran passed: the tests, the pipeline run (its
reward rose in both modes) and the sanitizer. The bench ratios are measurements:
each is shown beside its target, met or MISSED, and counted in the last line, but
a missed target does not fail the check.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

# The one test that moves weights between processes over CUDA IPC: what memcheck watches.
SANITIZED_TEST = ("test_gpu.py", "test_sync_between_processes_over_cuda_ipc")
_PYTEST_SUMMARY = re.compile(r"^=*\s*(.*\d+ (passed|failed|skipped|error).*?)\s*=*$", re.MULTILINE)
_SANITIZER_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")


def find_tests(given: str | None) -> Path | None:
    """The repository's tests/ folder: --tests, else ./tests, else beside the package (a source checkout)."""
    candidates = [Path(given)] if given else [Path.cwd() / "tests", Path(__file__).resolve().parents[1] / "tests"]
    return next((p for p in candidates if (p / "conftest.py").exists()), None)


def run_gpu_tests(tests: Path, timeout_s: float) -> tuple[bool, str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", str(tests)],
                         capture_output=True, text=True, timeout=timeout_s, cwd=tests.parent)
    print(out.stdout[-6000:], out.stderr[-2000:], sep="\n", flush=True)
    summary = _PYTEST_SUMMARY.findall(out.stdout)
    return out.returncode == 0, summary[-1][0] if summary else f"pytest exited {out.returncode}"


def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH, else in the CUDA toolkit ($CUDA_HOME, /usr/local/cuda), which is often not on PATH."""
    homes = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    toolkit_bins = os.pathsep.join(str(Path(home) / "bin") for home in homes if home)
    return shutil.which("compute-sanitizer") or shutil.which("compute-sanitizer", path=toolkit_bins)


def run_sanitizer(tests: Path, timeout_s: float) -> tuple[bool | None, str]:
    sanitizer = find_sanitizer()
    if sanitizer is None:
        return None, "SKIPPED: compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)"
    test_file, test_name = SANITIZED_TEST
    out = subprocess.run([sanitizer, "--tool", "memcheck", "--target-processes", "all", sys.executable, "-m", "pytest",
                          "-q", "-p", "no:cacheprovider", f"{tests / test_file}::{test_name}"],
                         capture_output=True, text=True, timeout=timeout_s, cwd=tests.parent)
    errors = [int(n) for n in _SANITIZER_SUMMARY.findall(out.stdout + out.stderr)]
    ok = out.returncode == 0 and not any(errors)
    return ok, f"memcheck on {test_name}: {sum(errors)} errors in {len(errors)} processes, exit {out.returncode}"


# The ratio each bench row should reach (its "x limit" column), by the start of its
# name: FP8 quantization (no host sync) and the AIPO loss against the device's copy
# bandwidth, linear_aipo_loss against its three GEMMs, the weight sync against one
# cudaMemcpy of the same bytes (torch's cast for fp32).
TARGETS = {
    "fp8 quantize 14336x4096 bf16, tensor, check=False": 0.5,
    "fp8 quantize 14336x4096 bf16, channel, check=False": 0.8,
    "fp8 quantize 14336x4096 bf16, block, check=False": 0.8,
    "aipo_loss fwd + bwd": 0.75,
    "linear_aipo_loss fwd + bwd": 1 / 1.2,  # within 1.2x of its three GEMMs
    "weight sync over CUDA IPC, 1.": 0.8,
    "weight sync over CUDA IPC, 8.": 0.9,
}


def target_of(what: str) -> float | None:
    return next((t for prefix, t in TARGETS.items() if what.startswith(prefix)), None)


# The pipeline run of the check: the default task's supervised warm-up, then this
# many RL steps in each mode (about a minute each on an H100).
PIPELINE_STEPS = 200
# "Learns": the last tenth of steps scores this much more reward than the first.
LEARNED_MARGIN = 0.1


def run_pipeline(timeout_s: float) -> tuple[bool, str]:
    """`llamarl train --device cuda --compare` on the default task: whether the reward
    rose by LEARNED_MARGIN in both modes, and the async / sync step-time ratio."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compare"
        try:
            proc = subprocess.run([sys.executable, "-m", "llamarl_core.cli", "train", "--device", "cuda", "--compare",
                                   "--quiet", "--steps", str(PIPELINE_STEPS), "--out", str(out)],
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False, f"llamarl train --device cuda --compare did not finish in {timeout_s:.0f} s"
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", flush=True)
        if proc.returncode != 0 or not (out / "compare.json").exists():
            return False, f"llamarl train --device cuda --compare exited {proc.returncode}"
        result = json.loads((out / "compare.json").read_text())
    learned = {mode: result[mode]["reward_last"] - result[mode]["reward_first"] >= LEARNED_MARGIN
               for mode in ("sync", "async")}
    rewards = "; ".join(f"{mode} reward {result[mode]['reward_first']:.3f} -> {result[mode]['reward_last']:.3f}, "
                        f"step {result[mode]['step_time_s'] * 1e3:.1f} ms" for mode in ("sync", "async"))
    return all(learned.values()), (f"{PIPELINE_STEPS} steps each: {rewards}; async / sync step time "
                                   f"{result['step_time_ratio']:.2f}x"
                                   + ("" if all(learned.values()) else f"; did not learn: {learned}"))


def check_without_gpu() -> int:
    from llamarl_core.ops.kernel_check import compile_all

    print("No CUDA device is visible (torch.cuda.is_available() is False): the GPU tests and benches need one.\n"
          "Running what needs no GPU: every Triton kernel variant compiled for sm_80, sm_90 and sm_100.", flush=True)
    rows = compile_all()
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
    print(f"\nCompile check: {len(rows) - len(failed)} of {len(rows)} compiled "
          f"({'passed' if not failed else 'FAILED'}). Full table: python -m llamarl_core.ops.kernel_check")
    return 1 if failed else 0


def check_gpu(args) -> int:
    from llamarl_core.bench import bench_gpu

    print(f"CUDA device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    lines, ok, skipped = [], True, []
    tests = find_tests(args.tests)
    if tests is None:
        lines.append(("gpu tests", "tests/ not found: run from a source checkout or pass --tests DIR"))
        ok = False
    else:
        passed, summary = run_gpu_tests(tests, args.timeout)
        ok &= passed
        lines.append(("gpu tests (pytest -m gpu)", summary))
    met, targets = 0, 0
    if not args.no_bench:
        result = bench_gpu.run(bench_gpu.parse_args(["--repeats", str(args.repeats)]))
        print(bench_gpu.report(result), flush=True)
        for r in result["rows"]:
            target = target_of(r["what"])
            verdict = ""
            if target is not None:
                targets += 1
                met += r["vs_copy"] >= target
                verdict = f" (target {target:.2f}x: {'met' if r['vs_copy'] >= target else 'MISSED'})"
            limit = r.get("limit", "its limit")
            lines.append((r["what"], f"{r['gbps']:.0f} {r.get('unit', 'GB/s')}, {r['vs_copy']:.2f}x {limit}{verdict}"
                          + (f", {r['vs_naive']:.2f}x faster than naive" if "vs_naive" in r else "")
                          + (f", generator stall {r['stall_s'] * 1e3:.2f} ms" if "stall_s" in r else "")))
    if not args.no_pipeline:
        learned, summary = run_pipeline(args.timeout)
        ok &= learned
        lines.append(("llamarl train --device cuda --compare (default task)", summary))
    if tests is not None and not args.no_sanitizer:
        clean, summary = run_sanitizer(tests, args.timeout)
        ok &= clean is not False
        if clean is None:
            skipped.append("compute-sanitizer")
        lines.append(("compute-sanitizer", summary))
    print("\n| check | result |\n|---|---|")
    for name, result in lines:
        print(f"| {name} | {result} |")
    verdict = "passed" if ok else "FAILED"
    if skipped:
        verdict += f" ({', '.join(skipped)} skipped)"
    if targets:
        verdict += f"; {met} of {targets} bench ratios at their targets"
    print(f"\nllamarl check gpu: {verdict}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    from .cli import HelpFormatter

    parser = argparse.ArgumentParser(prog="llamarl check gpu", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("what", choices=["gpu"], help="what to check")
    parser.add_argument("--tests", help="the repository's tests/ folder (default: ./tests, or beside the package)")
    parser.add_argument("--no-bench", action="store_true", help="skip the GPU benches")
    parser.add_argument("--no-sanitizer", action="store_true", help="skip compute-sanitizer")
    parser.add_argument("--no-pipeline", action="store_true", help="skip the `llamarl train --device cuda` run")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats of each bench (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds allowed to each test run")
    args = parser.parse_args(argv)
    return check_gpu(args) if torch.cuda.is_available() else check_without_gpu()


if __name__ == "__main__":
    sys.exit(main())
