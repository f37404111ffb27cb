"""FP8 destinations of a weight sync.

A generator parameter marked `fp8=<granularity>` in its layout is held as a
float8_e4m3fn weight plus a float32 scale (vLLM's names: `weight_scale_inv` per
128 x 128 block, `weight_scale` per tensor and per channel). The sync lands its
resharded rows in a landing buffer of the layout's dtype (bf16); once every
segment has landed, the receiver quantizes them into its own weight and scale
with llamarl_core.ops.fp8, and only then reports the version.

Scales follow vLLM's tensor-parallel layout, so some need the amax of rows other
ranks hold (reduced with MAX across the destination ranks):
- per tensor: one scale for the whole logical tensor; for a fused parameter
  (qkv, gate_up) one scale per part, each from that part's amax over all ranks.
- per channel: one scale per output row; a parameter split on dim 1 (o_proj,
  down_proj) takes each row's amax over all ranks.
- per block: the 128 x 128 blocks of the local tensor.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from ..ops.fp8 import DEFAULT_BLOCK, cast_to_fp8, fp8_amax, raise_if_not_finite, scale_from_amax, scale_shape
from .layout import Fused, Layout, Replicate, Shard, fp8_scale_name, view_2d


def _reduced_across_ranks(layout: Layout, name: str) -> bool:
    spec = layout.params[name]
    if layout.world_size == 1 or isinstance(spec.placement, Replicate):
        return False
    if spec.fp8 == "tensor":
        return True
    return spec.fp8 == "channel" and isinstance(spec.placement, Shard) and spec.placement.dim == 1


def fp8_scale_local_shape(layout: Layout, name: str, rank: int) -> tuple[int, ...]:
    """Shape of an FP8 parameter's scale on `rank`."""
    spec = layout.params[name]
    local = view_2d(layout.local_shape(name, rank))
    if spec.fp8 == "block":
        return scale_shape(local, "block", DEFAULT_BLOCK)
    if spec.fp8 == "channel":
        return (local[0], 1)
    if isinstance(spec.placement, Fused):
        return (len(spec.placement.parts),)
    return ()


class Fp8Destinations:
    """The FP8 parameters of one destination rank: landing buffers, local amax,
    the flat vector of amaxes that ranks reduce with MAX, and the final cast."""

    def __init__(self, layout: Layout, rank: int):
        self.layout, self.rank = layout, rank
        self.names = [n for n, s in layout.params.items() if s.fp8 is not None]
        self.slots: dict[str, tuple[int, int]] = {}  # name -> (offset, count) in the reduced vector
        offset = 0
        for name in self.names:
            if _reduced_across_ranks(layout, name):
                count = math.prod(fp8_scale_local_shape(layout, name, rank))
                self.slots[name] = (offset, count)
                offset += count
        self.num_reduced = offset

    def landing(self, tensors: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """What the plan writes: the registered tensors, with a fresh landing buffer
        (the layout's dtype, local shape) in place of each FP8 weight."""
        out = {}
        for name, spec in self.layout.params.items():
            if spec.fp8 is None:
                out[name] = tensors[name]
            else:
                out[name] = torch.zeros(self.layout.local_shape(name, self.rank), dtype=spec.dtype, device=device)
        return out

    def _part_rows(self, name: str) -> list[tuple[int, int]]:
        """Local row ranges of each part of a fused parameter."""
        ranges, start = [], 0
        for part in self.layout.params[name].placement.parts:
            lo, hi = part.row_ranges[self.rank]
            ranges.append((start, start + hi - lo))
            start += hi - lo
        return ranges

    def local_amax(self, landing: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Per FP8 parameter, the amax of what landed here (raises ValueError naming
        the parameter on NaN / inf, before any FP8 weight is written); and the flat
        float32 vector of the entries other ranks must see."""
        amaxes = {}
        # check=False: no host sync per parameter (about 320 per version at 70B); every
        # amax is checked at once below (an amax is inf exactly where its group holds NaN / inf).
        for name in self.names:
            spec = self.layout.params[name]
            w = landing[name].view(view_2d(tuple(landing[name].shape)))
            if spec.fp8 == "tensor" and isinstance(spec.placement, Fused):
                amaxes[name] = torch.stack([fp8_amax(w[a:b], "tensor", name=name, check=False)
                                            for a, b in self._part_rows(name)])
            else:
                amaxes[name] = fp8_amax(w, spec.fp8, DEFAULT_BLOCK, name=name, check=False)
        if amaxes:
            finite = torch.stack([torch.isfinite(a).all() for a in amaxes.values()]).cpu()
            if not bool(finite.all()):
                bad = list(amaxes)[int((~finite).nonzero()[0])]
                raise_if_not_finite(amaxes[bad], bad)
        flat = torch.zeros(self.num_reduced, dtype=torch.float32)
        if self.slots:
            flat = torch.cat([amaxes[name].reshape(-1) for name in self.slots]).to("cpu", torch.float32)
        return amaxes, flat

    def finish(self, landing, tensors, amaxes: dict[str, torch.Tensor], reduced: torch.Tensor) -> None:
        """Quantize every landed FP8 parameter into its weight and scale, with the
        amaxes reduced across ranks where the scale spans ranks."""
        for name in self.names:
            spec = self.layout.params[name]
            amax = amaxes[name]
            if name in self.slots:
                offset, count = self.slots[name]
                amax = reduced[offset : offset + count].reshape(amax.shape).to(amax.device)
            scale = scale_from_amax(amax)
            w = landing[name].view(view_2d(tuple(landing[name].shape)))
            out = tensors[name].view(w.shape)
            if spec.fp8 == "tensor" and isinstance(spec.placement, Fused):
                # One scale per part: a per-row scale that repeats each part's scale over its rows.
                rows = torch.cat([scale[i].expand(b - a) for i, (a, b) in enumerate(self._part_rows(name))])
                cast_to_fp8(w, rows.reshape(-1, 1).contiguous(), "channel", DEFAULT_BLOCK, out)
            else:
                cast_to_fp8(w, scale, spec.fp8, DEFAULT_BLOCK, out)
            tensors[fp8_scale_name(name, spec.fp8)].copy_(scale)


def reduce_max(vectors: list[torch.Tensor]) -> torch.Tensor:
    """Elementwise MAX of the ranks' amax vectors (amaxes are >= 0)."""
    return torch.stack(vectors).amax(dim=0) if vectors else torch.zeros(0)
