"""FP8 destinations of a weight sync, quantized by the senders.

A generator parameter marked `fp8=<granularity>` in its layout is held as a
float8_e4m3fn weight plus a float32 scale (vLLM's names: `weight_scale_inv` per
128 x 128 block, `weight_scale` per tensor and per channel). The generator holds
those and nothing else: no landing rows in a wider dtype. The senders quantize:
1. each sender takes the amax of every scale group over the rows it sends
   (`Fp8Sources.local_amax`, one float32 vector over every group of the sync);
2. the groups several senders hold part of (`Fp8Plan.shared`, known when the
   plan is made) are reduced with MAX across the senders, together with a flag
   that says whether any sender holds NaN or inf (then no sender writes anything);
3. each sender casts the rectangles it sends into an FP8 buffer of its own
   (`packed`: each rectangle dense, one byte per element it sends to FP8
   destinations, kept for the sender's life: a rectangle two destination ranks
   read, as replicated KV heads, is cast once for each, with that rank's scales)
   and the scales of its groups into `scales`;
4. the plan's segments copy FP8 bytes from `packed` into the generator's FP8
   weights (one byte an element on the wire, half of bf16's), and each scale from
   `scales` of one sender that holds part of its group (the lowest rank writing
   that group to that destination rank).

Scale groups follow vLLM's tensor-parallel layout, in the destination's coordinates:
- per tensor: one scale for the whole logical tensor; for a fused parameter
  (qkv, gate_up) one scale per part, each from that part's amax over all ranks.
- per channel: one scale per output row; a parameter split on dim 1 (o_proj,
  down_proj) takes each row's amax over all ranks (its whole logical row).
- per block: the 128 x 128 blocks of the destination rank's local tensor.

What is quantized is the senders' own values: fp32 master weights go to FP8 in one
rounding (ops.fp8: sat(RNE(w / scale)), scale = amax / 448).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ops.fp8 import DEFAULT_BLOCK, FP8_DTYPE, cast_to_fp8, fp8_amax, scale_from_amax, scale_shape
from ..ops.fp8_launch import TILE_BLOCK, Fp8Tiles, triton_takes
from ..ops.fp8_format import fp8_scale_name
from .layout import Explicit, Fragment, Fused, Layout, ParamSpec, Replicate, Shard, view_2d

_BLOCK = DEFAULT_BLOCK[0]  # square blocks: DEFAULT_BLOCK is (128, 128)


def _shared_across_ranks(layout: Layout, name: str) -> bool:
    """Whether every destination rank holds the same scale groups of `name` (each
    group spanning ranks): per tensor, and per channel for a split on dim 1."""
    spec = layout.params[name]
    if layout.world_size == 1 or isinstance(spec.placement, Replicate):
        return False
    if spec.fp8 == "tensor":
        return True
    return spec.fp8 == "channel" and isinstance(spec.placement, Shard) and spec.placement.dim == 1


def _part_starts(layout: Layout, name: str, rank: int) -> list[int]:
    """Local first rows of each part of a fused parameter on `rank`, and the end."""
    starts = [0]
    for part in layout.params[name].placement.parts:
        lo, hi = part.row_ranges[rank]
        starts.append(starts[-1] + hi - lo)
    return starts


def fp8_scale_local_shape(layout: Layout, name: str, rank: int) -> tuple[int, ...]:
    """Shape of an FP8 parameter's scale on `rank`."""
    spec = layout.params[name]
    local = view_2d(layout.local_shape(name, rank))
    if spec.fp8 == "tensor" and isinstance(spec.placement, Fused):
        return (len(spec.placement.parts),)
    return scale_shape(local, spec.fp8, DEFAULT_BLOCK)


def held_layout(layout: Layout) -> Layout:
    """`layout` as its ranks hold it: each FP8 weight and its scale a parameter
    (float8_e4m3fn, float32) whose every rank's local tensor is a logical tensor
    of its own (`<name>@<rank>`): FP8 bytes are worth only their own rank's scales
    (rows two ranks hold, as replicated KV heads, differ in FP8 where their blocks
    do), so no rank's may land on another. Between two replicas of `layout` (a
    relay) a plan of this layout copies each rank's FP8 bytes and scales into the
    same rank as they are, its padding rows left alone: nothing is quantized
    again, and a replica holds byte for byte what the one it is filled from holds."""
    params = []
    for name, spec in layout.params.items():
        if spec.fp8 is None:
            params.append(spec)
            continue
        world = range(layout.world_size)
        params.append(_own_per_rank(name, FP8_DTYPE, [layout.local_shape(name, r) for r in world],
                                    [layout.padding_rows(name, r) for r in world]))
        params.append(_own_per_rank(fp8_scale_name(name, spec.fp8), torch.float32,
                                    [fp8_scale_local_shape(layout, name, r) for r in world]))
    return Layout(layout.world_size, params)


def _own_per_rank(name: str, dtype: torch.dtype, shapes: list[tuple[int, ...]],
                  padding: list[tuple[int, int]] | None = None) -> ParamSpec:
    """A parameter whose rank r holds the logical tensor `<name>@<r>` of shape
    shapes[r], all of it but padding[r] (local rows [start, stop) at its end)."""
    sources, fragments = [], []
    for rank, shape in enumerate(shapes):
        rows, cols = view_2d(shape)
        start, stop = padding[rank] if padding else (rows, rows)
        written = start if stop > start else rows
        sources.append((f"{name}@{rank}", tuple(shape)))
        fragments.append((Fragment(f"{name}@{rank}", 0, 0, written, cols, 0, 0),) if written and cols else ())
    pads = tuple(tuple(p) for p in padding) if padding and any(stop > start for start, stop in padding) else None
    return ParamSpec(name, tuple(shapes[0]), dtype, Explicit(tuple(sources), tuple(map(tuple, shapes)),
                                                             tuple(fragments), pads))


def _grid(layout: Layout, name: str, rank: int) -> tuple[int, int]:
    """The scale groups of `name` on `rank` as a 2-D grid, in the scale's element order."""
    shape = fp8_scale_local_shape(layout, name, rank)
    return (shape[0], shape[1] if len(shape) == 2 else 1) if shape else (1, 1)


def _pieces(start: int, length: int) -> list[tuple[int, int]]:
    """[start, start + length) cut at multiples of the block: (offset, length)
    pieces (three at most), each inside one block or starting on a block's edge."""
    head = min(length, -start % _BLOCK)
    body = (length - head) // _BLOCK * _BLOCK
    tail = length - head - body
    return [(o, n) for o, n in ((0, head), (head, body), (head + body, tail)) if n]


@dataclass(frozen=True)
class Fp8Rect:
    """`rows` x `cols` elements of an FP8 destination: from source rank `src_rank`'s
    local tensor `src_name` at (src_row, src_col) to destination rank `dst_rank`'s
    local `dst_name` at (dst_row, dst_col), both as 2-D views; cast to element
    `offset` of the sender's FP8 buffer (rows of `cols` elements)."""

    src_rank: int
    src_name: str
    src_row: int
    src_col: int
    dst_rank: int
    dst_name: str
    dst_row: int
    dst_col: int
    rows: int
    cols: int
    offset: int

    def source(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rectangle of a source-rank tensor."""
        return tensor.view(view_2d(tuple(tensor.shape)))[self.src_row : self.src_row + self.rows,
                                                          self.src_col : self.src_col + self.cols]

    def packed(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rectangle's place in the sender's FP8 buffer."""
        return buffer[self.offset : self.offset + self.rows * self.cols].view(self.rows, self.cols)


@dataclass(frozen=True)
class ScaleWrite:
    """`count` scales (float32) from sender `src_rank`'s `scales` at element
    `cell` to destination rank `dst_rank`'s tensor `dst_name` at element `index`."""

    src_rank: int
    cell: int
    dst_rank: int
    dst_name: str
    index: int
    count: int


class Fp8Plan:
    """The scale groups of every FP8 destination of a plan, numbered in one vector
    of `num_cells` (a destination rank's groups of a parameter in its scale's
    element order; groups every rank shares counted once), and for every
    rectangle the box of groups it touches. `shared`: the groups more than one
    sender touches (int64 indices), which senders reduce; `touched_shared[s]`:
    those sender s touches (sorted); `scale_writes`: who writes each destination
    scale. Everything every rank computes alike."""

    def __init__(self, layout: Layout, rects: list[Fp8Rect], src_world: int):
        self.layout, self.rects = layout, rects
        self.spaces: dict[tuple[str, int | None], tuple[int, tuple[int, int]]] = {}  # (name, rank) -> (offset, grid)
        offset = 0
        for name, spec in layout.params.items():
            if spec.fp8 is None:
                continue
            shared = _shared_across_ranks(layout, name)
            for rank in [None] if shared else range(layout.world_size):
                grid = _grid(layout, name, 0 if rank is None else rank)
                self.spaces[(name, rank)] = (offset, grid)
                offset += grid[0] * grid[1]
        self.num_cells = offset
        self.boxes = [self._box(rect) for rect in rects]
        first = np.full(self.num_cells, -1, dtype=np.int64)  # the first sender touching each group
        shared = np.zeros(self.num_cells, dtype=bool)
        for rect, box in zip(rects, self.boxes):
            first_box, shared_box = (self.cells(v, box) for v in (first, shared))
            shared_box |= (first_box != -1) & (first_box != rect.src_rank)
            first_box[first_box == -1] = rect.src_rank
        self.shared = np.flatnonzero(shared)
        numbers = np.arange(self.num_cells, dtype=np.int64)
        touched: list[list[np.ndarray]] = [[] for _ in range(src_world)]
        for rect, box in zip(rects, self.boxes):
            cells = self.cells(numbers, box).reshape(-1)
            touched[rect.src_rank].append(cells[shared[cells]])
        self.touched_shared = [np.unique(np.concatenate(t)) if t else np.zeros(0, dtype=np.int64) for t in touched]
        self.scale_writes = self._scale_writes(src_world)

    def space(self, name: str, rank: int) -> tuple[int, tuple[int, int]]:
        """(offset, grid) of `name`'s groups on destination rank `rank`."""
        return self.spaces.get((name, None)) or self.spaces[(name, rank)]

    def _box(self, rect: Fp8Rect) -> tuple[int, int, int, int, int, int, int]:
        """(offset, grid rows, grid cols, row0, row1, col0, col1): the groups `rect` touches."""
        spec = self.layout.params[rect.dst_name]
        offset, (gr, gc) = self.space(rect.dst_name, rect.dst_rank)
        if spec.fp8 == "tensor":
            part = 0
            if isinstance(spec.placement, Fused):
                starts = _part_starts(self.layout, rect.dst_name, rect.dst_rank)
                part = next(i for i in range(len(starts) - 1) if starts[i] <= rect.dst_row < starts[i + 1])
            return offset, gr, gc, part, part + 1, 0, 1
        if spec.fp8 == "channel":
            return offset, gr, gc, rect.dst_row, rect.dst_row + rect.rows, 0, 1
        return (offset, gr, gc, rect.dst_row // _BLOCK, (rect.dst_row + rect.rows - 1) // _BLOCK + 1,
                rect.dst_col // _BLOCK, (rect.dst_col + rect.cols - 1) // _BLOCK + 1)

    @staticmethod
    def cells(vector, box):
        """The view of a vector over the groups (numpy or torch) that `box` covers, as a 2-D grid."""
        offset, gr, gc, r0, r1, c0, c1 = box
        return vector[offset : offset + gr * gc].reshape(gr, gc)[r0:r1, c0:c1]

    def _scale_writes(self, src_world: int) -> list[ScaleWrite]:
        """Each destination rank's scales, whole: each from the lowest sender rank that
        writes part of its group to that rank (for a group spanning ranks that has
        none of its elements on this rank, an empty shard: the lowest that writes part
        of it anywhere), in runs of consecutive scales from one sender. A group no
        rectangle touches at all (rows a sync never writes: padding, an empty part)
        gets 1.0, the scale of an amax of 0, from the lowest sender writing anything
        to that rank: a destination's scales are all written, so a replica is filled
        from another by copying them whole (held_layout)."""
        def lowest(rects, cells: int) -> np.ndarray:
            writer = np.full(cells, src_world, dtype=np.int64)
            for rect, box in rects:
                view = self.cells(writer, (0, *box[1:]))
                np.minimum(view, rect.src_rank, out=view)
            return writer

        writes = []
        by_name: dict[str, list] = {}
        for rect, box in zip(self.rects, self.boxes):
            by_name.setdefault(rect.dst_name, []).append((rect, box))
        # Destination rank -> the lowest sender of any of its FP8 rectangles (0 for none).
        fallback = [min((rect.src_rank for rect in self.rects if rect.dst_rank == rank), default=0)
                    for rank in range(self.layout.world_size)]
        for name, spec in self.layout.params.items():
            if spec.fp8 is None:
                continue
            mine = by_name.get(name, [])
            shared = self.spaces.get((name, None))
            anywhere = None if shared is None else lowest(mine, shared[1][0] * shared[1][1])
            for rank in range(self.layout.world_size):
                offset, (gr, gc) = self.space(name, rank)
                if gr * gc == 0:  # an empty local tensor: no scales
                    continue
                writer = lowest([(rect, box) for rect, box in mine if rect.dst_rank == rank], gr * gc)
                if anywhere is not None:
                    writer = np.where(writer < src_world, writer, anywhere)
                # Untouched: this sender's amax there is 0 (local_amax), its scale 1.0.
                writer[writer == src_world] = fallback[rank]
                cuts = np.flatnonzero(np.diff(writer)) + 1
                for start, stop in zip(np.r_[0, cuts], np.r_[cuts, gr * gc]):
                    writes.append(ScaleWrite(int(writer[start]), offset + int(start), rank,
                                             fp8_scale_name(name, spec.fp8), int(start), int(stop - start)))
        return writes


class Fp8Sources:
    """One sender rank's part of the FP8 destinations (see the module doc):
    `packed` (float8_e4m3fn, its rectangles one after the other: what FP8
    segments read) and `scales` (float32 over every group: what scale segments
    read), both on `device` and kept for the sender's life, so copy tables built
    once stay valid. `shared`: Fp8Plan.shared on the device.

    On a GPU (and on CPU under TRITON_INTERPRET=1, up to ops.fp8_launch's
    interpreter limit) each pass is one launch of the grouped kernels for all the rank's
    rectangles (kernels/fp8_sync.py; `bind` builds their tiles from the tensors'
    addresses); otherwise ops.fp8's torch path, a rectangle at a time."""

    def __init__(self, plan: Fp8Plan, rank: int, device: torch.device):
        self.plan, self.rank = plan, rank
        self.work = [(rect, box) for rect, box in zip(plan.rects, plan.boxes) if rect.src_rank == rank]
        self.packed = torch.zeros(sum(rect.rows * rect.cols for rect, _ in self.work), dtype=FP8_DTYPE, device=device)
        self.scales = torch.ones(plan.num_cells, dtype=torch.float32, device=device)
        self.shared = torch.from_numpy(plan.shared).to(device)
        self.device = device
        self.tiles: list[Fp8Tiles] | None = None

    def bind(self, tensors) -> None:
        """Build the grouped kernels' tiles from the tensors' addresses (again
        whenever a tensor's storage moved); no-op on the torch path."""
        if not triton_takes(self.device, self.packed.numel()):
            self.tiles = None
            return
        rows: dict[torch.dtype, list] = {}
        for rect, box in self.work:
            rows.setdefault(tensors[rect.src_name].dtype, []).extend(self._tile_rows(rect, box, tensors[rect.src_name]))
        self.tiles = [Fp8Tiles(next(t for t in tensors.values() if t.dtype == dtype and t.numel()),
                               np.concatenate(dtype_rows), self.device) for dtype, dtype_rows in rows.items()]

    def _tile_rows(self, rect: Fp8Rect, box, tensor: torch.Tensor) -> list[np.ndarray]:
        """kernels/fp8_sync.py's table rows of one rectangle (column 0: byte address)."""
        granularity = self.plan.layout.params[rect.dst_name].fp8
        offset, _, gc = box[:3]
        pitch, item = view_2d(tuple(tensor.shape))[1], tensor.element_size()
        tile_n, tile_k = TILE_BLOCK
        out = []
        for ro, rn, co, cn in self._pieces(rect, granularity):
            # Tiles of a piece start on its corner, TILE_BLOCK apart: inside one block each.
            r, c = (a.reshape(-1) for a in np.meshgrid(np.arange(ro, ro + rn, tile_n, dtype=np.int64),
                                                      np.arange(co, co + cn, tile_k, dtype=np.int64), indexing="ij"))
            if granularity == "block":  # the tile's block: one group
                cell, step = offset + (rect.dst_row + r) // _BLOCK * gc + (rect.dst_col + c) // _BLOCK, 0
            elif granularity == "channel":  # the group of the tile's first row, then one a row
                cell, step = offset + rect.dst_row + r, 1
            else:  # the tensor's (the fused part's) group
                cell, step = np.full_like(r, offset + box[3] * gc), 0
            out.append(np.stack([tensor.data_ptr() + ((rect.src_row + r) * pitch + rect.src_col + c) * item,
                                 np.full_like(r, pitch), rect.offset + r * rect.cols + c, np.full_like(r, rect.cols),
                                 np.minimum(tile_n, ro + rn - r), np.minimum(tile_k, co + cn - c),
                                 cell, np.full_like(r, step)], axis=1))
        return out

    @staticmethod
    def _pieces(rect: Fp8Rect, granularity: str) -> list[tuple[int, int, int, int]]:
        """(row offset, rows, column offset, columns) of `rect` whose groups start at
        the piece's own corner: cut at the destination's block edges for blocks."""
        if granularity == "block":
            return [(ro, rn, co, cn) for ro, rn in _pieces(rect.dst_row, rect.rows)
                    for co, cn in _pieces(rect.dst_col, rect.cols)]
        return [(0, rect.rows, 0, rect.cols)]

    def local_amax(self, tensors) -> torch.Tensor:
        """max |w| of every group over the rectangles this rank sends (0 for groups it
        does not touch); a group holding NaN or inf gets inf. No host sync."""
        amax = torch.zeros(self.plan.num_cells, dtype=torch.float32, device=self.device)
        if self.tiles is not None:
            for tiles in self.tiles:
                tiles.amax_launch(amax.view(torch.int32)).launch(self.device)
            return amax
        for rect, box in self.work:
            self._each_piece(rect, box, tensors[rect.src_name], amax, None)
        return amax

    def nonfinite(self, amax: torch.Tensor, tensors) -> str | None:
        """None if every amax is finite (one host sync); else a line naming the first
        source tensor whose rows this rank sends hold NaN or inf."""
        if bool(torch.isfinite(amax).all()):
            return None
        rect = next(rect for rect, _ in self.work if not bool(torch.isfinite(rect.source(tensors[rect.src_name])).all()))
        return (f"source {rect.src_name!r} (for FP8 destination {rect.dst_name!r} on rank {rect.dst_rank}) "
                "contains NaN or inf; refusing to quantize it to FP8")

    def quantize(self, tensors, amax: torch.Tensor) -> None:
        """Scales from the (reduced) amaxes, and this rank's rectangles cast into
        `packed`; on the current stream, no host sync."""
        self.scales.copy_(scale_from_amax(amax))
        if self.tiles is not None:
            for tiles in self.tiles:
                tiles.cast_launch(self.scales, self.packed.view(torch.uint8)).launch(self.device)
            return
        for rect, box in self.work:
            self._each_piece(rect, box, tensors[rect.src_name], self.scales, self.packed)

    def _each_piece(self, rect: Fp8Rect, box, tensor: torch.Tensor, vector: torch.Tensor,
                    out: torch.Tensor | None) -> None:
        """The torch path, over the pieces of `rect`: with `out` None, MAX their
        amaxes into `vector`; else cast them into `out` (the FP8 buffer) with the
        scales in `vector`."""
        granularity = self.plan.layout.params[rect.dst_name].fp8
        src, cells = rect.source(tensor), Fp8Plan.cells(vector, box)
        dst = None if out is None else rect.packed(out)
        for ro, rn, co, cn in self._pieces(rect, granularity):
            part = src[ro : ro + rn, co : co + cn]
            if granularity == "block":
                r0, c0 = (rect.dst_row + ro) // _BLOCK - box[3], (rect.dst_col + co) // _BLOCK - box[5]
                group = cells[r0 : r0 + -(-rn // _BLOCK), c0 : c0 + -(-cn // _BLOCK)]
            else:
                group = cells if granularity == "channel" else cells.reshape(())
            if out is None:
                amax = fp8_amax(part, granularity, DEFAULT_BLOCK, check=False, backend="torch")
                group.copy_(torch.maximum(group, amax.reshape(group.shape)))
            else:
                cast_to_fp8(part, group, granularity, DEFAULT_BLOCK, dst[ro : ro + rn, co : co + cn], backend="torch")
