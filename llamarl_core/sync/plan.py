"""The planner: intersect a source and a destination layout into copy segments.

`plan_transfer(src_layout, dst_layout)` validates everything (names, shapes,
dtypes, coverage: every destination element written exactly once, padding
excepted) and only then returns a `TransferPlan`. Nothing is copied by planning;
a plan is made once and executed every step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Mapping

import torch

from ..ops.fp8 import INPUT_DTYPES
from .engine import check_distinct_memory, check_local_tensors, run_segment_table, segment_table, tensors_device
from .fp8 import Fp8Plan, Fp8Rect, Fp8Sources, ScaleWrite, held_layout
from .layout import Fragment, Layout, check_int, view_2d

# Casts a segment may do on the way; any other dtype pair is refused.
SUPPORTED_CASTS = {(torch.float32, torch.bfloat16)}


def castable(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a sync writes `src` values into a `dst` destination (the same
    dtype, or a SUPPORTED_CASTS pair)."""
    return src == dst or (src, dst) in SUPPORTED_CASTS


# Where a segment reads on its sender (Segment.source): the sender's own tensor; its
# FP8 buffer (an FP8 destination, see fp8.py); its FP8 scales vector.
SOURCE_TENSOR, SOURCE_FP8, SOURCE_SCALES = "tensor", "fp8", "scales"

# Default bucket: 256 MiB bounds the staging buffer of the point-to-point
# transport per rank pair (checkpoint-engine uses 8 GiB double buckets, slime
# 512 MiB); the shared-memory and CUDA IPC transports copy in place and only use
# buckets as units of work.
DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass(frozen=True)
class Segment:
    """A 2-D strided rectangle: `height` rows of `width` elements, from source rank's
    local tensor `src_name` at byte `src_offset` (rows `src_pitch` bytes apart) to
    destination rank's local tensor `dst_name` at `dst_offset` (`dst_pitch`).
    `itemsize` is the destination element size; `cast` marks float32 -> bfloat16.
    `source`: what the sender reads (SOURCE_TENSOR: its tensor `src_name`;
    SOURCE_FP8: its FP8 buffer, where this rectangle of `src_name` was cast,
    dense; SOURCE_SCALES: its FP8 scales vector, `src_name` empty)."""

    src_rank: int
    src_name: str
    src_offset: int
    src_pitch: int
    dst_rank: int
    dst_name: str
    dst_offset: int
    dst_pitch: int
    width: int
    height: int
    itemsize: int
    cast: bool
    source: str = SOURCE_TENSOR

    @property
    def src_itemsize(self) -> int:
        return 4 if self.cast else self.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes written to the destination."""
        return self.width * self.height * self.itemsize


def _split(seg: Segment, max_bytes: int) -> list[Segment]:
    """Cut a segment into pieces of at most `max_bytes`: blocks of rows, or runs of
    elements for a single row (at least one row / element per piece)."""
    if seg.nbytes <= max_bytes:
        return [seg]
    if seg.height > 1:
        rows = max(1, max_bytes // (seg.width * seg.itemsize))
        return [
            replace(seg, src_offset=seg.src_offset + r * seg.src_pitch, dst_offset=seg.dst_offset + r * seg.dst_pitch,
                    height=min(rows, seg.height - r))
            for r in range(0, seg.height, rows)
        ]
    elems = max(1, max_bytes // seg.itemsize)
    return [
        replace(seg, src_offset=seg.src_offset + e * seg.src_itemsize, dst_offset=seg.dst_offset + e * seg.itemsize,
                width=min(elems, seg.width - e))
        for e in range(0, seg.width, elems)
    ]


def _bucketed(segments: list[Segment], bucket_bytes: int) -> list[tuple[Segment, ...]]:
    """Segments, in order, grouped into buckets of at most `bucket_bytes` (a segment cut where it does not fit)."""
    buckets, current, size = [], [], 0
    for seg in segments:
        for piece in _split(seg, bucket_bytes):
            if current and size + piece.nbytes > bucket_bytes:
                buckets.append(tuple(current))
                current, size = [], 0
            current.append(piece)
            size += piece.nbytes
    if current:
        buckets.append(tuple(current))
    return buckets


def source_address(seg: Segment, tensors: Mapping[str, torch.Tensor], fp8: Fp8Sources | None) -> int:
    """Where `seg` reads on its sender, before `seg.src_offset`: one of `tensors`,
    or the sender's FP8 buffer or scales (`fp8`, its Fp8Sources)."""
    if seg.source == SOURCE_FP8:
        return fp8.packed.data_ptr()
    if seg.source == SOURCE_SCALES:
        return fp8.scales.data_ptr()
    return tensors[seg.src_name].data_ptr()


def bipartite_rounds(pairs) -> list[list[tuple[int, int]]]:
    """Order (sender, receiver) pairs into rounds in which no rank appears twice (a
    matching), in as few rounds as any schedule can: the most pairs one rank takes
    part in (Koenig's edge-colouring theorem; 8 senders x 8 receivers: 8 rounds,
    64 x 8: 64). Point-to-point transfers run round by round, so no rank waits for
    a peer busy with a third. Deterministic: every rank computes the same rounds.

    Each pair, in sorted order, takes the lowest round free at its sender, `a`;
    when `a` is taken at its receiver while `b` (the lowest free there) is free at
    the sender, the chain of pairs from the receiver alternating rounds a and b
    swaps the two, which frees `a` at the receiver and keeps every round a matching
    (the chain cannot reach the sender: it would close an odd cycle in a bipartite
    graph)."""
    pairs = sorted(set(pairs))
    at_src: dict[int, dict[int, int]] = defaultdict(dict)  # sender -> round -> receiver
    at_dst: dict[int, dict[int, int]] = defaultdict(dict)  # receiver -> round -> sender

    def lowest_free(taken: dict[int, int]) -> int:
        return next(r for r in range(len(taken) + 1) if r not in taken)

    for src, dst in pairs:
        a, b = lowest_free(at_src[src]), lowest_free(at_dst[dst])
        chain, receiver = [], dst  # (sender, receiver, round): a from receivers, b from senders
        while a in at_dst[receiver]:
            sender = at_dst[receiver][a]
            chain.append((sender, receiver, a))
            if b not in at_src[sender]:
                break
            receiver = at_src[sender][b]
            chain.append((sender, receiver, b))
        for sender, receiver, taken in chain:
            del at_src[sender][taken], at_dst[receiver][taken]
        for sender, receiver, taken in chain:
            swapped = b if taken == a else a
            at_src[sender][swapped], at_dst[receiver][swapped] = receiver, sender
        at_src[src][a], at_dst[dst][a] = dst, src
    num_rounds = 1 + max((r for taken in at_src.values() for r in taken), default=-1)
    return [sorted((s, d) for s, taken in at_src.items() for r, d in taken.items() if r == k) for k in range(num_rounds)]


def relay_tree(num_replicas: int) -> dict[int, list[int]]:
    """replica -> the replicas it relays each version to. The trainer ranks send to
    replica 0 only, so the bytes a trainer rank sends do not grow with the number
    of replicas; each version then spreads down a binary tree (replica r feeds 2r + 1
    and 2r + 2), rank d of a replica to rank d of the next: R replicas hold it
    after ceil(log2(R + 1)) - 1 relay hops, no replica sending more than twice."""
    return {r: [c for c in (2 * r + 1, 2 * r + 2) if c < num_replicas] for r in range(num_replicas)}


def check_replicas(num_replicas: int) -> None:
    check_int(num_replicas, "num_replicas", 1)


def check_replica(replica: int, num_replicas: int) -> None:
    """ValueError naming `replica` or `num_replicas` when the one is not a replica of the other."""
    check_replicas(num_replicas)
    check_int(replica, "replica", 0)
    if replica >= num_replicas:
        raise ValueError(f"replica must be in [0, {num_replicas}), got {replica}")


class TransferPlan:
    """Copy segments from a source layout to a destination layout, grouped per
    (source rank, destination rank) pair and bucketed. With `num_replicas` > 1
    the destination is that many data-parallel copies of `dst_layout`: the
    segments fill replica 0, and `relay` (a plan from `dst_layout` to itself, one
    run per tensor) copies each replica into its children in `relays`. `fp8`:
    the scale groups of its FP8 destinations (None without any), which the
    senders quantize (fp8.py). A relay of FP8 destinations copies what the replica
    holds (fp8.held_layout: the FP8 bytes and the scales, whole); its plan's
    layouts are that held layout."""

    def __init__(self, src_layout: Layout, dst_layout: Layout, segments: list[Segment], bucket_bytes: int,
                 num_replicas: int = 1, fp8: Fp8Plan | None = None):
        self.src_layout = src_layout
        self.fp8 = fp8
        self.dst_layout = dst_layout
        self.segments = tuple(segments)
        self.bucket_bytes = bucket_bytes
        self.num_replicas = num_replicas
        self.relays = relay_tree(num_replicas)
        self.relay = plan_transfer(dst_layout, dst_layout, bucket_bytes) if num_replicas > 1 else None
        pairs: dict[tuple[int, int], list[Segment]] = defaultdict(list)
        for seg in segments:
            pairs[(seg.src_rank, seg.dst_rank)].append(seg)
        self.buckets: dict[tuple[int, int], list[tuple[Segment, ...]]] = {
            pair: _bucketed(pairs[pair], bucket_bytes) for pair in sorted(pairs)}

    def cap_buckets(self, pair: tuple[int, int], bucket_bytes: int) -> None:
        """Cut the buckets of `pair` again, at most `bucket_bytes` each (no-op if they already are)."""
        if any(sum(seg.nbytes for seg in bucket) > bucket_bytes for bucket in self.buckets[pair]):
            self.buckets[pair] = _bucketed([seg for bucket in self.buckets[pair] for seg in bucket], bucket_bytes)

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return list(self.buckets)

    def senders_of(self, dst_rank: int) -> list[int]:
        return sorted({s for s, d in self.buckets if d == dst_rank})

    def receivers_of(self, src_rank: int) -> list[int]:
        return sorted({d for s, d in self.buckets if s == src_rank})

    def pair_segments(self, src_rank: int, dst_rank: int) -> list[Segment]:
        return [seg for bucket in self.buckets.get((src_rank, dst_rank), []) for seg in bucket]

    @property
    def nbytes(self) -> int:
        """Bytes written to the destination by one execution."""
        return sum(seg.nbytes for seg in self.segments)

    def summary(self) -> list[dict]:
        """One row per link that carries bytes: from trainer rank `src_rank` to rank
        `dst_rank` of replica 0 ("src_replica" None), then from rank d of each
        replica to rank d of the replicas it relays to; bytes written, segments and
        buckets of each."""
        links = [(None, s, 0, d, buckets) for (s, d), buckets in self.buckets.items()]
        for parent, children in self.relays.items():
            links += [(parent, s, child, d, buckets) for child in children for (s, d), buckets in self.relay.buckets.items()]
        return [
            {
                "src_replica": src_replica,
                "src_rank": s,
                "dst_replica": dst_replica,
                "dst_rank": d,
                "bytes": sum(seg.nbytes for b in buckets for seg in b),
                "segments": sum(len(b) for b in buckets),
                "buckets": len(buckets),
            }
            for src_replica, s, dst_replica, d, buckets in links
        ]

    def bytes_sent_by_src_rank(self) -> dict[int, int]:
        """Trainer rank -> bytes it sends per sync (the same whatever `num_replicas`)."""
        sent: dict[int, int] = defaultdict(int)
        for row in self.summary():
            if row["src_replica"] is None:
                sent[row["src_rank"]] += row["bytes"]
        return dict(sent)

    def execute_local(
        self,
        src_shards: Mapping[int, Mapping[str, torch.Tensor]],
        dst_shards: Mapping[int, Mapping[str, torch.Tensor]],
        num_threads: int | None = None,
    ) -> int:
        """Run the whole plan in this process (also offline checkpoint resharding).

        src_shards / dst_shards: rank -> local parameter name -> tensor, every rank
        of each layout (`layout.local_tensor_specs(rank)`: FP8 parameters are a
        float8_e4m3fn weight and a float32 scale), contiguous, all on one device.
        Everything is checked before the first byte moves (a NaN or inf bound for
        an FP8 destination included: ValueError naming it). Returns the bytes the
        plan wrote.
        """
        for rank in range(self.src_layout.world_size):
            check_local_tensors(self.src_layout, rank, src_shards.get(rank), "source")
        for rank in range(self.dst_layout.world_size):
            check_local_tensors(self.dst_layout, rank, dst_shards.get(rank), "destination")
        check_int(num_threads, "num_threads", 1, optional=True)
        sides = (("source", src_shards), ("destination", dst_shards))
        everything = {f"{side} rank {r}: {n}": t for side, shards in sides for r in shards for n, t in shards[r].items()}
        device = tensors_device(everything, "execute_local")
        # Destinations written twice, or written while read: sources may share memory with one another (tied weights).
        check_distinct_memory(everything, "execute_local", frozenset(k for k in everything if k.startswith("source")),
                              "give each destination memory of its own, apart from the sources")
        sources: dict[int, Fp8Sources] = {}
        if self.fp8 is not None:  # what each sender rank does, for every rank here (fp8.py)
            for r in range(self.src_layout.world_size):
                sources[r] = Fp8Sources(self.fp8, r, device)
                sources[r].bind(src_shards[r])
            amax = {r: s.local_amax(src_shards[r]) for r, s in sources.items()}
            for r, s in sources.items():
                problem = s.nonfinite(amax[r], src_shards[r])
                if problem is not None:
                    raise ValueError(f"source rank {r}: {problem}")
            shared = sources[0].shared
            reduced = torch.stack([a[shared] for a in amax.values()]).amax(dim=0)
            for r, s in sources.items():
                amax[r][shared] = reduced
                s.quantize(src_shards[r], amax[r])
        table = segment_table(
            self.segments,
            lambda seg: source_address(seg, src_shards[seg.src_rank], sources.get(seg.src_rank)),
            lambda seg: dst_shards[seg.dst_rank][seg.dst_name].data_ptr(),
        )
        return run_segment_table(table, device, num_threads)

    def __repr__(self) -> str:
        return (
            f"TransferPlan(src_world={self.src_layout.world_size}, dst_world={self.dst_layout.world_size}, "
            f"segments={len(self.segments)}, bytes={self.nbytes}, pairs={len(self.buckets)})"
        )


# ----------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _Holder:
    rank: int
    name: str
    fragment: Fragment


def _check_tiling(layout: Layout, name: str, rank: int) -> None:
    """Fragments plus padding must tile the local tensor exactly: inside its bounds,
    no overlap, no gap."""
    rows, cols = view_2d(layout.local_shape(name, rank))
    rects = [(f.local_row, f.local_row + f.num_rows, f.local_col, f.local_col + f.num_cols) for f in layout.fragments(name, rank)]
    pad = layout.padding_rows(name, rank)
    if pad[1] > pad[0]:
        rects.append((pad[0], pad[1], 0, cols))
    for r0, r1, c0, c1 in rects:
        if not (0 <= r0 <= r1 <= rows and 0 <= c0 <= c1 <= cols):
            raise ValueError(
                f"destination {name!r} rank {rank}: rows [{r0}, {r1}) cols [{c0}, {c1}) lie outside "
                f"its local shape ({rows}, {cols})"
            )
    for i, a in enumerate(rects):
        for b in rects[i + 1 :]:
            if a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]:
                raise ValueError(
                    f"destination {name!r} rank {rank}: overlapping writes to rows "
                    f"[{max(a[0], b[0])}, {min(a[1], b[1])}) cols [{max(a[2], b[2])}, {min(a[3], b[3])})"
                )
    covered = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in rects)
    if covered != rows * cols:
        raise ValueError(
            f"destination {name!r} rank {rank}: {rows * cols - covered} of {rows * cols} elements "
            f"would never be written"
        )


def _decompose(frag: Fragment, holders: list[_Holder], dst_rank: int, dst_name: str) -> list[tuple[_Holder, int, int, int, int]]:
    """Cover a destination fragment with disjoint rectangles, each read from one
    source holder: (holder, row0, row1, col0, col1) in logical coordinates.
    Replicated sources are spread over their holders by destination rank."""
    r0, r1 = frag.src_row, frag.src_row + frag.num_rows
    c0, c1 = frag.src_col, frag.src_col + frag.num_cols
    touching = []
    for h in holders:
        f = h.fragment
        if f.src_row < r1 and r0 < f.src_row + f.num_rows and f.src_col < c1 and c0 < f.src_col + f.num_cols:
            touching.append(h)
    row_cuts = sorted({r0, r1} | {min(max(b, r0), r1) for h in touching for b in (h.fragment.src_row, h.fragment.src_row + h.fragment.num_rows)})
    col_cuts = sorted({c0, c1} | {min(max(b, c0), c1) for h in touching for b in (h.fragment.src_col, h.fragment.src_col + h.fragment.num_cols)})
    bands: list[list[tuple[_Holder, int, int, int, int]]] = []
    for ra, rb in zip(row_cuts, row_cuts[1:]):
        band: list[tuple[_Holder, int, int, int, int]] = []
        for ca, cb in zip(col_cuts, col_cuts[1:]):
            candidates = [
                h for h in touching
                if h.fragment.src_row <= ra and rb <= h.fragment.src_row + h.fragment.num_rows
                and h.fragment.src_col <= ca and cb <= h.fragment.src_col + h.fragment.num_cols
            ]
            if not candidates:
                raise ValueError(
                    f"destination {dst_name!r} rank {dst_rank}: rows [{ra}, {rb}) cols [{ca}, {cb}) of "
                    f"{frag.source!r} are held by no source rank"
                )
            holder = candidates[dst_rank % len(candidates)]
            if band and band[-1][0] == holder and band[-1][4] == ca:
                band[-1] = (holder, ra, rb, band[-1][3], cb)
            else:
                band.append((holder, ra, rb, ca, cb))
        if bands and [(h, a, b) for h, _, _, a, b in bands[-1]] == [(h, a, b) for h, _, _, a, b in band]:
            bands[-1] = [(h, prev[1], rb, a, b) for prev, (h, _, _, a, b) in zip(bands[-1], band)]
        else:
            bands.append(band)
    return [rect for band in bands for rect in band]


def logical_dtypes(layout: Layout) -> dict[str, torch.dtype]:
    """Logical tensor -> the dtype its parameters hold it in; ValueError naming two
    parameters that hold one logical tensor in different dtypes (the copy reads
    either, and casts by one dtype)."""
    dtypes: dict[str, tuple[torch.dtype, str]] = {}
    for spec in layout.params.values():
        for source in spec.logical_shapes():
            dtype, holder = dtypes.setdefault(source, (spec.dtype, spec.name))
            if dtype != spec.dtype:
                raise ValueError(f"source parameters {holder!r} ({dtype}) and {spec.name!r} ({spec.dtype}) hold "
                                 f"{source!r} in different dtypes")
    return {source: dtype for source, (dtype, _) in dtypes.items()}


def plan_transfer(src_layout: Layout, dst_layout: Layout, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                  num_replicas: int = 1) -> TransferPlan:
    """Plan the copy of every destination parameter from the source layout, into
    `num_replicas` data-parallel copies of the destination (see TransferPlan).

    Raises ValueError, naming the parameter, for: a destination reading a logical
    tensor the source does not have; a source parameter no destination uses; a
    global shape mismatch; source parameters holding one logical tensor in two
    dtypes; a dtype pair other than equal or float32 -> bfloat16;
    destination writes that overlap, leave a gap, or fall outside the tensor; a
    source holding FP8 parameters (a replica) into any layout but its own.
    """
    check_int(bucket_bytes, "bucket_bytes", 1)
    check_replicas(num_replicas)
    held_fp8 = [name for name, spec in src_layout.params.items() if spec.fp8 is not None]
    if held_fp8:  # a source holding FP8 weights: a replica relaying them (see TransferPlan)
        if src_layout != dst_layout:
            raise ValueError(f"source parameter {held_fp8[0]!r} is held in FP8: it can only be copied as it is, "
                             "into a replica of the same layout (a relay), and the destination layout differs")
        held = held_layout(src_layout)
        return plan_transfer(held, held, bucket_bytes, num_replicas)
    src_shapes = src_layout.logical_shapes()
    dst_shapes = dst_layout.logical_shapes()
    src_dtypes = logical_dtypes(src_layout)

    for spec in dst_layout.params.values():
        for source, shape in spec.logical_shapes().items():
            if source not in src_shapes:
                raise ValueError(f"destination {spec.name!r} reads {source!r}, which the source layout does not have")
            if src_shapes[source] != shape:
                raise ValueError(
                    f"destination {spec.name!r}: {source!r} has shape {src_shapes[source]} in the source "
                    f"layout, expected {shape}"
                )
            pair = (src_dtypes[source], spec.dtype)
            if spec.fp8 is not None:
                if pair[0] not in INPUT_DTYPES:
                    raise ValueError(f"FP8 destination {spec.name!r}: cannot quantize {source!r} from {pair[0]} "
                                     "(bfloat16, float16 or float32 only)")
            elif not castable(*pair):
                raise ValueError(
                    f"destination {spec.name!r}: cannot cast {source!r} from {pair[0]} to {pair[1]} "
                    f"(supported: equal dtypes, float32 -> bfloat16)"
                )
    unused = [name for name, spec in src_layout.params.items() if not set(spec.logical_shapes()) & set(dst_shapes)]
    if unused:
        raise ValueError(f"source parameter {unused[0]!r} is not used by the destination layout ({len(unused)} unused)")

    holders: dict[str, list[_Holder]] = defaultdict(list)
    for rank in range(src_layout.world_size):
        for name in src_layout.params:
            for frag in src_layout.fragments(name, rank):
                holders[frag.source].append(_Holder(rank, name, frag))

    segments: list[Segment] = []
    rects: list[Fp8Rect] = []
    packed: dict[int, int] = defaultdict(int)  # sender rank -> elements of its FP8 buffer so far
    for rank in range(dst_layout.world_size):
        for name, spec in dst_layout.params.items():
            _check_tiling(dst_layout, name, rank)
            dst_cols = view_2d(dst_layout.local_shape(name, rank))[1]
            fp8 = spec.fp8 is not None  # FP8 bytes from the sender's FP8 buffer (fp8.py)
            dst_item = 1 if fp8 else spec.dtype.itemsize
            for frag in dst_layout.fragments(name, rank):
                for holder, ra, rb, ca, cb in _decompose(frag, holders[frag.source], rank, name):
                    src_spec = src_layout.params[holder.name]
                    src_cols = view_2d(src_layout.local_shape(holder.name, holder.rank))[1]
                    hf = holder.fragment
                    src_r, src_c = ra - hf.src_row + hf.local_row, ca - hf.src_col + hf.local_col
                    dst_r, dst_c = ra - frag.src_row + frag.local_row, ca - frag.src_col + frag.local_col
                    width, height = cb - ca, rb - ra
                    if fp8:  # read from the rectangle's dense place in the sender's FP8 buffer
                        offset = packed[holder.rank]
                        rects.append(Fp8Rect(holder.rank, holder.name, src_r, src_c, rank, name, dst_r, dst_c,
                                             height, width, offset))
                        packed[holder.rank] += height * width
                        src_offset, src_pitch, src_row_elems = offset, width, width
                    else:
                        src_item = src_spec.dtype.itemsize
                        src_offset, src_pitch, src_row_elems = ((src_r * src_cols + src_c) * src_item,
                                                                src_cols * src_item, src_cols)
                    if width == src_row_elems == dst_cols and height > 1:  # whole rows on both sides: one run
                        width, height = width * height, 1
                    cast = not fp8 and src_spec.dtype != spec.dtype
                    segments.append(
                        Segment(
                            holder.rank, holder.name, src_offset, src_pitch,
                            rank, name, (dst_r * dst_cols + dst_c) * dst_item, dst_cols * dst_item,
                            width, height, dst_item, cast, SOURCE_FP8 if fp8 else SOURCE_TENSOR,
                        )
                    )
    fp8_plan = Fp8Plan(dst_layout, rects, src_layout.world_size) if rects else None
    if fp8_plan is not None:
        segments += [_scale_segment(write) for write in fp8_plan.scale_writes]
    return TransferPlan(src_layout, dst_layout, segments, bucket_bytes, num_replicas, fp8_plan)


def _scale_segment(write: ScaleWrite) -> Segment:
    """The copy of a run of FP8 scales (float32) from a sender's scales vector."""
    return Segment(write.src_rank, "", write.cell * 4, 0, write.dst_rank, write.dst_name, write.index * 4, 0,
                   write.count, 1, 4, False, SOURCE_SCALES)
