"""Shared benchmark harness: statistics, machine info, the CSV log and RESULTS.md.

Every benchmark prints its figures beside a limit or a peer measured in the same
run. With `--record DIR` (and only then: an installed package's folder is never
written to) it appends one CSV row per figure (machine, timestamp, version, git
SHA) to DIR/results.csv and rewrites its own section of DIR/RESULTS.md with the
latest figures and the command that produced them; `--record bench` from the
repository's root keeps the repository's bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import llamarl_core
from llamarl_core.control.auth import SECRET_ENV, new_secret


def share_secret() -> None:
    """One secret for every process of a bench whose weight syncs authenticate their
    Store values (auth.py): set in this process's environment (unless the caller set
    one), which the bench's processes inherit: before the first of them starts,
    for those forked from llamarl_core.forkserver's server take the environment
    it was launched with (or started in a network namespace host)."""
    os.environ.setdefault(SECRET_ENV, new_secret().hex())


def timed(fn, repeats: int, warmup: int = 1, cuda: bool | None = None) -> list[float]:
    """Seconds of each of `repeats` calls of fn() after `warmup` untimed ones, the
    CUDA device synchronized around each call (cuda None: where one is available):
    what a caller waiting for the result pays, the host's launch work included."""
    import torch

    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return samples


def summarize(samples: list[float]) -> dict:
    """Median and spread (min, max) of repeated measurements."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def git_sha(folder: Path) -> str:
    """The commit of the repository holding `folder` (where the figures are recorded), or "unknown"."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=folder, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> str:
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} cores"


def command_line() -> str:
    """The command as a user would type it."""
    argv = sys.argv[1:]
    if Path(sys.argv[0]).name == "llamarl":
        return "llamarl " + shlex.join(argv)
    return "python " + shlex.join([os.path.relpath(sys.argv[0]), *argv])


def append_csv(path: Path, bench: str, figures: dict[str, float], params: dict) -> None:
    """One row per figure: timestamp, machine, version, git SHA, bench, name, value, params."""
    new = not path.exists()
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with path.open("a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(["timestamp", "machine", "version", "git_sha", "bench", "figure", "value", "params"])
        for name, value in figures.items():
            writer.writerow([stamp, machine(), llamarl_core.__version__, git_sha(path.parent), bench, name,
                             f"{value:.6g}", " ".join(f"{k}={v}" for k, v in params.items())])


def update_results_md(path: Path, section: str, body: str) -> None:
    """Replace (or add) the section `## {section}` of the Markdown file `path`."""
    text = path.read_text() if path.exists() else "# Benchmark results\n\nLatest figures, with the command that produced them.\n"
    header = f"## {section}\n"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    block = f"{header}\n`{command_line()}` on {machine()}, {stamp}, git {git_sha(path.parent)}\n\n{body.strip()}\n\n"
    if header in text:
        start = text.index(header)
        nxt = text.find("\n## ", start + len(header))
        text = text[:start] + block + (text[nxt + 1 :] if nxt >= 0 else "")
    else:
        text = text.rstrip() + "\n\n" + block
    path.write_text(text.rstrip() + "\n")


def record(folder: Path | None, bench: str, figures: dict[str, float], params: dict, section: str, body: str) -> None:
    """With --record DIR: the figures appended to DIR/results.csv and `body` as the
    section `section` of DIR/RESULTS.md. Without (None): nothing is written."""
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    append_csv(folder / "results.csv", bench, figures, params)
    update_results_md(folder / "RESULTS.md", section, body)


def at_least(minimum: int):
    """An argparse type: an integer >= minimum (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def add_model_args(parser, hidden: int, intermediate: int, layers: int, size: str) -> None:
    """The Llama-shaped model a sync bench moves (16 heads, 4 KV heads, vocabulary 32000 unless told); `size`:
    what the default shape weighs, for the help."""
    parser.add_argument("--hidden", type=at_least(1), default=hidden, help="the model's hidden size")
    parser.add_argument("--intermediate", type=at_least(1), default=intermediate, help="the model's MLP size")
    parser.add_argument("--layers", type=at_least(1), default=layers,
                        help=f"decoder layers (default {layers}: {size} at the default shape)")
    parser.add_argument("--heads", type=at_least(1), default=16, help="attention heads")
    parser.add_argument("--kv-heads", type=at_least(1), default=4, help="key / value heads")
    parser.add_argument("--vocab", type=at_least(1), default=32000, help="vocabulary size")


def check_model_args(parser, spec) -> None:
    """parser.error naming the flags where add_model_args' shape is not a model
    (heads not dividing the hidden size, KV heads not dividing the heads)."""
    if spec.hidden % spec.heads:
        parser.error(f"--heads {spec.heads} must divide --hidden {spec.hidden}")
    if spec.heads % spec.kv_heads:
        parser.error(f"--kv-heads {spec.kv_heads} must divide --heads {spec.heads}")


def add_output_args(parser) -> None:
    """--json, --json-out and --record, the same for every benchmark (emit() and record() serve them)."""
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--json-out", type=Path, metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--record", type=Path, metavar="DIR",
                        help="append the figures to DIR/results.csv and rewrite this bench's section of "
                             "DIR/RESULTS.md (--record bench from the repository's root: its own); without it nothing "
                             "is written")
    # Recording is off unless asked for since --record; scripts that still say --no-record keep running.
    parser.add_argument("--no-record", action="store_true", help=argparse.SUPPRESS)


def emit(spec, result, text: str, indent: int | None = 2) -> None:
    """The bench's output: `result` as JSON with --json, else `text`; and `result` as
    JSON written to --json-out PATH when given."""
    if spec.json_out is not None:
        spec.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=indent) if spec.json else text)


def table(rows: list[list[str]]) -> str:
    """A Markdown table (first row is the header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, rows[1:])])
