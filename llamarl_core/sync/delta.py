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

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from .._native import native
from .endpoint import packed
from .layout import check_int
from .plan import Segment

DENSE, MASK, RUNS = 0, 1, 2
ENCODINGS = ("dense", "mask", "runs")

# Bytes the torch checksum reads at once (its int64 temporaries are about 16x this).
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


# csrc/host/checksum.h kChecksumKey, as int64.
_KEY = _signed(0x9E3779B97F4A7C15)
_LOW = (1 << 32) - 1


def _word_terms(words: torch.Tensor, first_word: int) -> torch.Tensor:
    """csrc/host/checksum.h checksum_term of int64 words whose first is word
    `first_word`, with torch ops (wrapping int64 arithmetic; >> 32 of an int64
    shifts its sign in, hence the masks)."""
    masked = torch.arange(first_word, first_word + words.numel(), dtype=torch.int64, device=words.device)
    masked.mul_(_KEY).bitwise_xor_(words)
    product = (masked & _LOW).mul_((masked >> 32) & _LOW)
    return product.add_((words << 32) | ((words >> 32) & _LOW))


class _DeviceSum:
    """csrc/host/checksum.cpp's sum over a stream of byte tensors at increasing
    positions, with torch ops on their device (a GPU's; the host's goes native):
    whole words summed as they come, a word's partial bytes kept until the bytes
    that complete it (or the end). No host synchronisation until `value`."""

    def __init__(self, device: torch.device):
        self.total = torch.zeros((), dtype=torch.int64, device=device)
        self.pending = torch.zeros(0, dtype=torch.uint8, device=device)  # the bytes of a word begun
        self.position = 0  # of pending's first byte

    def add(self, data: torch.Tensor, position: int) -> None:
        """Add a 1-D uint8 tensor whose first byte sits at `position` (at or past the
        end of what came before), _CHUNK bytes at a time (temporaries of about 16x
        that)."""
        for start in range(0, data.numel(), _CHUNK):
            self._add(data[start:start + _CHUNK], position + start)

    def _add(self, data: torch.Tensor, position: int) -> None:
        if self.pending.numel() and position // 8 != (self.position + self.pending.numel() - 1) // 8:
            self._flush()
        if self.pending.numel() and position != self.position + self.pending.numel():  # a gap inside one word
            gap = position - self.position - self.pending.numel()
            self.pending = torch.cat([self.pending, self.pending.new_zeros(gap)])
        if not self.pending.numel():
            lead = position % 8
            self.pending, self.position = data.new_zeros(lead), position - lead
        data = torch.cat([self.pending, data])
        whole = data.numel() // 8 * 8
        if whole:
            self.total.add_(_word_terms(data[:whole].view(torch.int64), self.position // 8).sum())
        self.pending, self.position = data[whole:].clone(), self.position + whole

    def _flush(self) -> None:
        if self.pending.numel():
            word = torch.cat([self.pending, self.pending.new_zeros(8 - self.pending.numel())]).view(torch.int64)
            self.total.add_(_word_terms(word, self.position // 8).sum())
        self.pending = self.pending[:0]

    def value(self) -> int:
        self._flush()
        return int(self.total)


def _checked_rows(rows: list[tuple[torch.Tensor, int, int, int, int]], device: torch.device) -> None:
    """ValueError for a byte row (tensor, byte offset, pitch, row bytes, height) outside
    its tensor, or a tensor not contiguous or not on `device`."""
    for tensor, offset, pitch, row_bytes, height in rows:
        end = offset + (height - 1) * pitch + row_bytes if height and row_bytes else offset
        if not tensor.is_contiguous() or min(offset, pitch, row_bytes, height) < 0 or \
                end > tensor.numel() * tensor.element_size() or tensor.device != device:
            raise ValueError(f"a byte row ({offset}, {pitch}, {row_bytes}, {height}) outside its "
                             f"{tensor.dtype} {tuple(tensor.shape)} tensor on {tensor.device}")


def _checksum_rows(rows: list[tuple[torch.Tensor, int, int, int, int]], device: torch.device,
                   host: bool | None = None) -> int:
    """The checksum of byte rows, each (tensor, byte offset, pitch, row bytes, height)
    with its first byte at the position that follows the previous row's last
    (positions from 0): the native engine's on the host, torch's on a GPU (or with
    host=False). ValueError for a row outside its tensor, before anything is read."""
    _checked_rows(rows, device)
    if device.type == "cpu" if host is None else host:
        table, position = [], 0
        for tensor, offset, pitch, row_bytes, height in rows:
            table.append((tensor.data_ptr() + offset, pitch, row_bytes, height, position))
            position += row_bytes * height
        return native().checksum_rows_host(np.array(table, dtype=np.int64).reshape(len(table), 5))
    total, position = _DeviceSum(device), 0
    for tensor, offset, pitch, row_bytes, height in rows:
        flat = _byte_view(tensor)  # as_strided counts from its storage's start
        view = flat.as_strided((height, row_bytes), (pitch, 1), flat.storage_offset() + offset)
        step = max(1, _CHUNK // max(1, row_bytes))
        for r in range(0, height, step):
            total.add(view[r:r + step].reshape(-1), position + r * row_bytes)
        position += row_bytes * height
    return total.value()


def bucket_checksum(data: torch.Tensor) -> int:
    """The checksum of a bucket's bytes (1-D uint8, packed order), a signed 64-bit
    int: the sum modulo 2**64 of each 8-byte word's term, a nonlinear mix of its
    index and value (csrc/host/checksum.h checksum_term; the last word padded with
    zero bytes)."""
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
    if new.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=new.device)
    kind = _INT_OF_SIZE.get(size)
    if kind is not None and new.data_ptr() % size == 0 and base.data_ptr() % size == 0:
        return new.view(kind) != base.view(kind)
    return (new != base).view(-1, size).any(1)


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, flat (shares its memory)."""
    return tensor.reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class Scan:
    """What changed in one bucket against a base (BucketCodec.scan): `bits` the
    changed-element bitmask (uint8, numpy's little-endian bit order), `changed`
    elements, `runs` of consecutive changed elements, `value_bytes` their bytes,
    `checksum_change` bucket_checksum(new) - bucket_checksum(base) mod 2**64 as a
    signed int (None where the scan was torch's), on the torch path the bool per
    element `bits` packs (`mask`), on the host the changed elements' bytes in order
    (`values`, copied out by the scan unless told not to), and whether the bytes
    scanned were read through a pack table (`read_through`: the staging buffer
    holds none of them)."""

    bits: torch.Tensor
    changed: int
    runs: int
    value_bytes: int
    checksum_change: int | None
    mask: torch.Tensor | None = None
    values: torch.Tensor | None = None
    read_through: bool = False


def moved_checksum(old: int, change: int) -> int:
    """The checksum of a bucket whose checksum was `old` before a scan that found
    its words moved it by `change` (Scan.checksum_change)."""
    return _signed((old + change) & ((1 << 64) - 1))


class BucketCodec:
    """The delta codec of one bucket, from its unpack segments (endpoint.packed's
    second list: `src_offset` the segment's place in the bucket's bytes, `dst_*`
    where it lands in the receiver's tensors). Host tensors go through the native
    codec (csrc/host/delta_scan.cpp and delta_apply.cpp: one pass over the bytes,
    equal 64-byte blocks read once, vector code where the CPU has it: AVX-512,
    or AVX2 for the scan; the scan split over threads), device tensors through
    torch ops; `native_host=False` sends host tensors through torch too. Both make
    the same payloads."""

    def __init__(self, unpack: Sequence[Segment], native_host: bool = True):
        self.segments = list(unpack)
        self.native_host = native_host
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
        self._stretch_table = np.array(self.stretches, dtype=np.int64).reshape(len(self.stretches), 4)
        self.elements = elements
        self.index_dtype = torch.int32 if elements < 2 ** 31 else torch.int64
        self.mask_bytes = (elements + 7) // 8

    def on_host(self, data: torch.Tensor) -> bool:
        """Whether `data` goes through the native host codec (a host tensor, and
        native_host)."""
        return self.native_host and data.device.type == "cpu"

    # -- the sender's side ------------------------------------------------------------
    def changed_mask(self, new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """Bool per element of the bucket: any of its bytes differ (new, base: the
        bucket's bytes, 1-D uint8)."""
        self._check_bytes(new, "new")
        self._check_bytes(base, "base")
        return torch.cat([_differs(new[start:end], base[start:end], size) for start, end, size, _ in self.stretches]) \
            if self.stretches else new[:0].bool()

    def scan(self, new: torch.Tensor, base: torch.Tensor, update_base: bool = False, threads: int = 1,
             values: bool = True) -> Scan:
        """What changed from `base` to `new` (the bucket's bytes, 1-D uint8 on one
        device); with `update_base`, base takes new's bytes (on the host only the
        words, or 64-byte blocks, that differ are written). On the host up to
        `threads` threads scan it, each at least 4 MiB, and copy out the changed
        elements' bytes unless `values` is False."""
        self._check_bytes(new, "new")
        self._check_bytes(base, "base")
        if self.on_host(new) and base.device.type == "cpu":
            return self._host_scan(threads, values, lambda bits, out: native().delta_scan_host(
                new.data_ptr(), base.data_ptr(), self.nbytes, self._stretch_table, bits, update_base, out, threads))
        mask = self.changed_mask(new, base)
        # Every count in one transfer: the changed elements of each stretch, then the runs' starts.
        cuts = [0, *[s[3] for s in self.stretches[1:]], self.elements]
        counts = [torch.count_nonzero(mask[cuts[i]:cuts[i + 1]]) for i in range(len(self.stretches))]
        starts = torch.count_nonzero(mask[1:] & ~mask[:-1]) + mask[:1].sum() if mask.numel() else mask.new_zeros(())
        *per_stretch, runs = torch.stack([*counts, starts.to(torch.int64)]).tolist()
        if update_base:
            base.copy_(new)
        value_bytes = sum(n * size for n, (_, _, size, _) in zip(per_stretch, self.stretches))
        return Scan(_pack_bits(mask), sum(per_stretch), runs, value_bytes, None, mask)

    def scan_packing(self, table: np.ndarray, staging: torch.Tensor, base: torch.Tensor,
                     update_base: bool = False, threads: int = 1, values: bool = True) -> Scan:
        """scan of the bytes the pack `table` (engine.segment_table rows that write
        the bucket's bytes into `staging`, in packed order) would write, read through
        it from the sender's tensors on the host (native, 4 KiB at a time, up to
        `threads` threads): `staging` is not written. ValueError off the host or
        for a table that does not write `staging` back to back."""
        self._check_through(staging, base, "scan_packing")
        try:
            scan = self._host_scan(threads, values, lambda bits, out: native().delta_scan_packing_host(
                table, staging.data_ptr(), base.data_ptr(), self.nbytes, self._stretch_table, bits, update_base, out,
                threads))
        except native().EngineError as error:
            raise ValueError(str(error)) from None
        return dataclasses.replace(scan, read_through=True)

    def pack_base(self, table: np.ndarray, staging: torch.Tensor, base: torch.Tensor, threads: int = 1) -> int:
        """Pack the bucket through the pack `table` (scan_packing's) into `staging`
        and into `base` at once, reading the sender's tensors once (native, host, up
        to `threads` threads); returns bucket_checksum of the bytes. ValueError off
        the host, for `threads` not an int >= 1, or for a table that does not write
        `staging` back to back."""
        self._check_through(staging, base, "pack_base")
        check_int(threads, "threads", 1)
        try:
            return native().delta_pack_base_host(table, staging.data_ptr(), base.data_ptr(), self.nbytes, threads)
        except native().EngineError as error:
            raise ValueError(str(error)) from None

    def _check_through(self, staging: torch.Tensor, base: torch.Tensor, what: str) -> None:
        """What reading through a pack table needs: the bucket's bytes, on the host."""
        self._check_bytes(staging, "staging")
        self._check_bytes(base, "base")
        if not (self.on_host(staging) and base.device.type == "cpu"):
            raise ValueError(f"{what} reads through a pack table on the host (native codec) only")

    def _host_scan(self, threads: int, values: bool, run) -> Scan:
        """A native scan on up to `threads` threads: `run(bits address, values
        address or 0)` returns (changed, runs, value bytes, checksum change)."""
        check_int(threads, "threads", 1)
        bits = torch.zeros(self.mask_bytes, dtype=torch.uint8)
        # Room for every element, and the 64 bytes a thread's native scan may write past its
        # values; pages past what it writes stay untouched.
        out = torch.empty(self.nbytes + 64 * threads, dtype=torch.uint8) if values else None
        changed, runs, value_bytes, checksum_change = run(bits.data_ptr(), 0 if out is None else out.data_ptr())
        return Scan(bits, changed, runs, value_bytes, checksum_change,
                    values=None if out is None else out[:value_bytes])

    def sizes(self, scan: Scan) -> dict[int, int]:
        """Each encoding's payload bytes for what `scan` found."""
        index = self.index_dtype.itemsize
        return {DENSE: self.nbytes, MASK: self.mask_bytes + scan.value_bytes,
                RUNS: 8 + 2 * index * scan.runs + scan.value_bytes}

    def encode(self, new: torch.Tensor, scan: Scan, encoding: int | None = None) -> BucketDelta:
        """The delta `scan` found (against the base it was made from) in the
        smallest encoding, or in `encoding` when given; `new` the bucket's bytes."""
        sizes = self.sizes(scan)
        if encoding is None:
            encoding = min(sizes, key=lambda e: (sizes[e], e))
        elif encoding not in sizes:
            raise ValueError(f"encoding must be one of {sorted(sizes)} ({', '.join(ENCODINGS)}), got {encoding!r}")
        self._check_bytes(new, "new")
        if scan.bits.numel() != self.mask_bytes:
            raise ValueError(f"a scan of {scan.bits.numel() * 8} elements' bits for a bucket of {self.elements}")
        if encoding == DENSE:
            return BucketDelta(DENSE, new, scan.changed, self.elements)
        index_bytes = sizes[encoding] - scan.value_bytes
        host = self.on_host(new)
        if scan.values is None and scan.read_through:
            raise ValueError("a delta of a scan read through a pack table without its values: the staging buffer "
                             "holds none of its bytes (scan_packing with values=True)")
        mask = None
        if not host or scan.values is None:
            mask = scan.mask if scan.mask is not None else _unpack_bits(scan.bits, self.elements)
        values = scan.values if scan.values is not None else self._values(new, mask)
        if values.numel() != scan.value_bytes:
            raise ValueError(f"a scan of {scan.value_bytes} value bytes whose values hold {values.numel()}")
        payload = torch.empty(sizes[encoding], dtype=torch.uint8, device=new.device)
        if encoding == MASK:
            payload[:index_bytes].copy_(scan.bits)
        else:
            payload[:8].copy_(torch.tensor([scan.runs], dtype=torch.int64).view(torch.uint8))
            if host:
                if scan.runs:  # (none: the count alone)
                    native().delta_runs_host(scan.bits.data_ptr(), self.elements, payload.data_ptr() + 8, scan.runs,
                                             self.index_dtype.itemsize)
            else:
                payload[8:index_bytes].copy_(self._runs(mask).to(self.index_dtype).reshape(-1).view(torch.uint8))
        payload[index_bytes:].copy_(values)
        return BucketDelta(encoding, payload, scan.changed, self.elements)

    def diff(self, new: torch.Tensor, base: torch.Tensor, encoding: int | None = None) -> BucketDelta:
        """The delta from `base` to `new` (the bucket's bytes, 1-D uint8 on one
        device), in the smallest encoding, or in `encoding` when given."""
        return self.encode(new, self.scan(new, base), encoding)

    def _values(self, data: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The bytes of the elements `mask` marks, in order."""
        parts = []
        for start, end, size, first in self.stretches:
            count = (end - start) // size
            parts.append(data[start:end].view(count, size)[mask[first:first + count]].reshape(-1))
        return torch.cat(parts) if parts else data[:0]

    @staticmethod
    def _runs(mask: torch.Tensor) -> torch.Tensor:
        """(n, 2) int64: each run of set elements as (first, count)."""
        padded = torch.cat([mask.new_zeros(1), mask, mask.new_zeros(1)]).to(torch.int8)
        edges = padded[1:] - padded[:-1]
        starts = torch.nonzero(edges == 1).reshape(-1)
        ends = torch.nonzero(edges == -1).reshape(-1)
        return torch.stack([starts, ends - starts], dim=1)

    # -- the receiver's side ----------------------------------------------------------
    def _split(self, encoding: int, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the index part: bitmask or runs; the values' bytes) of a MASK or RUNS
        payload; ValueError where it is shorter than its index says."""
        if encoding == MASK:
            if payload.numel() < self.mask_bytes:
                raise ValueError(f"a mask delta of {payload.numel()} bytes, shorter than its mask ({self.mask_bytes})")
            return payload[:self.mask_bytes], payload[self.mask_bytes:]
        if encoding == RUNS:
            if payload.numel() < 8:
                raise ValueError(f"a runs delta of {payload.numel()} bytes, shorter than its run count")
            count = int(payload[:8].clone().view(torch.int64))
            end = 8 + 2 * self.index_dtype.itemsize * count
            if count < 0 or payload.numel() < end:
                raise ValueError(f"a runs delta of {payload.numel()} bytes that says it holds {count} runs")
            return payload[8:end], payload[end:]
        raise ValueError(f"apply takes a MASK ({MASK}) or RUNS ({RUNS}) delta, got encoding {encoding!r}")

    def changed_elements(self, encoding: int, payload: torch.Tensor, changed: int) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
        """(element indices, int64, increasing; the values' bytes, uint8) of a MASK
        or RUNS payload that says it holds `changed` elements, with torch ops.
        ValueError for a payload that does not hold what it says (runs out of order
        or past the bucket, sizes that do not add up)."""
        return self._decode(encoding, payload, changed)[:2]

    def _decode(self, encoding: int, payload: torch.Tensor, changed: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  list[int]]:
        """changed_elements, and where each stretch's elements begin in the index."""
        index_part, values = self._split(encoding, payload)
        if encoding == MASK:
            index = torch.nonzero(_unpack_bits(index_part, self.elements)).reshape(-1)
        else:
            runs = index_part.clone().view(self.index_dtype).to(torch.int64).view(-1, 2)
            firsts, lengths = runs[:, 0], runs[:, 1]
            if runs.numel() and (bool((lengths <= 0).any()) or bool((lengths > self.elements).any())
                                 or bool((firsts < 0).any()) or bool((firsts >= self.elements).any())
                                 or int(firsts[-1] + lengths[-1]) > self.elements
                                 or bool((firsts[1:] <= firsts[:-1] + lengths[:-1]).any())):
                raise ValueError("a runs delta whose runs are not increasing, apart, non-empty and within the "
                                 f"bucket's {self.elements} elements")
            total = int(lengths.sum())
            index = torch.repeat_interleave(firsts - (torch.cumsum(lengths, 0) - lengths), lengths) + \
                torch.arange(total, device=payload.device)
        cuts = self._stretch_cuts(index)
        if index.numel() != changed or values.numel() != self._values_nbytes(index, cuts):
            raise ValueError(f"a delta of {index.numel()} elements and {values.numel()} value bytes, which says it "
                             f"holds {changed} elements")
        return index, values, cuts

    def _values_nbytes(self, index: torch.Tensor, cuts: list[int] | None = None) -> int:
        """The bytes of the elements `index` (increasing) names (`cuts`: its _stretch_cuts, when known)."""
        cuts = self._stretch_cuts(index) if cuts is None else cuts
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
        if self.on_host(payload):
            index_part, values = self._split(encoding, payload)
            rows = self._destination_rows(tensors)
            _checked_rows(rows, payload.device)
            table = np.array([(t.data_ptr() + offset, pitch, seg.width, seg.height, seg.itemsize)
                              for (t, offset, pitch, _, _), seg in zip(rows, self.segments)],
                             dtype=np.int64).reshape(len(rows), 5)
            try:
                return native().delta_apply_host(encoding, index_part.data_ptr(), index_part.numel(),
                                                 self.index_dtype.itemsize, values.data_ptr(), values.numel(),
                                                 changed, table)
            except native().EngineError as error:  # what the payload says does not hold: nothing written
                raise ValueError(str(error)) from None
        index, values, cuts = self._decode(encoding, payload, changed)
        # Each element's first byte in the bucket (increasing, as the index is), stretch by stretch.
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
        return _checksum_rows(self._destination_rows(tensors), tensors[self.segments[0].dst_name].device)

    def _destination_rows(self, tensors: Mapping[str, torch.Tensor]) -> list[tuple[torch.Tensor, int, int, int, int]]:
        """The segments' byte rows in `tensors` (_checksum_rows' form)."""
        return [(tensors[seg.dst_name], seg.dst_offset, seg.dst_pitch, seg.width * seg.itemsize, seg.height)
                for seg in self.segments]

    def _check_bytes(self, data: torch.Tensor, what: str) -> None:
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != self.nbytes or not data.is_contiguous():
            raise ValueError(f"{what}: the bucket's {self.nbytes} bytes as a contiguous 1-D uint8 tensor, got "
                             f"{data.dtype} {tuple(data.shape)} with strides {data.stride()}")


def pair_codecs(buckets) -> list[BucketCodec]:
    """The codecs of a point-to-point pair's buckets (plan.buckets[(src, dst)]).
    RuntimeError when the native module predates delta sync (a pull without a
    rebuild)."""
    if not hasattr(native(), "checksum_rows_host"):
        raise RuntimeError("delta sync: llamarl_core._C has no checksum_rows_host (built before delta sync): "
                           "rebuild it with `pip install -e .` from the repository root")
    return [BucketCodec(packed(bucket)[1]) for bucket in buckets]
