"""Layouts: how one side (trainer or generator) holds each parameter on its ranks.

A layout lists parameters (name, global shape, dtype, placement). A placement says
which part of which *logical* tensor each rank holds. Logical tensors are the
unsharded, unfused tensors both sides agree on (the trainer model's own names:
Hugging Face names for a transformers model).

Every placement compiles to *fragments*: per rank, rectangles of a logical
tensor's 2-D view and where they sit in the 2-D view of the rank's local tensor.
The planner only ever sees fragments, so new placements need no planner change.

2-D views: a scalar is (1, 1), a 1-D tensor of n elements (n, 1), an N-D tensor
(prod(shape[:-1]), shape[-1]): its last dim the columns. A box of an N-D tensor
(a split on any dim, one expert of a stacked parameter, a range inside a fused
dim) is then a few rectangles: `strided_fragments` cuts any strided view into them.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import Iterable, Union

import torch

from ..ops.fp8_format import fp8_scale_name
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


def check_int(value, name: str, minimum: int, optional: bool = False) -> None:
    """Refuse, with ValueError naming `name`, anything but a Python int of at least
    `minimum` (a bool, a float, NaN, a string, a numpy integer); None passes where
    `optional`. Before anything is published: a float rank published its Store keys
    under "0.0" and both sides waited out their timeouts; a NaN bucket size cut
    the plan into one-element pieces."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{' or None' if optional else ''}, got {value!r}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_exchanged_dtypes(layout: Layout, what: str) -> None:
    """ValueError naming the first parameter of `layout` whose dtype the layouts two
    processes exchange cannot carry (bool, int16, complex, ...: the local
    TransferPlan.execute_local copies them; a sync refused them only after both
    sides had published, naming no parameter)."""
    for spec in layout.params.values():
        if dtype_name(spec.dtype) not in _DTYPES:
            raise ValueError(f"{what}: parameter {spec.name!r} is {spec.dtype}, which a sync between processes does "
                             f"not carry (one of {', '.join(sorted(_DTYPES))})")


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def view_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of the 2-D view of a tensor of this shape (module docstring)."""
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (shape[0], 1)
    return (math.prod(shape[:-1]), shape[-1])


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


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


# Past this many fragments for one copy, a view is refused rather than listed
# element by element (a transposed copy, say).
MAX_FRAGMENTS_PER_VIEW = 1 << 16


def strided_fragments(source: str, src_shape: tuple[int, ...], src_offset: int, src_strides: tuple[int, ...],
                      dst_shape: tuple[int, ...], dst_offset: int, dst_strides: tuple[int, ...],
                      extent: tuple[int, ...]) -> list[Fragment]:
    """The fragments of one element-wise copy, `extent`-shaped, from a strided view
    of the contiguous logical tensor `source` (shape `src_shape`; the view's first
    element at flat index `src_offset`, `src_strides` in elements) into a strided
    view of a contiguous local tensor of shape `dst_shape`: rectangles of the two
    2-D views, a run of columns cut where it crosses a row on either side.
    ValueError past MAX_FRAGMENTS_PER_VIEW rectangles (a transposed weight)."""
    if len(extent) != len(src_strides) or len(extent) != len(dst_strides):
        raise ValueError(f"{source!r}: a copy of extent {extent} with strides {src_strides} -> {dst_strides}")
    if math.prod(extent) == 0:
        return []
    src_cols, dst_cols = view_2d(src_shape)[1], view_2d(dst_shape)[1]
    # (size, src stride, dst stride), size-1 dims dropped, dims contiguous on both sides merged
    dims: list[tuple[int, int, int]] = []
    for size, s, d in zip(extent, src_strides, dst_strides):
        if size == 1:
            continue
        if dims and dims[-1][1] == size * s and dims[-1][2] == size * d:
            dims[-1] = (dims[-1][0] * size, s, d)
        else:
            dims.append((size, s, d))
    width = dims.pop()[0] if dims and dims[-1][1] == dims[-1][2] == 1 else 1

    def whole_rows(offset: int, strides: list[int], cols: int) -> bool:
        return offset % cols == 0 and all(stride % cols == 0 for stride in strides)

    if width > src_cols and src_cols == dst_cols and width % src_cols == 0 and \
            whole_rows(src_offset, [s for _, s, _ in dims], src_cols) and \
            whole_rows(dst_offset, [d for _, _, d in dims], dst_cols):  # a run of whole rows on both sides
        dims.append((width // src_cols, src_cols, dst_cols))
        width = src_cols

    def in_one_row(offset: int, strides: list[int], cols: int) -> bool:
        return offset % cols + width <= cols and all(stride % cols == 0 for stride in strides)

    height = 1
    if dims and dims[-1][1] == src_cols and dims[-1][2] == dst_cols and \
            in_one_row(src_offset, [s for _, s, _ in dims], src_cols) and \
            in_one_row(dst_offset, [d for _, _, d in dims], dst_cols):
        height = dims.pop()[0]
    fragments: list[Fragment] = []
    for index in itertools.product(*(range(size) for size, _, _ in dims)):
        src = src_offset + sum(i * s for i, (_, s, _) in zip(index, dims))
        dst = dst_offset + sum(i * d for i, (_, _, d) in zip(index, dims))
        done = 0
        while done < width:  # one piece per row the run touches on either side
            (src_row, src_col), (dst_row, dst_col) = divmod(src + done, src_cols), divmod(dst + done, dst_cols)
            size = min(width - done, src_cols - src_col, dst_cols - dst_col)
            fragments.append(Fragment(source, src_row, src_col, height, size, dst_row, dst_col))
            done += size
        if len(fragments) > MAX_FRAGMENTS_PER_VIEW:
            raise ValueError(f"{source!r}: a copy of extent {extent} with strides {src_strides} -> {dst_strides} "
                             f"takes more than {MAX_FRAGMENTS_PER_VIEW} rectangles (a transpose?)")
    return fragments


def box_fragments(source: str, shape: tuple[int, ...], offset: tuple[int, ...], extent: tuple[int, ...],
                  local_shape: tuple[int, ...], local_offset: tuple[int, ...] | None = None) -> list[Fragment]:
    """The fragments of the box `offset` + `extent` of logical tensor `source`
    (`shape`) held at `local_offset` (default: the origin) of a local tensor."""
    local_offset = local_offset or (0,) * len(local_shape)
    src_strides, dst_strides = contiguous_strides(shape), contiguous_strides(local_shape)
    return strided_fragments(source, shape, sum(o * s for o, s in zip(offset, src_strides)), src_strides,
                             local_shape, sum(o * s for o, s in zip(local_offset, dst_strides)), dst_strides, extent)


# ----------------------------------------------------------------------------- placements


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""


@dataclass(frozen=True)
class Shard:
    """Split as `torch.chunk(t, world_size, dim)` splits it, on any dim: pieces of
    ceil(size / world_size), the last ranks smaller or empty (FSDP2's `Shard(0)`
    local tensors, a DTensor's `Shard(dim)` on a 1-D mesh; an even split is the
    tensor-parallel case).

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


@dataclass(frozen=True)
class Explicit:
    """Each rank's local shape and fragments, listed: what a live model was seen to
    hold (a DTensor on a 2-D mesh, a vLLM engine's loaders). `sources`: the logical
    tensors the fragments read, (name, global shape). `padding[rank]`: local rows
    [start, stop) no sync writes (vLLM's vocabulary padding), or None."""

    sources: tuple[tuple[str, tuple[int, ...]], ...]
    local_shapes: tuple[tuple[int, ...], ...]
    fragments: tuple[tuple[Fragment, ...], ...]
    padding: tuple[tuple[int, int], ...] | None = None


Placement = Union[Replicate, Shard, Fused, Explicit]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a layout.

    shape: the global (unsharded) shape; for `Fused`, the parts stacked on dim 0;
    for `Explicit`, rank 0's local shape (the placement lists every rank's).
    dtype: the dtype the sync lands in (for an FP8 parameter: the generator's
    unquantized dtype, kept for its record; the senders quantize their own values).
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
        if isinstance(self.placement, Explicit):
            return {source: tuple(shape) for source, shape in self.placement.sources}
        return {self.source_name: tuple(self.shape)}


# ----------------------------------------------------------------------------- layout


class Layout:
    """Parameters of one side over `world_size` ranks, validated on construction."""

    def __init__(self, world_size: int, params: Iterable[ParamSpec]):
        check_int(world_size, "world_size", 1)
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
                raise ValueError(f"parameter {name!r}: FP8 needs a 2-D weight of a bf16, fp16 or fp32 model")
        placement = spec.placement
        if isinstance(placement, Replicate):
            return
        if isinstance(placement, Shard):
            if not 0 <= placement.dim < len(spec.shape):
                raise ValueError(f"parameter {name!r}: cannot split dim {placement.dim} of shape {spec.shape}")
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
        if isinstance(placement, Explicit):
            self._validate_explicit(spec)
            return
        raise ValueError(f"parameter {name!r}: unknown placement {placement!r}")

    def _validate_explicit(self, spec: ParamSpec) -> None:
        name, placement = spec.name, spec.placement
        if spec.fp8 is not None:
            raise ValueError(f"parameter {name!r}: an FP8 destination needs a Shard, Fused or Replicate placement")
        per_rank = [placement.local_shapes, placement.fragments] + ([placement.padding] if placement.padding else [])
        if any(len(listed) != self.world_size for listed in per_rank):
            raise ValueError(f"parameter {name!r}: an explicit placement lists {len(placement.local_shapes)} local "
                             f"shapes, {len(placement.fragments)} fragment lists for world size {self.world_size}")
        if tuple(placement.local_shapes[0]) != tuple(spec.shape):
            raise ValueError(f"parameter {name!r}: shape {spec.shape} is not rank 0's local shape "
                             f"{placement.local_shapes[0]}")
        sources = dict(placement.sources)
        for rank, (local_shape, fragments) in enumerate(zip(placement.local_shapes, placement.fragments)):
            rows, cols = view_2d(tuple(local_shape))
            for f in fragments:
                if f.source not in sources:
                    raise ValueError(f"parameter {name!r} rank {rank}: fragment of {f.source!r}, not a listed source")
                src_rows, src_cols = view_2d(tuple(sources[f.source]))
                if min(f.src_row, f.src_col, f.local_row, f.local_col, f.num_rows, f.num_cols) < 0 or \
                        f.src_row + f.num_rows > src_rows or f.src_col + f.num_cols > src_cols or \
                        f.local_row + f.num_rows > rows or f.local_col + f.num_cols > cols:
                    raise ValueError(f"parameter {name!r} rank {rank}: fragment {f} lies outside {f.source!r} "
                                     f"{sources[f.source]} or the local shape {tuple(local_shape)}")

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
        if isinstance(placement, Explicit):
            return tuple(placement.local_shapes[rank])
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
            dim, shape = placement.dim, tuple(spec.shape)
            size = placement.padded_size if placement.padded_size is not None else shape[dim]
            start, stop = chunk_bounds(size, self.world_size, rank)
            stop = min(stop, shape[dim])  # padding rows hold nothing
            if stop <= start:
                return []
            offset = tuple(start if d == dim else 0 for d in range(len(shape)))
            extent = tuple(stop - start if d == dim else n for d, n in enumerate(shape))
            return box_fragments(source, shape, offset, extent, self.local_shape(name, rank))
        if isinstance(placement, Explicit):
            return list(placement.fragments[rank])
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
        if isinstance(placement, Explicit) and placement.padding is not None:
            return tuple(placement.padding[rank])
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
            if isinstance(p, Explicit):
                index = {source: i for i, (source, _) in enumerate(p.sources)}
                return {
                    "kind": "explicit",
                    "sources": [[source, list(shape)] for source, shape in p.sources],
                    "local_shapes": [list(shape) for shape in p.local_shapes],
                    "fragments": [[[index[f.source], f.src_row, f.src_col, f.num_rows, f.num_cols, f.local_row,
                                    f.local_col] for f in fragments] for fragments in p.fragments],
                    "padding": [list(r) for r in p.padding] if p.padding is not None else None,
                }
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
            if d["kind"] == "explicit":
                sources = tuple((source, tuple(shape)) for source, shape in d["sources"])
                return Explicit(
                    sources,
                    tuple(tuple(shape) for shape in d["local_shapes"]),
                    tuple(tuple(Fragment(sources[f[0]][0], *f[1:]) for f in fragments) for fragments in d["fragments"]),
                    tuple(tuple(r) for r in d["padding"]) if d["padding"] is not None else None,
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
