"""Layouts: how one side (trainer or generator) holds each parameter on its ranks.

A layout lists parameters (name, global shape, dtype, placement). A placement says
which part of which *logical* tensor each rank holds. Logical tensors are the
unsharded, unfused tensors both sides agree on (Hugging Face names for Llama).

Every placement compiles to *fragments*: per rank, rectangles of a logical
tensor's 2-D view and where they sit in the rank's local tensor. The planner
only ever sees fragments, so new placements need no planner change.

2-D views: a 1-D tensor of n elements is viewed as (n, 1); an N-D tensor as
(shape[0], prod(shape[1:])). Splits are on dim 0, or on dim 1 of a 2-D tensor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Iterable, Union

import torch

from ..ops.fp8 import GRANULARITIES, INPUT_DTYPES

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def view_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of the 2-D view of a tensor of this shape."""
    if len(shape) == 0:
        return (1, 1)
    return (shape[0], math.prod(shape[1:]))


def chunk_bounds(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's piece when `torch.chunk(t, world_size)` splits `size`
    elements: chunks of ceil(size / world_size), the last ones smaller or empty."""
    chunk = -(-size // world_size) if size else 0
    start = min(rank * chunk, size)
    return start, min(start + chunk, size)


# ----------------------------------------------------------------------------- fragments


@dataclass(frozen=True)
class Fragment:
    """Rows [src_row, src_row + num_rows) x cols [src_col, src_col + num_cols) of the
    logical tensor `source` (2-D view), held at (local_row, local_col) of a local tensor."""

    source: str
    src_row: int
    src_col: int
    num_rows: int
    num_cols: int
    local_row: int
    local_col: int


# ----------------------------------------------------------------------------- placements


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""


@dataclass(frozen=True)
class Shard:
    """Split as `torch.chunk(t, world_size, dim)` splits it: pieces of
    ceil(size / world_size), the last ranks smaller or empty (FSDP2's `Shard(0)`
    local tensors; an even split is the tensor-parallel case).

    `padded_size`: the tensor is first padded with rows up to this many (dim 0
    only), as vLLM pads the vocabulary; padding rows are never written by a sync.
    """

    dim: int = 0
    padded_size: int | None = None


@dataclass(frozen=True)
class FusedPart:
    """One logical tensor inside a fused parameter: `row_ranges[rank]` are the rows
    of `source` that rank holds, stacked after the previous parts' rows."""

    source: str
    source_shape: tuple[int, ...]
    row_ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Fused:
    """Rows of several logical tensors stacked on dim 0 (vLLM's `qkv_proj`,
    `gate_up_proj`), each rank holding its rows of every part, part after part."""

    parts: tuple[FusedPart, ...]


Placement = Union[Replicate, Shard, Fused]


def fp8_scale_name(name: str, granularity: str) -> str:
    """vLLM's name of an FP8 weight's scale: `weight_scale_inv` per 128 x 128 block
    (DeepSeek-V3 checkpoints), `weight_scale` per tensor and per channel."""
    base = name[: -len("weight")] if name.endswith("weight") else name + "_"
    return base + ("weight_scale_inv" if granularity == "block" else "weight_scale")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a layout.

    shape: the global (unsharded) shape; for `Fused`, the parts stacked on dim 0.
    dtype: the dtype the sync lands in (for an FP8 parameter: the bf16 rows that
    are then quantized).
    source: the logical tensor it holds (default: its own name); unused by `Fused`,
    whose parts name their sources.
    fp8: None, or the granularity ("tensor", "channel", "block") of an FP8
    destination: the rank then holds `name` as float8_e4m3fn plus a float32 scale
    (fp8_scale_name); see llamarl_core/sync/fp8.py.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    placement: Placement = Replicate()
    source: str | None = None
    fp8: str | None = None

    @property
    def source_name(self) -> str:
        return self.source if self.source is not None else self.name

    def logical_shapes(self) -> dict[str, tuple[int, ...]]:
        """Logical tensor name -> the global shape this parameter expects it to have."""
        if isinstance(self.placement, Fused):
            return {part.source: tuple(part.source_shape) for part in self.placement.parts}
        return {self.source_name: tuple(self.shape)}


# ----------------------------------------------------------------------------- layout


class Layout:
    """Parameters of one side over `world_size` ranks, validated on construction."""

    def __init__(self, world_size: int, params: Iterable[ParamSpec]):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.params: dict[str, ParamSpec] = {}
        for spec in params:
            if spec.name in self.params:
                raise ValueError(f"parameter {spec.name!r} is listed twice")
            self._validate(spec)
            self.params[spec.name] = spec

    # -- validation ----------------------------------------------------------------
    def _validate(self, spec: ParamSpec) -> None:
        name = spec.name
        if not isinstance(spec.dtype, torch.dtype):
            raise ValueError(f"parameter {name!r}: dtype must be a torch.dtype, got {spec.dtype!r}")
        if any((not isinstance(d, int)) or d < 0 for d in spec.shape):
            raise ValueError(f"parameter {name!r}: shape must be non-negative ints, got {spec.shape}")
        if spec.fp8 is not None:
            if spec.fp8 not in GRANULARITIES:
                raise ValueError(f"parameter {name!r}: fp8 granularity must be one of {GRANULARITIES}, got {spec.fp8!r}")
            if len(spec.shape) != 2 or spec.dtype not in INPUT_DTYPES:
                raise ValueError(f"parameter {name!r}: FP8 needs a 2-D weight landing in bf16, fp16 or fp32")
        placement = spec.placement
        if isinstance(placement, Replicate):
            return
        if isinstance(placement, Shard):
            if placement.dim not in (0, 1) or (placement.dim == 1 and len(spec.shape) != 2):
                raise ValueError(
                    f"parameter {name!r}: can split dim 0 of any tensor or dim 1 of a 2-D tensor, "
                    f"got dim {placement.dim} of shape {spec.shape}"
                )
            if placement.padded_size is not None:
                if placement.dim != 0:
                    raise ValueError(f"parameter {name!r}: padding is supported on dim 0 only")
                if placement.padded_size < spec.shape[0]:
                    raise ValueError(
                        f"parameter {name!r}: padded_size {placement.padded_size} < rows {spec.shape[0]}"
                    )
            return
        if isinstance(placement, Fused):
            if not placement.parts:
                raise ValueError(f"parameter {name!r}: a fused placement needs parts")
            cols = {view_2d(tuple(p.source_shape))[1] for p in placement.parts}
            if len(cols) != 1 or view_2d(spec.shape)[1] not in cols:
                raise ValueError(f"parameter {name!r}: fused parts must share the columns of {spec.shape}")
            if sum(p.source_shape[0] for p in placement.parts) != spec.shape[0]:
                raise ValueError(f"parameter {name!r}: fused parts' rows do not add up to {spec.shape[0]}")
            for part in placement.parts:
                if len(part.row_ranges) != self.world_size:
                    raise ValueError(
                        f"parameter {name!r}: part {part.source!r} has {len(part.row_ranges)} row ranges "
                        f"for world size {self.world_size}"
                    )
                for start, stop in part.row_ranges:
                    if not 0 <= start <= stop <= part.source_shape[0]:
                        raise ValueError(
                            f"parameter {name!r}: part {part.source!r} rows [{start}, {stop}) outside "
                            f"[0, {part.source_shape[0]})"
                        )
            return
        raise ValueError(f"parameter {name!r}: unknown placement {placement!r}")

    # -- per-rank views ------------------------------------------------------------
    def local_shape(self, name: str, rank: int) -> tuple[int, ...]:
        spec = self.params[name]
        placement = spec.placement
        if isinstance(placement, Replicate):
            return tuple(spec.shape)
        if isinstance(placement, Shard):
            size = placement.padded_size if placement.padded_size is not None else spec.shape[placement.dim]
            start, stop = chunk_bounds(size, self.world_size, rank)
            shape = list(spec.shape)
            shape[placement.dim] = stop - start
            return tuple(shape)
        rows = sum(part.row_ranges[rank][1] - part.row_ranges[rank][0] for part in placement.parts)
        return (rows, *spec.shape[1:])

    def fragments(self, name: str, rank: int) -> list[Fragment]:
        """Rectangles of logical tensors that `rank`'s local `name` holds."""
        spec = self.params[name]
        placement = spec.placement
        rows, cols = view_2d(tuple(spec.shape))
        source = spec.source_name
        if isinstance(placement, Replicate):
            return [Fragment(source, 0, 0, rows, cols, 0, 0)] if rows * cols else []
        if isinstance(placement, Shard):
            if placement.dim == 1:
                start, stop = chunk_bounds(cols, self.world_size, rank)
                return [Fragment(source, 0, start, rows, stop - start, 0, 0)] if rows * (stop - start) else []
            size = placement.padded_size if placement.padded_size is not None else rows
            start, stop = chunk_bounds(size, self.world_size, rank)
            real_stop = min(stop, rows)
            if real_stop <= start or cols == 0:
                return []
            return [Fragment(source, start, 0, real_stop - start, cols, 0, 0)]
        fragments, local_row = [], 0
        for part in placement.parts:
            start, stop = part.row_ranges[rank]
            if stop > start and cols:
                fragments.append(Fragment(part.source, start, 0, stop - start, cols, local_row, 0))
            local_row += stop - start
        return fragments

    def padding_rows(self, name: str, rank: int) -> tuple[int, int]:
        """Local rows [start, stop) that are padding (never written by a sync)."""
        placement = self.params[name].placement
        if not isinstance(placement, Shard) or placement.padded_size is None:
            return (0, 0)
        rows = self.params[name].shape[0]
        start, stop = chunk_bounds(placement.padded_size, self.world_size, rank)
        pad_start = min(max(rows - start, 0), stop - start)
        return (pad_start, stop - start)

    def local_tensor_specs(self, rank: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The tensors `rank` holds: name -> (shape, dtype). An FP8 parameter is its
        float8_e4m3fn weight plus its float32 scale (see llamarl_core/sync/fp8.py)."""
        from .fp8 import fp8_scale_local_shape

        specs = {}
        for name, spec in self.params.items():
            shape = self.local_shape(name, rank)
            if spec.fp8 is None:
                specs[name] = (shape, spec.dtype)
            else:
                specs[name] = (shape, torch.float8_e4m3fn)
                specs[fp8_scale_name(name, spec.fp8)] = (fp8_scale_local_shape(self, name, rank), torch.float32)
        return specs

    def local_nbytes(self, name: str, rank: int) -> int:
        return math.prod(self.local_shape(name, rank)) * self.params[name].dtype.itemsize

    def logical_shapes(self) -> dict[str, tuple[int, ...]]:
        """Logical tensor -> global shape, over all parameters (checked consistent)."""
        shapes: dict[str, tuple[int, ...]] = {}
        for spec in self.params.values():
            for source, shape in spec.logical_shapes().items():
                if shapes.setdefault(source, shape) != shape:
                    raise ValueError(
                        f"logical tensor {source!r} has shape {shapes[source]} in one parameter "
                        f"and {shape} in {spec.name!r}"
                    )
        return shapes

    # -- serialisation (exchanged through the torch.distributed Store) -------------
    def to_dict(self) -> dict:
        def placement_dict(p: Placement) -> dict:
            if isinstance(p, Replicate):
                return {"kind": "replicate"}
            if isinstance(p, Shard):
                return {"kind": "shard", "dim": p.dim, "padded_size": p.padded_size}
            return {
                "kind": "fused",
                "parts": [
                    {"source": q.source, "source_shape": list(q.source_shape), "row_ranges": [list(r) for r in q.row_ranges]}
                    for q in p.parts
                ],
            }

        return {
            "world_size": self.world_size,
            "params": [
                {
                    "name": s.name,
                    "shape": list(s.shape),
                    "dtype": dtype_name(s.dtype),
                    "placement": placement_dict(s.placement),
                    "source": s.source,
                    "fp8": s.fp8,
                }
                for s in self.params.values()
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Layout":
        def placement_of(d: dict) -> Placement:
            if d["kind"] == "replicate":
                return Replicate()
            if d["kind"] == "shard":
                return Shard(dim=d["dim"], padded_size=d["padded_size"])
            if d["kind"] == "fused":
                return Fused(
                    tuple(
                        FusedPart(q["source"], tuple(q["source_shape"]), tuple(tuple(r) for r in q["row_ranges"]))
                        for q in d["parts"]
                    )
                )
            raise ValueError(f"unknown placement kind {d['kind']!r}")

        return cls(
            data["world_size"],
            [
                ParamSpec(p["name"], tuple(p["shape"]), dtype_from_name(p["dtype"]), placement_of(p["placement"]), p["source"],
                          p.get("fp8"))
                for p in data["params"]
            ],
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Layout":
        return cls.from_dict(json.loads(text))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"Layout(world_size={self.world_size}, params={len(self.params)})"
