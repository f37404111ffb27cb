"""`llamarl check gpu`: every GPU figure from one command, within a time budget.

On a CUDA device, in priority order (check/steps.py, docs/gpu.md): from a source
checkout, the package installed with its native module built for this device's
architecture alone (`pip install --no-build-isolation --no-deps -e .` with
CUDAARCHS) and its CUDA backend probed; the tests marked `gpu`, with
compute-sanitizer memcheck on the sync test between processes and the default task
learning in both modes (`llamarl train --device cuda --compare`) beside them; the
kernel benches (`llamarl bench gpu --parts kernels`: FP8 quantization, the FP8 GEMM,
aipo_loss and every loss_type, linear_aipo_loss); the weight-sync benches (`--parts
sync`: 1 and 8 GiB over CUDA IPC from bf16 and fp32, with the generator's stall; FP8
in the sync); a ~1B Llama pipeline in both modes on this one GPU (`llamarl bench
pipeline --device cuda`). Each step carries an estimate of its time and starts only
if the budget left covers it (else a line says it was skipped); a started step runs
to its end under its own timeout (check/budget.py). Without a GPU it says so and
compiles every Triton kernel variant for sm_80 / sm_90 / sm_100 instead.

It prints each step as it starts and ends, then one table of the steps and one of
the figures (`name, value, unit, limit, ratio, target`, ratio >= target being met:
check/figures.py). --json PATH writes one object: commit, device, driver, torch,
triton, seconds (the whole command from the process's start, build included),
budget_s, complete (false while steps are still to run: it is rewritten after
each), steps, rows. Every step's output goes to the log (--log; default: beside
the JSON, else a llamarl-check-*.log file in the temporary folder, its path
printed). Exit status 1 when a step failed (the build, the tests, a bench or
pipeline run, the learning, the sanitizer), else 0: a missed target is a figure,
a skipped step a line.

From the repository root, before installing anything (the build is its first
step, counted in its seconds): python3 -m llamarl_core.cli check gpu --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .budget import FAILED, SKIPPED, BudgetRun, Record
from .figures import judged_summary, rows_table
from .steps import STEP_NAMES, Context, compile_check, gpu_plan


def process_start() -> float:
    """This process's start on time.monotonic()'s clock (Linux: /proc), so that the
    budget and `seconds` count the interpreter's start and imports too; elsewhere now."""
    try:
        since_boot = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.monotonic() - max(0.0, uptime - since_boot)
    except (OSError, ValueError, IndexError):
        return time.monotonic()


def source_root() -> Path | None:
    """The source checkout this package runs from (setup.py beside it), or None (installed)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "setup.py").exists() and (root / "csrc").is_dir() else None


def find_tests(given: str | None, root: Path | None) -> Path | None:
    """The repository's tests/ folder: --tests, else beside the package (a source checkout), else ./tests."""
    candidates = [Path(given)] if given else [p for p in (root and root / "tests", Path.cwd() / "tests") if p]
    return next((p.resolve() for p in candidates if (p / "conftest.py").exists()), None)


def commit_of(root: Path | None) -> str:
    """`git rev-parse HEAD` of the checkout, "+dirty" when tracked files changed; "unknown" without git."""
    if root is None:
        return "unknown"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def device_info(gpu: bool) -> dict:
    import torch
    import triton

    info = {"device": "none (no CUDA device visible)", "driver": "none", "torch": torch.__version__,
            "triton": triton.__version__, "arch": None}
    if not gpu:
        return info
    major, minor = torch.cuda.get_device_capability()
    info.update(device=torch.cuda.get_device_name(), arch=f"{major}{minor}", driver="unknown")
    try:
        import pynvml

        pynvml.nvmlInit()
        info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 (the driver's version is a label; its absence is said)
        info["driver"] = f"unknown (NVML: {exc})"
    return info


def report(result: dict) -> str:
    lines = [f"llamarl check gpu at {result['commit']} on {result['device']} (driver {result['driver']}, torch "
             f"{result['torch']}, Triton {result['triton']}): {result['seconds']:.0f} s of a "
             f"{result['budget_s']:.0f} s budget", "", "| step | status | seconds (estimate) | result |", "|---|---|---|---|"]
    for s in result["steps"]:
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']:.1f} ({s['estimate_s']:.0f}) | {s['summary']} |")
    if result["rows"]:
        lines += ["", rows_table(result["rows"])]
    return "\n".join(lines)


def verdict(records: list[Record], rows: list[dict]) -> tuple[int, str]:
    failed = [r.name for r in records if r.status == FAILED]
    skipped = [r.name for r in records if r.status == SKIPPED]
    text = f"FAILED: {', '.join(failed)}" if failed else "passed"
    if skipped:
        text += f"; skipped: {', '.join(skipped)}"
    if any(r["target"] is not None for r in rows):
        text += f"; {judged_summary(rows)}"
    return (1 if failed else 0), text


def main(argv: list[str] | None = None) -> int:
    from ..cli import HelpFormatter

    parser = argparse.ArgumentParser(prog="llamarl check gpu", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("what", choices=["gpu"], help="what to check")
    parser.add_argument("--budget", type=float, default=300.0, metavar="SECONDS",
                        help="time for the whole command, counted from its start; a step starts only if what is "
                             "left covers its estimate")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the result as one JSON object to PATH")
    parser.add_argument("--log", type=Path, metavar="PATH",
                        help="every step's output (default: the --json path with .log, else a new "
                             "llamarl-check-*.log in the temporary folder)")
    parser.add_argument("--tests", help="the repository's tests/ folder (default: beside the package, or ./tests)")
    parser.add_argument("--skip", default="", metavar="STEPS",
                        help=f"comma-separated steps to leave out (recorded as skipped), of: {', '.join(STEP_NAMES)}")
    parser.add_argument("--commit", help="the commit measured, where the checkout has no .git (default: git's HEAD)")
    args = parser.parse_args(argv)
    if not args.budget > 0:
        parser.error(f"--budget must be > 0 seconds, got {args.budget:g}")
    args.skip = [name.strip() for name in args.skip.split(",") if name.strip()]
    unknown = [name for name in args.skip if name not in STEP_NAMES]
    if unknown:
        parser.error(f"--skip: {', '.join(map(repr, unknown))} is not a step; the steps: {', '.join(STEP_NAMES)}")
    for flag, path in (("--json", args.json), ("--log", args.log)):
        if path is not None and not path.resolve().parent.is_dir():
            parser.error(f"{flag}: the folder {path.resolve().parent} does not exist")
    started = process_start()
    import torch

    gpu = torch.cuda.is_available()
    info = device_info(gpu)
    root = source_root()
    if args.log is None and args.json is None:
        handle, name = tempfile.mkstemp(prefix="llamarl-check-", suffix=".log")
        os.close(handle)
        args.log = Path(name)
    log = args.log or args.json.with_suffix(".log")
    log.write_text("")
    with tempfile.TemporaryDirectory(prefix="llamarl-check-") as scratch:  # the benches' JSON, the runs' folders
        ctx = Context(python=sys.executable, root=root, tests=find_tests(args.tests, root), log=log.resolve(),
                      scratch=Path(scratch), arch=info["arch"])
        return _check(args, ctx, info, gpu, started)


def _check(args, ctx: Context, info: dict, gpu: bool, started: float) -> int:
    if gpu:
        print(f"CUDA device: {info['device']} (sm_{info['arch']}), driver {info['driver']}, torch {info['torch']}, "
              f"Triton {info['triton']}", flush=True)
        steps = gpu_plan(ctx)
    else:
        print("No CUDA device is visible (torch.cuda.is_available() is False): the GPU tests and benches need one.\n"
              "Running what needs no GPU: every Triton kernel variant compiled for sm_80, sm_90 and sm_100.", flush=True)
        steps = [compile_check()]
    args.skip = [name for name in args.skip if name in {step.name for step in steps}]  # a step of the plan run here
    print(f"Budget {args.budget:.0f} s; every step's output: {ctx.log}", flush=True)
    commit = args.commit or commit_of(ctx.root)

    def result_of(records: list[Record], complete: bool) -> dict:
        return {"commit": commit, **{k: info[k] for k in ("device", "driver", "torch", "triton")},
                "seconds": round(time.monotonic() - started, 1), "budget_s": args.budget, "complete": complete,
                "steps": [r.to_dict() for r in records], "rows": [row for r in records for row in r.rows]}

    def save(result: dict) -> None:
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=2) + "\n")

    # After each step, what is known so far (complete: false): a check ended from outside keeps it.
    records = BudgetRun(args.budget, start=started, on_event=lambda line: print(line, flush=True),
                        on_record=lambda so_far: save(result_of(so_far, False)), skip=args.skip).run(steps)
    result = result_of(records, True)
    save(result)
    status, text = verdict(records, result["rows"])
    print("\n" + report(result) + f"\n\nllamarl check gpu: {text}", flush=True)
    return status
