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


# csrc/host/checksum.h checksum_term's constants, as int64.
_K_POS, _K_BYTE = _signed(0x9E3779B97F4A7C15), _signed(0xC2B2AE3D27D4EB4F)
_K_MIX1, _K_MIX2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shifted(v: torch.Tensor, bits: int) -> torch.Tensor:
    """v >> bits with zeros shifted in (torch shifts int64 arithmetically)."""
    return (v >> bits) & ((1 << (64 - bits)) - 1)


def _word_terms(words: torch.Tensor, first_word: int) -> torch.Tensor:
    """csrc/host/checksum.h checksum_term of int64 words whose first is word
    `first_word`, with torch ops (wrapping int64 arithmetic)."""
    v = torch.arange(first_word, first_word + words.numel(), dtype=torch.int64, device=words.device)
    v.mul_(_K_POS).add_((words + 1) * _K_BYTE)
    v.bitwise_xor_(_shifted(v, 30)).mul_(_K_MIX1)
    v.bitwise_xor_(_shifted(v, 27)).mul_(_K_MIX2)
    return v.bitwise_xor_(_shifted(v, 31))


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
    int: the sum modulo 2**64 of a 64-bit mix of each 8-byte word's index and value
    (csrc/host/checksum.h; the last word padded with zero bytes)."""
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


def _check_threads(threads: int) -> None:
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")


def _on_host(data: torch.Tensor, native_host: bool) -> bool:
    return native_host and data.device.type == "cpu"


class BucketCodec:
    """The delta codec of one bucket, from its unpack segments (endpoint.packed's
    second list: `src_offset` the segment's place in the bucket's bytes, `dst_*`
    where it lands in the receiver's tensors). Host tensors go through the native
    codec (csrc/host/delta_scan.cpp and delta_apply.cpp: one pass over the bytes,
    equal 64-byte blocks read once, AVX-512 where the CPU has it, the scan split
    over threads), device tensors through torch ops; `native_host=False` sends host
    tensors through torch too. Both make the same payloads."""

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
        if _on_host(new, self.native_host) and base.device.type == "cpu":
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
        _check_threads(threads)
        try:
            return native().delta_pack_base_host(table, staging.data_ptr(), base.data_ptr(), self.nbytes, threads)
        except native().EngineError as error:
            raise ValueError(str(error)) from None

    def _check_through(self, staging: torch.Tensor, base: torch.Tensor, what: str) -> None:
        """What reading through a pack table needs: the bucket's bytes, on the host."""
        self._check_bytes(staging, "staging")
        self._check_bytes(base, "base")
        if not (_on_host(staging, self.native_host) and base.device.type == "cpu"):
            raise ValueError(f"{what} reads through a pack table on the host (native codec) only")

    def _host_scan(self, threads: int, values: bool, run) -> Scan:
        """A native scan on up to `threads` threads: `run(bits address, values
        address or 0)` returns (changed, runs, value bytes, checksum change)."""
        _check_threads(threads)
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
        host = _on_host(new, self.native_host)
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
        if _on_host(payload, self.native_host):
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


# The tag of a receiver's first word on what it holds (PairHeld.word; word i goes with
# tag HOLDING_TAG + i), sent after each header of a sender of deltas that asks for
# words: far above the buckets' tags (1 + 2i, 2 + 2i).
HOLDING_TAG = 1 << 30
# What a header asks of the receiver (its last field, stream.py): no word (a sender
# without deltas, "nothing follows"), the version word alone (every bucket goes whole),
# or a word a bucket with the receiver's checksums.
WORDS_NONE, WORDS_VERSION, WORDS_CHECKSUMS = 0, 1, 2
# A delta bucket's description on the wire: int64 [encoding, payload bytes, changed elements].
DESCRIPTION_BYTES = 24


def pair_codecs(buckets) -> list[BucketCodec]:
    """The codecs of a point-to-point pair's buckets (plan.buckets[(src, dst)]).
    RuntimeError when the native module predates delta sync (a pull without a
    rebuild)."""
    if not hasattr(native(), "checksum_rows_host"):
        raise RuntimeError("delta sync: llamarl_core._C has no checksum_rows_host (built before delta sync): "
                           "rebuild it with `pip install -e .` from the repository root")
    return [BucketCodec(packed(bucket)[1]) for bucket in buckets]


class DensityLimit:
    """The changed fraction above which a point-to-point pair's buckets go whole
    rather than as deltas, from the measured time of the pair's sends (the
    sender's stream from the receiver's word on, less what a relay waited for its
    buckets to land):

    - a version sent whole gives the seconds per byte of a full send; the least of
      the last FULL_KEPT stands (a send slowed by set-up or a late receiver does not);
    - a version with delta buckets that changed something, slower than a full send
      of its bytes: the limit drops below its densest delta (LOWER x); faster: it
      rises above it (RAISE x, at most 1). Bytes alone choose while no full send
      was timed;
    - PROBE_EVERY versions without a move or a lost delta version, the limit
      doubles (at most 1): denser deltas are tried again, a lost try costing one
      version;
    - a probe, the next version whole and unscanned to time a full send again
      (PairBase.skips_scan): after the second
      delta version (the first full send is slowed by the pair's set-up) when both
      first delta versions took over FIRST_PROBE_ABOVE of that send's time (the
      set-up would have had to slow it over 6x to hide a loss; one dense version,
      such as the first Adam step's, which moves every element by lr, does not
      cost a whole version), then every PROBE_EVERY versions while deltas take
      over CLOSE of a full send's time.

    On a slow link (1 Gbit) the limit settles near the break-even density; on one
    faster than the codec, near 0."""

    LOWER, RAISE, CLOSE, PROBE_EVERY, FULL_KEPT, FIRST_PROBE_ABOVE = 0.8, 1.25, 0.5, 16, 4, 0.15

    def __init__(self) -> None:
        self.limit = 1.0
        self.probe = False  # the next version goes whole
        self._full: list[float] = []  # seconds per byte of the last whole versions
        self._first_ratios: list[float] = []  # the first two delta versions' time over a full send's
        self._since_whole = 0  # versions since the last whole one
        self._since_move = 0  # versions since the limit last moved

    @property
    def full_seconds_per_byte(self) -> float | None:
        return min(self._full) if self._full else None

    def whole(self, changed: int, elements: int) -> bool:
        """Whether a bucket with `changed` of its `elements` changed goes whole."""
        return self.probe or (elements > 0 and changed / elements > self.limit)

    def observe(self, seconds: float, full_bytes: int, densities: list[float]) -> None:
        """A version's send took `seconds` for bytes a full send moves in `full_bytes`;
        `densities`: the changed fraction of each bucket it sent as a delta (none: it
        went whole)."""
        before, lost = self.limit, False
        if not densities:
            if full_bytes > 0 and seconds > 0:
                self._full = (self._full + [seconds / full_bytes])[-self.FULL_KEPT:]
            self._since_whole, self.probe = 0, False
        else:
            self._since_whole += 1
            per_byte, densest = self.full_seconds_per_byte, max(densities)
            if per_byte is not None and full_bytes > 0:
                ratio = seconds / (per_byte * full_bytes)
                lost = densest > 0 and ratio > 1
                if lost:
                    self.limit = min(self.limit, self.LOWER * densest)
                elif densest > 0:
                    self.limit = min(1.0, max(self.limit, self.RAISE * densest))
                first = False
                if len(self._first_ratios) < 2:
                    self._first_ratios.append(ratio)
                    first = len(self._first_ratios) == 2 and min(self._first_ratios) > self.FIRST_PROBE_ABOVE
                if first or (ratio > self.CLOSE and self._since_whole >= self.PROBE_EVERY):
                    self.probe = True
        self._since_move = 0 if lost or self.limit != before else self._since_move + 1
        if self._since_move >= self.PROBE_EVERY and self.limit < 1.0:
            self.limit, self._since_move = min(1.0, max(2 * self.limit, 1e-3)), 0


class PairBase:
    """A sender's base for one point-to-point receiver: the bytes of every bucket
    of the pair as it last sent them (packed order, destination dtype: one byte of
    memory per byte the pair moves, on the sender's device), each bucket's checksum,
    and the version they are, None while no whole version stands (none sent yet,
    or the last send did not finish)."""

    def __init__(self, codecs: list[BucketCodec], device: torch.device):
        self.codecs = codecs
        self.starts = [0]  # each bucket's base from a 64-byte boundary (whole words for the compares)
        for codec in codecs:
            self.starts.append(self.starts[-1] + (codec.nbytes + 63) // 64 * 64)
        self.bytes = torch.zeros(self.starts[-1], dtype=torch.uint8, device=device)
        self.sums: list[int | None] = [None] * len(codecs)
        self.version: int | None = None
        self.density = DensityLimit()
        self._densities: list[float] = []  # of the delta buckets of the send under way
        self._last_density: list[float | None] = [None] * len(codecs)  # each bucket's, at its last scan
        self._unscanned = [0] * len(codecs)  # versions each bucket went whole unscanned since
        self._rescan_after = [1] * len(codecs)  # ... and how many before its next scan (1, 2, 4 .. 16)

    def begin(self) -> tuple[int | None, list[int | None]]:
        """A send begins: the base's version and bucket checksums as they stand (what
        `usable` holds a receiver's word against); no whole version stands from
        here until `finish`, once every bucket is sent."""
        standing = (self.version, list(self.sums))
        self.version = None
        self._densities = []
        return standing

    def finish(self, version: int, full_bytes: int, seconds: float) -> None:
        """Every bucket of `version` is sent (`full_bytes`: what a full send moves,
        `seconds`: the send's time as DensityLimit counts it): it is the base now."""
        self.version = version
        self.density.observe(seconds, full_bytes, self._densities)

    @staticmethod
    def usable(standing: tuple[int | None, list[int | None]], version: int, index: int, checksum: int) -> bool:
        """Whether a delta of bucket `index` against the base `standing` (begin's)
        lands right on the receiver whose words (PairHeld.word) say it holds
        `version` from this sender (-1 for none) and `checksum` of that bucket."""
        mine, sums = standing
        return mine is not None and version == mine and sums[index] == checksum

    def wants_checksums(self, standing: tuple[int | None, list[int | None]]) -> bool:
        """Whether a send that began at `standing` (begin's) asks the receiver for
        its checksums (WORDS_CHECKSUMS), or only for the version it holds
        (WORDS_VERSION): only where some bucket may go as a delta (a base stands, no
        probe of a whole version, some bucket not found denser than the limit); a
        version that goes whole costs the receiver no read of what it holds."""
        return standing[0] is not None and not self.density.probe and \
            not all(self._dense(i) for i in range(len(self.codecs)))

    def reads_through(self, index: int, new: torch.Tensor) -> bool:
        """Whether bucket `index` (to be packed into `new`) is read straight from
        the sender's tensors through its pack table (`scan` and `take_whole` with
        `table`): on the host."""
        return _on_host(new, self.codecs[index].native_host)

    def _base(self, index: int) -> torch.Tensor:
        return self.bytes[self.starts[index]:self.starts[index] + self.codecs[index].nbytes]

    def skips_scan(self, index: int) -> bool:
        """Whether bucket `index` goes whole unscanned this version (`take_whole`):
        a probe (DensityLimit.probe: the whole version, timed as a full send is), or
        its last scan found it denser than the density limit as it stands now,
        fewer versions ago than its rescan interval (1, doubling while rescans find
        it as dense, up to DensityLimit.PROBE_EVERY)."""
        return self.density.probe or \
            self._dense(index) and self._unscanned[index] < self._rescan_after[index]

    def _dense(self, index: int) -> bool:
        """Whether bucket `index`'s last scan found it denser than the limit as it stands."""
        last = self._last_density[index]
        return last is not None and last > self.density.limit

    def take_whole(self, index: int, new: torch.Tensor, table: np.ndarray | None = None, threads: int = 1) -> bool:
        """Bucket `index` goes whole unscanned (skips_scan): the base takes its bytes
        and their checksum, cheaper than a scan of a dense change. `new` holds the
        packed bytes, or, with `table` (reads_through), is packed here together with
        the base. Returns whether `new` holds the packed bytes now (not where the
        pack through the table failed: the caller packs it); on a failure the bucket
        counts as held by no receiver until it is sent again."""
        codec, base = self.codecs[index], self._base(index)
        self._unscanned[index] += 1
        try:
            if table is not None:
                self.sums[index] = codec.pack_base(table, new, base, threads)
            else:
                base.copy_(new)
                self.sums[index] = bucket_checksum(new)
        except (RuntimeError, MemoryError, ValueError):
            self.sums[index] = None
            return table is None
        return True

    def scan(self, index: int, new: torch.Tensor, table: np.ndarray | None = None, threads: int = 1,
             delta: bool = True) -> Scan | None:
        """Bucket `index` of the version being sent (`new`, its packed bytes; with
        `table`, where reads_through says so, the pack table that would write them
        there, read through instead and `new` left unwritten) against the base,
        which takes its bytes and checksum (the checksum moved by the words that
        changed); on the host up to `threads` threads scan it. None where the
        bucket goes whole: `delta` False (the receiver cannot take a delta of it:
        the scan only moves the base, its values are not copied out), a rescan of
        a bucket found denser than the limit (it measures: found sparse again, and
        the limit where it was, the next version goes as a delta), or the scan
        could not be made (out of memory, or a native failure: the bucket then
        counts as held by no receiver until it is sent again). Not for a bucket
        that skips_scan (take_whole)."""
        codec, base = self.codecs[index], self._base(index)
        dense = self._dense(index)
        if self.skips_scan(index):
            raise ValueError(f"bucket {index} goes whole unscanned this version: take_whole, not scan")
        delta = delta and not dense  # a rescan measures: the bucket goes whole this version
        known = self.sums[index] is not None  # a density against a base never sent (zeros) says nothing
        try:
            old = self.sums[index]
            if old is None:  # the base's own, for the scan's change to move
                old = bucket_checksum(base)
            scan = codec.scan(new, base, update_base=True, threads=threads, values=delta) if table is None else \
                codec.scan_packing(table, new, base, update_base=True, threads=threads, values=delta)
            self.sums[index] = bucket_checksum(new) if scan.checksum_change is None else \
                _signed((old + scan.checksum_change) & ((1 << 64) - 1))
        except (RuntimeError, MemoryError, ValueError):  # ValueError: scan_packing's native failures
            self.sums[index] = None
            return None
        density = scan.changed / max(1, codec.elements)
        if dense:  # a rescan: still as dense, the next comes later
            self._rescan_after[index] = min(2 * self._rescan_after[index], self.density.PROBE_EVERY) \
                if density > self.density.limit else 1
        self._last_density[index], self._unscanned[index] = density if known else None, 0
        return scan if delta else None

    def encode(self, index: int, new: torch.Tensor, scan: Scan | None, delta: bool) -> BucketDelta:
        """Bucket `index` (`new`, its packed bytes; `scan`, this base's scan of it) as
        the smallest delta when `delta` and it is no denser than the density limit,
        else DENSE (also where the delta cannot be made)."""
        codec = self.codecs[index]
        if scan is not None and delta and not self.density.whole(scan.changed, codec.elements):
            try:
                out = codec.encode(new, scan)
            except RuntimeError:  # out of memory, say: the bucket goes whole
                pass
            else:
                if out.encoding != DENSE:
                    self._densities.append(scan.changed / max(1, codec.elements))
                return out
        return BucketDelta(DENSE, new, codec.elements, codec.elements)


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

    @staticmethod
    def words(buckets: int, asked: int) -> int:
        """How many words on what it holds a receiver sends after a header of a pair
        of `buckets` buckets that asks for `asked` (WORDS_*): none, the version word,
        or one a bucket (at least one)."""
        if asked not in (WORDS_NONE, WORDS_VERSION, WORDS_CHECKSUMS):
            raise ValueError(f"a header asking for words {asked!r} (WORDS_NONE, WORDS_VERSION or WORDS_CHECKSUMS)")
        return {WORDS_NONE: 0, WORDS_VERSION: 1, WORDS_CHECKSUMS: max(1, buckets)}[asked]

    def word(self, index: int, tensors: Mapping[str, torch.Tensor], device: torch.device,
             checksum: bool = True) -> torch.Tensor:
        """Word `index` (tag HOLDING_TAG + index) on what the receiver holds, sent
        as each is made, so that the sender decides bucket i as soon as word i
        comes: word 0 [version or -1, checksum of bucket 0], word i > 0 [checksum
        of bucket i], over the bytes the pair writes in `tensors`, read now; without
        `checksum` (WORDS_VERSION), or for a pair without buckets: [version or -1]."""
        sums = [self.codecs[index].destination_checksum(tensors)] if checksum and index < len(self.codecs) else []
        head = [-1 if self.version is None else self.version] if index == 0 else []
        return torch.tensor(head + sums, dtype=torch.int64, device=device)


@dataclass
class SendStats:
    """What one send of `version` moved (WeightSender.last_send): `wire_bytes` put on
    the wire or copied in place (a delta's payloads and their descriptions, DESCRIPTION_BYTES each;
    a full send's bytes), `full_bytes` what a full send of the same version moves,
    `changed` elements in delta buckets, `elements` in those buckets, `dense_buckets`
    sent whole (chosen by size, or for want of a base), of them `unscanned_buckets`
    sent whole unscanned (past the density limit, or a probe), `delta_buckets`,
    `full_receivers`: point-to-point receivers of a delta sender sent the version
    whole (none held the base: first send, restarted, torn, changed since), and
    `density_limit`: the lowest density limit of those receivers' pairs once the
    send ended (DensityLimit.limit: buckets changed past it go whole; 1.0 where
    none is lower, or without deltas)."""

    version: int
    wire_bytes: int = 0
    full_bytes: int = 0
    changed: int = 0
    elements: int = 0
    dense_buckets: int = 0
    delta_buckets: int = 0
    full_receivers: int = 0
    unscanned_buckets: int = 0
    density_limit: float = 1.0

    def add_full(self, nbytes: int) -> None:
        self.wire_bytes += nbytes
        self.full_bytes += nbytes

    def add(self, delta: BucketDelta, full_bytes: int) -> None:
        self.wire_bytes += delta.nbytes + DESCRIPTION_BYTES
        self.full_bytes += full_bytes
        if delta.encoding == DENSE:
            self.dense_buckets += 1
        else:
            self.delta_buckets += 1
            self.changed += delta.changed
            self.elements += delta.elements
