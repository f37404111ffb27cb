"""Checks of a sync's destination that a rank process imports without helpers.py
(which imports transformers: 4-5 s of CPU a process here), e.g. the namespace
hosts' ranks of test_hosts.py."""

from __future__ import annotations

from typing import Mapping

import torch

from llamarl_core.sync import Layout


def poisoned_destination(layout: Layout, rank: int) -> dict[str, torch.Tensor]:
    """Every tensor of `rank` (FP8 weights and scales included) NaN where a sync must
    write, zeros in padding rows (as vLLM allocates them)."""
    out = {}
    for name, (shape, dtype) in layout.local_tensor_specs(rank).items():
        t = torch.full(shape, float("nan")).to(dtype)
        if name in layout.params:
            start, stop = layout.padding_rows(name, rank)
            t[start:stop] = 0
        out[name] = t
    return out


def mismatches(expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> list[str]:
    """One line per tensor that is not bitwise equal: count, first bad index, NaNs."""
    lines = []
    for name in sorted(set(expected) | set(got)):
        if name not in got or name not in expected:
            lines.append(f"{name}: present on one side only")
            continue
        a, b = expected[name], got[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            lines.append(f"{name}: {tuple(b.shape)} {b.dtype} != expected {tuple(a.shape)} {a.dtype}")
            continue
        a_bytes, b_bytes = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        if torch.equal(a_bytes, b_bytes):
            continue
        bad = (a_bytes != b_bytes).nonzero()
        lines.append(
            f"{name}: {len(bad)} bytes differ, first at byte {bad[0].item()}, NaN in result: {int(torch.isnan(b.float()).sum())}"
        )
    return lines
