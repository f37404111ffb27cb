"""Delta encoding of one point-to-point bucket: what a version changed against the
version the same (sender, receiver) pair moved before, and its apply straight into
the receiver's parameters.

A bucket's bytes are its segments' destination bytes in packed order (endpoint.packed:
segment after segment, each `height` rows of `width` elements of `itemsize` bytes,
cast as the plan casts them): what a full send puts on the wire. An element is
changed when any of its bytes differ from the base's (bitwise: -0.0 against 0.0, one
NaN payload against another, are changes). `BucketCodec.diff` encodes the changed
elements one of three ways, whichever is smallest on the wire (ties: the earlier):

- DENSE: the bucket's bytes as a full send moves them;
- MASK: a bitmask over the bucket's elements (numpy's little-endian bit order), then
  the changed elements' bytes in order;
- RUNS: the number of runs (int64), then each run of changed elements as (first
  element, count), int32 (int64 for a bucket of 2**31 elements or more), then the
  changed elements' bytes.

`BucketCodec.apply` writes a delta into the receiver's own tensors through the
bucket's unpack segments: only the changed elements' bytes, nothing staged. DENSE is
not applied here: the caller unpacks it as a full send.

`bucket_checksum` (the bytes of a bucket) and `BucketCodec.destination_checksum`
(the receiver's tensors through the segments) agree exactly when the bytes do, but
for a collision of a 64-bit position-weighted sum: a check that a delta meets the
base it was made against (a receiver that restarted, tore, or had its weights
changed outside the sync), not a defence against a forger (the sync's values are
authenticated for that).

Torch on the tensors' device (CPU or CUDA), the host's checksum native
(csrc/host/checksum.cpp); no process, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from .._native import native
from .endpoint import packed
from .plan import Segment

DENSE, MASK, RUNS = 0, 1, 2
ENCODINGS = ("dense", "mask", "runs")

# Bytes the checksums read at once (their int64 temporaries are 16x this).
_CHUNK = 1 << 22


@dataclass(frozen=True)
class BucketDelta:
    """One bucket of one version: `encoding` (DENSE, MASK or RUNS), `payload` (uint8,
    what goes on the wire), `changed` elements out of `elements` (a bucket sent
    whole for want of a base: every element)."""

    encoding: int
    payload: torch.Tensor
    changed: int
    elements: int

    @property
    def nbytes(self) -> int:
        return self.payload.numel()


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


# csrc/host/checksum.h checksum_term's constants, as int64.
_K_POS, _K_BYTE = _signed(0x9E3779B97F4A7C15), _signed(0xC2B2AE3D27D4EB4F)
_K_MIX1, _K_MIX2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shifted(v: torch.Tensor, bits: int) -> torch.Tensor:
    """v >> bits with zeros shifted in (torch shifts int64 arithmetically)."""
    return (v >> bits) & ((1 << (64 - bits)) - 1)


def _device_sum(data: torch.Tensor, first_position: int, total: torch.Tensor) -> None:
    """Add to `total` (an int64 scalar on data's device) csrc/host/checksum.h's sum
    over a 1-D uint8 tensor whose first byte sits at `first_position`, with torch
    ops (a GPU's; the host's goes native). No host synchronisation."""
    for start in range(0, data.numel(), _CHUNK):
        part = data[start:start + _CHUNK].to(torch.int64)
        v = torch.arange(first_position + start, first_position + start + part.numel(), dtype=torch.int64,
                         device=data.device)
        v.mul_(_K_POS).add_((part + 1) * _K_BYTE)
        v.bitwise_xor_(_shifted(v, 30)).mul_(_K_MIX1)
        v.bitwise_xor_(_shifted(v, 27)).mul_(_K_MIX2)
        v.bitwise_xor_(_shifted(v, 31))
        total.add_(v.sum())


def _checksum_rows(rows: list[tuple[torch.Tensor, int, int, int, int]], device: torch.device,
                   host: bool | None = None) -> int:
    """The checksum of byte rows, each (tensor, byte offset, pitch, row bytes, height)
    with its first byte at the position that follows the previous row's last
    (positions from 0): the native engine's on the host, torch's on a GPU (or with
    host=False). ValueError for a row outside its tensor, before anything is read."""
    for tensor, offset, pitch, row_bytes, height in rows:
        end = offset + (height - 1) * pitch + row_bytes if height and row_bytes else offset
        if not tensor.is_contiguous() or min(offset, pitch, row_bytes, height) < 0 or \
                end > tensor.numel() * tensor.element_size() or tensor.device != device:
            raise ValueError(f"a checksum row ({offset}, {pitch}, {row_bytes}, {height}) outside its "
                             f"{tensor.dtype} {tuple(tensor.shape)} tensor on {tensor.device}")
    if device.type == "cpu" if host is None else host:
        table, position = [], 0
        for tensor, offset, pitch, row_bytes, height in rows:
            table.append((tensor.data_ptr() + offset, pitch, row_bytes, height, position))
            position += row_bytes * height
        return native().checksum_rows_host(np.array(table, dtype=np.int64).reshape(len(table), 5))
    total, position = torch.zeros((), dtype=torch.int64, device=device), 0
    for tensor, offset, pitch, row_bytes, height in rows:
        flat = _byte_view(tensor)  # as_strided counts from its storage's start
        view = flat.as_strided((height, row_bytes), (pitch, 1), flat.storage_offset() + offset)
        step = max(1, _CHUNK // max(1, row_bytes))
        for r in range(0, height, step):
            _device_sum(view[r:r + step].reshape(-1), position + r * row_bytes, total)
        position += row_bytes * height
    return int(total)


def bucket_checksum(data: torch.Tensor) -> int:
    """The checksum of a bucket's bytes (1-D uint8, packed order), a signed 64-bit
    int: the sum modulo 2**64 of a 64-bit mix of each byte's position and value
    (csrc/host/checksum.h)."""
    return _checksum_rows([(data, 0, data.numel(), data.numel(), 1)], data.device)


_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as bits, little-endian within each byte (numpy's packbits,
    bitorder="little"), on its device."""
    padded = torch.cat([mask, mask.new_zeros((-mask.numel()) % 8)]).view(-1, 8).to(torch.uint8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (padded * weights).sum(1, dtype=torch.uint8)


def _unpack_bits(bits: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` bits of _pack_bits' bytes, as bools."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits[:, None] >> shifts) & 1).reshape(-1)[:count].bool()


_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _differs(new: torch.Tensor, base: torch.Tensor, size: int) -> torch.Tensor:
    """Per element of `size` bytes, whether its bytes differ: compared as integers of
    that size where both spans are aligned to it, else byte by byte."""
    kind = _INT_OF_SIZE.get(size)
    if kind is not None and new.data_ptr() % size == 0 and base.data_ptr() % size == 0:
        return new.view(kind) != base.view(kind)
    return (new != base).view(-1, size).any(1)


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, flat (shares its memory)."""
    return tensor.reshape(-1).view(torch.uint8)


class BucketCodec:
    """The delta codec of one bucket, from its unpack segments (endpoint.packed's
    second list: `src_offset` the segment's place in the bucket's bytes, `dst_*`
    where it lands in the receiver's tensors)."""

    def __init__(self, unpack: Sequence[Segment]):
        self.segments = list(unpack)
        self.nbytes = sum(seg.nbytes for seg in self.segments)
        offset = 0
        for seg in self.segments:
            if seg.src_offset != offset or seg.src_pitch != seg.width * seg.itemsize or seg.cast:
                raise ValueError("BucketCodec takes a bucket's unpack segments (endpoint.packed), in packed order")
            if seg.itemsize not in (1, *_INT_OF_SIZE):
                raise ValueError(f"{seg.dst_name!r}: elements of {seg.itemsize} bytes (1, 2, 4 or 8 are delta-coded)")
            offset += seg.nbytes
        # Stretches: consecutive segments of one itemsize, contiguous in the bucket's bytes.
        stretches: list[list[int]] = []  # [first byte, end byte, itemsize, first element]
        elements = 0
        for seg in self.segments:
            if stretches and stretches[-1][2] == seg.itemsize:
                stretches[-1][1] += seg.nbytes
            else:
                stretches.append([seg.src_offset, seg.src_offset + seg.nbytes, seg.itemsize, elements])
            elements += seg.width * seg.height
        self.stretches = [tuple(s) for s in stretches]
        self.elements = elements
        self.index_dtype = torch.int32 if elements < 2 ** 31 else torch.int64

    # -- the sender's side ------------------------------------------------------------
    def changed_mask(self, new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """Bool per element of the bucket: any of its bytes differ (new, base: the
        bucket's bytes, 1-D uint8)."""
        self._check_bytes(new, "new")
        self._check_bytes(base, "base")
        return torch.cat([_differs(new[start:end], base[start:end], size) for start, end, size, _ in self.stretches]) \
            if self.stretches else new[:0].bool()

    def diff(self, new: torch.Tensor, base: torch.Tensor, encoding: int | None = None) -> BucketDelta:
        """The delta from `base` to `new` (the bucket's bytes, 1-D uint8 on one
        device), in the smallest encoding, or in `encoding` when given."""
        mask = self.changed_mask(new, base)
        changed = int(torch.count_nonzero(mask))
        values = self._values(new, mask)
        index = torch.tensor(0, dtype=self.index_dtype).element_size()
        sizes = {DENSE: self.nbytes, MASK: (self.elements + 7) // 8 + values.numel(),
                 RUNS: 8 + 2 * index * self._run_count(mask) + values.numel()}
        if encoding is None:
            encoding = min(sizes, key=lambda e: (sizes[e], e))
        elif encoding not in sizes:
            raise ValueError(f"encoding must be one of {sorted(sizes)} ({', '.join(ENCODINGS)}), got {encoding!r}")
        if encoding == DENSE:
            payload = new
        elif encoding == MASK:
            payload = torch.cat([_pack_bits(mask), values])
        else:
            runs = self._runs(mask)
            count = torch.tensor([len(runs)], dtype=torch.int64, device=new.device).view(torch.uint8)
            payload = torch.cat([count, runs.to(self.index_dtype).reshape(-1).view(torch.uint8), values])
        return BucketDelta(encoding, payload, changed, self.elements)

    def _values(self, data: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The bytes of the elements `mask` marks, in order."""
        parts = []
        for start, end, size, first in self.stretches:
            count = (end - start) // size
            parts.append(data[start:end].view(count, size)[mask[first:first + count]].reshape(-1))
        return torch.cat(parts) if parts else data[:0]

    @staticmethod
    def _run_count(mask: torch.Tensor) -> int:
        if mask.numel() == 0:
            return 0
        return int(mask[0]) + int(torch.count_nonzero(mask[1:] & ~mask[:-1]))

    @staticmethod
    def _runs(mask: torch.Tensor) -> torch.Tensor:
        """(n, 2) int64: each run of set elements as (first, count)."""
        padded = torch.cat([mask.new_zeros(1), mask, mask.new_zeros(1)]).to(torch.int8)
        edges = padded[1:] - padded[:-1]
        starts = torch.nonzero(edges == 1).reshape(-1)
        ends = torch.nonzero(edges == -1).reshape(-1)
        return torch.stack([starts, ends - starts], dim=1)

    # -- the receiver's side ----------------------------------------------------------
    def changed_elements(self, encoding: int, payload: torch.Tensor, changed: int) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
        """(element indices, int64, increasing; the values' bytes, uint8) of a MASK
        or RUNS payload that says it holds `changed` elements. ValueError for a
        payload that does not hold what it says (runs out of order or past the
        bucket, sizes that do not add up)."""
        device = payload.device
        if encoding == MASK:
            mask_bytes = (self.elements + 7) // 8
            if payload.numel() < mask_bytes:
                raise ValueError(f"a mask delta of {payload.numel()} bytes, shorter than its mask ({mask_bytes})")
            index = torch.nonzero(_unpack_bits(payload[:mask_bytes], self.elements)).reshape(-1)
            values = payload[mask_bytes:]
        elif encoding == RUNS:
            item = torch.tensor(0, dtype=self.index_dtype).element_size()
            if payload.numel() < 8:
                raise ValueError(f"a runs delta of {payload.numel()} bytes, shorter than its run count")
            count = int(payload[:8].clone().view(torch.int64))
            end = 8 + 2 * item * count
            if count < 0 or payload.numel() < end:
                raise ValueError(f"a runs delta of {payload.numel()} bytes that says it holds {count} runs")
            runs = payload[8:end].clone().view(self.index_dtype).to(torch.int64).view(-1, 2)
            firsts, lengths = runs[:, 0], runs[:, 1]
            if count and (bool((lengths <= 0).any()) or bool((lengths > self.elements).any())
                          or bool((firsts < 0).any()) or bool((firsts >= self.elements).any())
                          or int(firsts[-1] + lengths[-1]) > self.elements
                          or bool((firsts[1:] <= firsts[:-1] + lengths[:-1]).any())):
                raise ValueError("a runs delta whose runs are not increasing, apart, non-empty and within the "
                                 f"bucket's {self.elements} elements")
            total = int(lengths.sum())
            index = torch.repeat_interleave(firsts - (torch.cumsum(lengths, 0) - lengths), lengths) + \
                torch.arange(total, device=device)
            values = payload[end:]
        else:
            raise ValueError(f"apply takes a MASK ({MASK}) or RUNS ({RUNS}) delta, got encoding {encoding!r}")
        if index.numel() != changed or values.numel() != self._values_nbytes(index):
            raise ValueError(f"a delta of {index.numel()} elements and {values.numel()} value bytes, which says it "
                             f"holds {changed} elements")
        return index, values

    def _values_nbytes(self, index: torch.Tensor) -> int:
        """The bytes of the elements `index` (increasing) names."""
        cuts = self._stretch_cuts(index)
        return sum((cuts[i + 1] - cuts[i]) * size for i, (_, _, size, _) in enumerate(self.stretches))

    def _stretch_cuts(self, index: torch.Tensor) -> list[int]:
        """Where each stretch's elements begin in `index` (increasing), and its end."""
        firsts = torch.tensor([s[3] for s in self.stretches[1:]], dtype=torch.int64, device=index.device)
        return [0, *torch.searchsorted(index, firsts).tolist(), index.numel()]

    def apply(self, encoding: int, payload: torch.Tensor, changed: int, tensors: Mapping[str, torch.Tensor]) -> int:
        """Write a MASK or RUNS delta into `tensors` (the receiver's, by the
        segments' dst_name; contiguous, on the payload's device) through the
        segments; returns the bytes written. The payload is checked whole first
        (ValueError, nothing written)."""
        index, values = self.changed_elements(encoding, payload, changed)
        # Each element's first byte in the bucket (increasing, as the index is), stretch by stretch.
        cuts = self._stretch_cuts(index)
        positions = torch.cat([index[cuts[i]:cuts[i + 1]] * size + (start - first * size)
                               for i, (start, _, size, first) in enumerate(self.stretches)]) \
            if self.stretches else index
        seg_ends = torch.tensor([seg.src_offset + seg.nbytes for seg in self.segments], dtype=torch.int64,
                                device=index.device)
        bounds = [0, *torch.searchsorted(positions, seg_ends).tolist()]  # each segment's slice of the elements
        # Each segment's slice of the values' bytes: a segment lies within one stretch.
        value_starts = [0]
        for i, (_, _, size, _) in enumerate(self.stretches):
            value_starts.append(value_starts[-1] + (cuts[i + 1] - cuts[i]) * size)

        def value_at(count: int) -> int:
            i = next(i for i in range(len(self.stretches)) if count <= cuts[i + 1])
            return value_starts[i] + (count - cuts[i]) * self.stretches[i][2]

        value_bounds = [value_at(b) for b in bounds]
        written = 0
        for j, seg in enumerate(self.segments):
            lo, hi = bounds[j], bounds[j + 1]
            if lo == hi:
                continue
            k = seg.itemsize
            # Element-wise, through views of the destination and of the values as integers of the
            # element's size (a segment's values copied out first where the payload misaligns them).
            local = (positions[lo:hi] - seg.src_offset) // k
            dst = seg.dst_offset // k + (local // seg.width) * (seg.dst_pitch // k) + local % seg.width
            part = values[value_bounds[j]:value_bounds[j + 1]]
            kind = _INT_OF_SIZE.get(k, torch.uint8)
            if k > 1 and part.storage_offset() % k:
                part = part.clone()
            target = _byte_view(tensors[seg.dst_name]).view(kind)
            target[dst] = part.view(kind)
            written += (hi - lo) * k
        if index.is_cuda:  # landed before the caller reads or forwards it, from any stream
            torch.cuda.current_stream(index.device).synchronize()
        return written

    def destination_checksum(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """bucket_checksum of the bytes the segments cover in `tensors`, read in
        place (what a full send of the same bytes would make equal)."""
        if not self.segments:
            return 0
        rows = [(tensors[seg.dst_name], seg.dst_offset, seg.dst_pitch, seg.width * seg.itemsize, seg.height)
                for seg in self.segments]
        return _checksum_rows(rows, tensors[self.segments[0].dst_name].device)

    def _check_bytes(self, data: torch.Tensor, what: str) -> None:
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != self.nbytes:
            raise ValueError(f"{what}: the bucket's {self.nbytes} bytes as a 1-D uint8 tensor, got "
                             f"{data.dtype} {tuple(data.shape)}")


# The tag of a receiver's word on what it holds (PairHeld.holding), sent before every
# header it takes from a sender of deltas: far above the buckets' tags (1 + 2i, 2 + 2i).
HOLDING_TAG = 1 << 30


def pair_codecs(buckets) -> list[BucketCodec]:
    """The codecs of a point-to-point pair's buckets (plan.buckets[(src, dst)]).
    RuntimeError when the native module predates delta sync (a pull without a
    rebuild)."""
    if not hasattr(native(), "checksum_rows_host"):
        raise RuntimeError("delta sync: llamarl_core._C has no checksum_rows_host (built before delta sync): "
                           "rebuild it with `pip install -e .` from the repository root")
    return [BucketCodec(packed(bucket)[1]) for bucket in buckets]


class PairBase:
    """A sender's base for one point-to-point receiver: the bytes of every bucket
    of the pair as it last sent them (packed order, destination dtype: one byte of
    memory per byte the pair moves, on the sender's device), each bucket's checksum,
    and the version they are, None while no whole version stands (none sent yet,
    or the last send did not finish)."""

    def __init__(self, codecs: list[BucketCodec], device: torch.device):
        self.codecs = codecs
        self.starts = [0]
        for codec in codecs:
            self.starts.append(self.starts[-1] + codec.nbytes)
        self.bytes = torch.zeros(self.starts[-1], dtype=torch.uint8, device=device)
        self.sums: list[int | None] = [None] * len(codecs)
        self.version: int | None = None

    def usable(self, holding: list[int]) -> list[bool]:
        """Per bucket, whether a delta against this base lands right on the receiver
        that sent `holding` (PairHeld.holding: the version it holds from this
        sender, -1 for none, then its checksum of each bucket)."""
        held, sums = holding[0], holding[1:]
        whole = self.version is not None and held == self.version
        return [whole and mine == theirs for mine, theirs in zip(self.sums, sums)]

    def encode(self, index: int, new: torch.Tensor, delta: bool) -> BucketDelta:
        """Bucket `index` of the version being sent (`new`, its packed bytes): a delta
        against the base when `delta`, else DENSE; the base takes `new` after (a
        bucket whose delta or checksum could not be made goes DENSE, and counts as
        held by no receiver until it is sent again)."""
        codec, base = self.codecs[index], self.bytes[self.starts[index]:self.starts[index + 1]]
        dense = BucketDelta(DENSE, new, codec.elements, codec.elements)
        try:
            out = codec.diff(new, base) if delta else dense
            base.copy_(new)
            self.sums[index] = bucket_checksum(new)
        except RuntimeError:  # out of memory, say: the bucket goes whole, and no delta is made against it
            self.sums[index] = None
            return dense
        return out


class PairHeld:
    """A receiver's record of what it holds from one point-to-point sender of
    deltas: the version whose bytes of the pair landed whole (None before the first,
    and from the first byte of a receive until its last), the pair's codecs, and
    why the pair is broken, if it is (a description whose payload could not be
    taken off the wire)."""

    def __init__(self, codecs: list[BucketCodec]):
        self.codecs = codecs
        self.version: int | None = None
        self.broken: str | None = None  # why the pair's messages can no longer be read in step

    def holding(self, tensors: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        """The word sent before each header: [version or -1, checksum of each bucket
        over the bytes the pair writes in `tensors`, read now]."""
        sums = [codec.destination_checksum(tensors) for codec in self.codecs]
        return torch.tensor([-1 if self.version is None else self.version, *sums], dtype=torch.int64, device=device)


@dataclass
class SendStats:
    """What one send of `version` moved (WeightSender.last_send): `wire_bytes` put on
    the wire or copied in place (a delta's payloads and their 24-byte descriptions;
    a full send's bytes), `full_bytes` what a full send of the same version moves,
    `changed` elements in delta buckets, `elements` in those buckets, `dense_buckets`
    sent whole (chosen by size, or for want of a base), `delta_buckets`, and
    `full_receivers`: point-to-point receivers of a delta sender sent the version
    whole (none held the base: first send, restarted, torn, changed since)."""

    version: int
    wire_bytes: int = 0
    full_bytes: int = 0
    changed: int = 0
    elements: int = 0
    dense_buckets: int = 0
    delta_buckets: int = 0
    full_receivers: int = 0

    def add_full(self, nbytes: int) -> None:
        self.wire_bytes += nbytes
        self.full_bytes += nbytes

    def add(self, delta: BucketDelta, full_bytes: int, described: bool) -> None:
        self.wire_bytes += delta.nbytes + (24 if described else 0)
        self.full_bytes += full_bytes
        if delta.encoding == DENSE:
            self.dense_buckets += 1
        else:
            self.delta_buckets += 1
            self.changed += delta.changed
            self.elements += delta.elements
