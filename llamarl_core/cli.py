"""The `llamarl` command.

    llamarl train [options]         the asynchronous RL pipeline (llamarl train --help)
    llamarl export RUN_DIR OUT      a run's policy as a transformers model folder
    llamarl dataset arithmetic OUT  a small arithmetic dataset (JSONL) with exact answers
    llamarl bench sync [options]    weight-sync bandwidth between real processes
    llamarl bench fp8 [options]     FP8 weight quantization throughput
    llamarl bench aipo [options]    each policy loss type's time and peak memory
    llamarl bench pipeline [options] RL throughput and reward beside TRL's GRPOTrainer
    llamarl bench gpu [options]     the GPU kernels and CUDA copy engine beside the copy bandwidth
    llamarl bench soak [options]    memory, Store keys, files and threads over thousands of steps
    llamarl bench trl [options]     one GRPO run through TRL's GRPOTrainer and through llamarl's
    llamarl bench plan [options]    the local cost model's predictions beside measured runs
    llamarl plan SCENARIO.json      a run's step time, memory and bottleneck predicted before it starts
    llamarl check gpu [options]     every GPU figure and test within a time budget (the compile check without a GPU)
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading

from . import forkserver

USAGE = """usage: llamarl <command> ...   (llamarl --version: the version)

commands:
  train         run the asynchronous RL pipeline on the embedded default task
                (or --task module:attribute); --compare runs the sync baseline too
  export        RUN_DIR OUT: the policy of a run (its last checkpoint) as a
                model folder that transformers and vLLM load
  dataset arithmetic  OUT.jsonl: short arithmetic word problems with exact
                answers, for --dataset (llamarl dataset arithmetic --help)
  bench sync    weight-sync bandwidth: FSDP trainer ranks -> TP generator ranks,
                beside memcpy, gloo broadcast and torch.multiprocessing sharing
                (llamarl bench sync --help)
  bench fp8     FP8 weight quantization GB/s beside a copy and the torch reference
                (llamarl bench fp8 --help)
  bench aipo    each policy loss type's time and peak memory (from logits and
                from hidden states) beside the naive torch loss and
                Liger-Kernel's chunked GRPO loss (llamarl bench aipo --help)
  bench pipeline  completion tokens/s and reward of our async and sync modes
                beside TRL's GRPOTrainer (llamarl bench pipeline --help)
  bench gpu     FP8 quantization, the AIPO kernels and weight sync over CUDA
                IPC beside the GPU's copy bandwidth (llamarl bench gpu --help)
  bench soak    the default pipeline and a sync-only loop for thousands of
                steps: every process's RSS, files and threads, the Store's keys
                and the step time, flat or not (llamarl bench soak --help)
  bench trl     one GRPO run through TRL's GRPOTrainer and through llamarl's
                (one import changed): loss time and memory, step time, equal
                losses (llamarl bench trl --help)
  bench plan    `llamarl train` runs of this machine measured beside the local
                cost model's predictions (llamarl bench plan --help)
  plan          SCENARIO.json: a run's step time, each phase's time, memory
                per GPU and the bottleneck, predicted; --choose the placement;
                --paper LlamaRL's and NeMo-RL's tables; plan fit RUNS.json;
                plan calibrate -o CAL.json, then a `llamarl train` run's
                folder as SCENARIO (llamarl plan --help)
  check gpu     the build for this GPU, every `gpu` test, the GPU benches,
                the pipeline on one GPU and compute-sanitizer within a time
                budget (--budget), one table and --json; without a GPU, every
                Triton kernel compiled for sm_80 / 90 / 100 (llamarl check gpu --help)
"""

class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every command's --help: its docstring as written, and each option's default
    after its help (unless the help says it already, or there is none: None, a flag)."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return help_text
        if "default" in help_text:
            return help_text
        return f"{help_text} (default: %(default)s)".strip()


BENCHES = {
    "sync": "llamarl_core.bench.bench_sync",
    "fp8": "llamarl_core.bench.bench_fp8",
    "aipo": "llamarl_core.bench.bench_aipo",
    "pipeline": "llamarl_core.bench.bench_pipeline",
    "gpu": "llamarl_core.bench.bench_gpu",
    "soak": "llamarl_core.bench.bench_soak",
    "trl": "llamarl_core.bench.bench_trl",
    "control": "llamarl_core.bench.bench_control",
    "plan": "llamarl_core.bench.bench_plan",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--version"], ["-V"]):
        from . import __version__

        print(f"llamarl {__version__}")
        return 0
    # A module in the working folder loads as with `python -m` (--task mymod:my_task, --reward
    # mymod:fn, --resume and export of such a run); the console script alone would not see it.
    # Appended, not prepended: a source checkout as the working folder must not shadow the
    # installed package and its built native module. The executors inherit sys.path (forkserver).
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    if argv and argv[0] == "train":
        if not {"-h", "--help"} & set(argv):
            # The executors' forkserver imports torch and transformers while this process
            # imports the pipeline (both take seconds), not after it.
            from .forkserver import start

            start()
        from .pipeline.train_cli import main as train_main

        return train_main(argv[1:])
    if argv and argv[0] == "export":
        return _export(argv[1:])
    if len(argv) >= 2 and argv[0] == "dataset" and argv[1] == "arithmetic":
        from .pipeline.arithmetic import main as arithmetic_main

        return arithmetic_main(argv[2:])
    if argv and argv[0] == "plan":
        from .planner.cli import main as plan_main

        return plan_main(argv[1:], local=_LocalPlanner())
    if argv and argv[0] == "check":
        from .check import main as check_main

        return check_main(argv[1:])
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHES:
        import importlib

        return importlib.import_module(BENCHES[argv[1]]).main(argv[2:])
    print(USAGE, file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
    return 0 if argv and argv[0] in ("-h", "--help") else 2


class _LocalPlanner:
    """`llamarl plan`'s side in the pipeline (pipeline/plan_local.py: is_run_config, predict,
    calibrate), imported when a run of this machine is planned, not for rows."""

    def __getattr__(self, name):
        from .pipeline import plan_local

        return getattr(plan_local, name)


def _export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llamarl export", formatter_class=HelpFormatter,
                                     description="Write the policy of a `llamarl train` run (its last checkpoint) as a "
                                                 "model folder: config.json, model.safetensors, the tokenizer.")
    parser.add_argument("run_dir", help="the run's --out folder")
    parser.add_argument("out", help="the model folder to write (replaced if it exists)")
    args = parser.parse_args(argv)
    from .pipeline.export import export_run

    try:
        out = export_run(args.run_dir, args.out)
    except (ValueError, TypeError) as exc:  # TypeError: the run's task is no longer a Task
        raise SystemExit(f"llamarl export: {exc}") from None
    print(f"wrote {out}/")
    return 0


def exit_status(main_fn) -> int:
    """Run `main_fn()` and return the exit status `sys.exit` would give the process
    for what it returned or exited with: None 0, an int itself, anything else
    (SystemExit's message) printed to stderr, then 1. What the console script
    runs, less the process's end (run_command); the tests run commands in their
    own process through it."""
    try:
        code = main_fn()
    except SystemExit as exc:
        code = exc.code
    if code is None:
        return 0
    if not isinstance(code, int):
        print(code, file=sys.stderr)
        return 1
    return code


def run_command(main_fn) -> None:
    """Run `main_fn()` as this process's command, then end the process as
    `sys.exit` would with what it returned or exited with, less the interpreter's
    teardown of its modules: a collection over every object torch, transformers
    and the rest made, 1-2.5 s after each `llamarl train` here, for nothing a run
    keeps. Never returns: for a command's own process (the console script, `python
    -m`), not for a caller's (call `main` there). What the exit does first is done
    first, in its order: the other non-daemon threads joined (threading's exit
    hooks first, which wake idle pool workers), every atexit handler run
    (multiprocessing's clean-up of its children, temporary folders), then the
    executors' forkserver stopped (forkserver.stop) and the streams flushed. An
    exception other than SystemExit ends the process the ordinary way, its
    traceback printed."""
    code = exit_status(main_fn)
    threading._shutdown()  # what the interpreter's exit calls: its hooks, then the non-daemon threads joined
    atexit._run_exitfuncs()
    forkserver.stop()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone (`| head`), a stream closed
            pass
    os._exit(code)


def console() -> None:
    """The `llamarl` command (and `python -m llamarl_core.cli`)."""
    run_command(main)


if __name__ == "__main__":
    console()
