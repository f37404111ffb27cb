"""The figures of `llamarl check gpu` and `llamarl bench gpu`: one row each, and the
targets the judged ones must reach (the GPU issue's item 3), in one place.

A row is `name, value, unit, limit, ratio, target`: `limit` is measured in the same
run, in the same unit; `ratio` is value / limit for a rate and limit / value for a
time, so that `ratio >= target` is met (target None: shown, not judged).
"""

from __future__ import annotations

# By the start of a row's name.
TARGETS = {
    "fp8 quantize, per tensor, check=False": 0.6,
    "fp8 quantize, per channel, check=False": 0.9,
    "fp8 quantize, per block, check=False": 0.9,
    "aipo_loss fwd + bwd, ": 0.85,  # every loss_type
    "linear_aipo_loss fwd + bwd": 1 / 1.2,  # within 1.2x of its three GEMMs
    "weight sync over CUDA IPC, 1 GiB": 0.8,
    "weight sync over CUDA IPC, 8 GiB": 0.9,
    "FP8 weight sync over CUDA IPC": 1 / 1.2,  # within 1.2x of the fp32 -> bf16 sync of the same weights
    "~1B Llama on one GPU": 1 / 0.8,  # async step <= 0.8x the sync step
}
TIME_UNITS = ("ms", "s")


def target_of(name: str) -> float | None:
    return next((t for prefix, t in TARGETS.items() if name.startswith(prefix)), None)


def figure(name: str, value: float, unit: str, limit: float | None = None) -> dict:
    """One row, its target looked up by name."""
    ratio = None
    if limit is not None:
        ratio = limit / value if unit in TIME_UNITS else value / limit
    return {"name": name, "value": value, "unit": unit, "limit": limit, "ratio": ratio, "target": target_of(name)}


def met(row: dict) -> bool | None:
    """Whether a judged row reached its target (None: the row is not judged)."""
    if row["target"] is None:
        return None
    return row["ratio"] is not None and row["ratio"] >= row["target"]


def judged_summary(rows: list[dict]) -> str:
    judged = [met(r) for r in rows if r["target"] is not None]
    return f"{sum(judged)} of {len(judged)} figures at their targets"


def _number(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def rows_table(rows: list[dict]) -> str:
    """The rows as a Markdown table, each judged one marked met or MISSED."""
    lines = ["| figure | value | limit | ratio | target |", "|---|---|---|---|---|"]
    for r in rows:
        verdict = "" if r["target"] is None else f"{r['target']:.2f} ({'met' if met(r) else 'MISSED'})"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        value = f"{_number(r['value'])} {r['unit']}"
        lines.append(f"| {r['name']} | {value} | {_number(r['limit'])} | {ratio} | {verdict} |")
    return "\n".join(lines)
