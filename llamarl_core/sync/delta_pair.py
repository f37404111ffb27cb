"""The decisions of a point-to-point pair of deltas (WeightSender(..., delta=True)):
what the sender keeps of each receiver (PairBase: the base, its checksums, the
density limit, which buckets are scanned), what the receiver says it holds
(PairHeld: its words, read on the header's ask), and what a send moved
(SendStats). The codec that encodes and applies a bucket is delta.py; the wire
(which message goes with which tag) stream.py and receiver.py.

Plain classes and the pair's protocol constants; no process, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from .delta import DENSE, BucketCodec, BucketDelta, Scan, bucket_checksum, moved_checksum

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


class DensityLimit:
    """The changed fraction above which a point-to-point pair's buckets go whole
    rather than as deltas, from the measured time of the pair's sends (the
    sender's stream from the receiver's word on, less what a relay waited for its
    buckets to land, plus the scans made before the offer: stream.prescan):

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
        return self.codecs[index].on_host(new)

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
                moved_checksum(old, scan.checksum_change)
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
        else DENSE (also where the delta cannot be made). What is sent is told
        to `sent`."""
        codec = self.codecs[index]
        if scan is not None and delta and not self.density.whole(scan.changed, codec.elements):
            try:
                return codec.encode(new, scan)
            except RuntimeError:  # out of memory, say: the bucket goes whole
                pass
        return BucketDelta(DENSE, new, codec.elements, codec.elements)

    def sent(self, delta: BucketDelta) -> None:
        """A bucket of the send under way went as `delta`: the density of one sent
        as a delta counts for the density limit (finish)."""
        if delta.encoding != DENSE:
            self._densities.append(delta.changed / max(1, delta.elements))


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

    def early_checksums(self, tensors: Mapping[str, torch.Tensor], come) -> list[int]:
        """The checksums of the pair's buckets in order, read from `tensors` while a
        header is on its way: until `come()` says it has come (checked before each
        bucket), every bucket at most; none where the receiver holds no version of
        the pair (a header then asks for no checksum it could use). The receive
        they are read in must not write the pair's bytes before its words are
        made (`word`'s `early`)."""
        sums: list[int] = []
        if self.version is None:
            return sums
        for codec in self.codecs:
            if come():
                break
            sums.append(codec.destination_checksum(tensors))
        return sums

    def word(self, index: int, tensors: Mapping[str, torch.Tensor], device: torch.device,
             checksum: bool = True, early: list[int] | None = None) -> torch.Tensor:
        """Word `index` (tag HOLDING_TAG + index) on what the receiver holds, sent
        as each is made, so that the sender decides bucket i as soon as word i
        comes: word 0 [version or -1, checksum of bucket 0], word i > 0 [checksum
        of bucket i], over the bytes the pair writes in `tensors`, read now, or
        taken from `early` (early_checksums of this receive) where it holds it;
        without `checksum` (WORDS_VERSION), or for a pair without buckets:
        [version or -1]."""
        sums = []
        if checksum and index < len(self.codecs):
            sums = [early[index] if early is not None and index < len(early)
                    else self.codecs[index].destination_checksum(tensors)]
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
