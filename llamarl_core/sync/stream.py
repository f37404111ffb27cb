"""The point-to-point wire format of one version, from a trainer rank's
WeightSender or from a generator replica's relay (relay.py) to one receiver."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .delta import DENSE, BucketDelta
from .delta_pair import DESCRIPTION_BYTES, WORDS_CHECKSUMS, WORDS_NONE, WORDS_VERSION, SendStats
from .engine import default_num_threads, run_segment_table

if TYPE_CHECKING:
    from .sender import WeightSender

# A header's bucket count when the sender wrote nothing of the version to that receiver
# (WeightSender._tell_nothing_follows).
NOTHING_FOLLOWS = -1
# The delta payloads a prescan keeps for one receiver until they are sent: at most this
# share of the pair's bytes (the buckets past it are scanned as they are sent).
PRESCAN_SHARE = 1 / 8


@dataclass
class Prescan:
    """A version's buckets for one point-to-point receiver, scanned against the
    pair's base before the receiver is offered the version (`prescan`): the base
    as it stood before (PairBase.begin's), the buckets scanned (the base holds
    their new bytes), of them those that go as a delta if the receiver's word
    allows (their payloads; the others go whole, packed when sent), and the
    seconds it took (counted in the pair's send time for the density limit)."""

    standing: tuple
    scanned: set[int] = field(default_factory=set)
    deltas: dict[int, BucketDelta] = field(default_factory=dict)
    seconds: float = 0.0


def prescan(sender: WeightSender, dst: int) -> Prescan | None:
    """Scan and encode the buckets of a version for receiver `dst` before it is
    offered (WeightSender._send), where the pair sends deltas on the host (its
    buckets read straight from the tensors): a generator that polls pending()
    keeps generating meanwhile, and its pause holds the words, the payloads and
    the applies alone. Each bucket scanned as the stream would (PairBase.scan,
    values copied out) and its delta kept, until the payloads kept pass
    PRESCAN_SHARE of the pair's bytes (the delta that passes it kept too; the
    buckets after it scanned as they are sent); no bucket where every one goes
    whole anyway (no base stands, a probe), nor one that goes whole unscanned.
    None for a pair without deltas or off the host (the stream scans as it sends)."""
    base, tables = sender._bases.get(dst), sender._tables[dst]
    if base is None or not all(base.reads_through(i, sender._staging_bufs[i % 2][:nbytes])
                               for i, (_table, nbytes) in enumerate(tables)):
        return None
    start = time.monotonic()
    out = Prescan(base.begin())
    if not base.wants_checksums(out.standing):
        return out
    threads = sender.num_threads or default_num_threads()
    room = PRESCAN_SHARE * sum(nbytes for _table, nbytes in tables)
    for i, (table, nbytes) in enumerate(tables):
        if base.skips_scan(i):
            continue
        sender._check_stop()
        staging = sender._staging_bufs[i % 2][:nbytes]  # what the table writes: not written by the scan
        scan = base.scan(i, staging, table, threads=threads, delta=True)
        out.scanned.add(i)
        delta = base.encode(i, staging, scan, True)
        if delta.encoding != DENSE:
            out.deltas[i] = delta
            room -= delta.nbytes
            if room < 0:
                break
    out.seconds = time.monotonic() - start
    return out


class P2PStream:
    """One version from a sender to one point-to-point receiver: a header (tag 0:
    version, bucket count, how many sends this sender offered the receiver, the
    words it asks of the receiver (delta_pair.WORDS_*); a count of NOTHING_FOLLOWS: this
    sender wrote nothing of that version to the receiver, see
    WeightSender._tell_nothing_follows), then bucket i packed into
    staging buffer i % 2 and sent
    (tag 1 + i), so that packing bucket i + 1 overlaps the send of bucket i.
    Packing is done when run_segment_table returns (on GPU its stream waited for
    the current one, so the optimizer's pending writes came first): what is in
    flight reads the staging buffers only, never the sender's tensors. `forward`
    sends the buckets one at a time (a relay sends each as it lands on its own
    rank); `finish` sends the rest and waits for every send. The receiver is
    offered the version first (here, or by the caller: `offered`): a pair's
    versions arrive in order, so the receiver counts what it took.
    A sender of deltas (its PairBase for this receiver, delta_pair.py) asks in its
    header for the receiver's words on what it holds, sent once the header has
    come (tags HOLDING_TAG + i): one a bucket with its checksum where some bucket
    may go as a delta (WORDS_CHECKSUMS), else the version word alone
    (WORDS_VERSION: the version goes whole, and the receiver reads none of what it
    holds); it decides bucket i once word i has come, and sends it as a description (encoding, payload bytes,
    changed elements; tag 1 + 2i) and its payload (tag 2 + 2i). On the host it
    reads a bucket straight from the tensors (PairBase.reads_through): scanned,
    then packed only if it goes whole, or, going whole unscanned, packed together
    with the base; there the sender scanned the buckets before the offer
    (`prescanned`, see prescan), and a bucket scanned then goes as its delta or
    whole as the receiver's word says."""

    def __init__(self, sender: WeightSender, dst: int, version: int, deadline: float, offered: bool = False,
                 stats: SendStats | None = None, prescanned: Prescan | None = None):
        self.sender, self.deadline, self.version, self.stats = sender, deadline, version, stats
        sender._finish_header(dst, deadline)
        if not offered:
            sender._offer(dst, version)
        self.peer = sender.plan.src_layout.world_size + dst
        self.tables = sender._tables[dst]
        self.what = f"sending version {version} to receiver {dst}"
        # A sender of deltas (delta_pair.py) takes the receiver's words on what it holds, and decides
        # each bucket before a byte of it moves; a bucket is scanned while its word is on its way.
        # Its base stands again once all is sent.
        self.base = sender._bases.get(dst)
        self.holding: list = []  # the receives of the receiver's words
        self.taken = 0  # words taken
        self.use_delta: list[bool] = []  # per bucket, from the checksums taken so far
        self.held_version: int | None = None
        self.asked = WORDS_NONE
        self.prescanned = prescanned
        if self.base is not None:
            self.standing = self.base.begin() if prescanned is None else prescanned.standing
            self.asked = WORDS_CHECKSUMS if self.base.wants_checksums(self.standing) else WORDS_VERSION
        self.header = torch.tensor([version, len(self.tables), sender.book.sends[dst], self.asked],
                                   dtype=torch.int64, device=sender.device)
        # The works in flight: the header's, and those reading staging buffer 0 and 1 (with their tensors).
        self.in_flight: list[list] = [[(sender._post("send", self.header, self.peer, 0, self.what), self.header)],
                                      [], []]
        if self.base is not None:  # after the header: NCCL matches a pair's messages in the order posted
            self.holding = sender._post_holding(dst, self.asked, self.what)
        self.sent = 0  # buckets posted
        self.written = 0
        self.full_bytes = 0  # what a full send of the buckets posted moves
        self.clock: float | None = None  # the send's time for the density limit, from the receiver's word on
        self.waited = 0.0  # ... less what a relay waited for buckets to land meanwhile (`paused`)

    def forward(self) -> None:
        """Pack and post the next bucket, once the sends still reading its buffer are done."""
        s, i = self.sender, self.sent
        table, nbytes = self.tables[i]
        slot = self.in_flight[1 + i % 2]
        for work, _tensor in slot:
            s._wait_work(work, self.deadline, self.what)
        slot.clear()
        staging = s._staging_bufs[i % 2][:nbytes]
        self.full_bytes += nbytes

        def pack() -> None:
            run_segment_table(table, s.device, s.num_threads, s._copy_timeout(self.deadline))

        if self.base is None:
            pack()
            self.written += nbytes
            slot.append((s._post("send", staging, self.peer, 1 + i, self.what), staging))
            if self.stats is not None:
                self.stats.add_full(nbytes)
        else:
            # On the host a bucket is read straight from the tensors: scanned, and packed only if it
            # goes whole; one that goes whole unscanned is packed together with the base.
            through = self.base.reads_through(i, staging)
            threads = s.num_threads or default_num_threads()
            scan, packed = None, not through
            if not through:
                pack()
            if self.prescanned is not None and i in self.prescanned.scanned:
                # Scanned before the offer: its delta, where one was kept and the receiver holds the base.
                # Word i taken first, as for a bucket scanned now: the pair's clock starts at word 0.
                usable = self._usable(i)
                delta = self.prescanned.deltas.pop(i, None)
                if delta is None or not usable:
                    delta = self.base.encode(i, staging, None, False)
            else:
                if self.base.skips_scan(i):
                    packed = self.base.take_whole(i, staging, table if through else None, threads)
                    if self.stats is not None:
                        self.stats.unscanned_buckets += 1
                else:
                    # Whether the receiver may take a delta of it, as far as its words have come:
                    # checksums asked for (a base stands), and no word i saying otherwise.
                    may = self.asked == WORDS_CHECKSUMS and (len(self.use_delta) <= i or self.use_delta[i])
                    scan = self.base.scan(i, staging, table if through else None, threads=threads, delta=may)
                delta = self.base.encode(i, staging, scan, self._usable(i))
            self.base.sent(delta)
            if delta.encoding == DENSE and not packed:
                pack()
            meta = torch.tensor([delta.encoding, delta.nbytes, delta.changed], dtype=torch.int64, device=s.device)
            slot.append((s._post("send", meta, self.peer, 1 + 2 * i, self.what), meta))
            slot.append((s._post("send", delta.payload, self.peer, 2 + 2 * i, self.what), delta.payload))
            self.written += delta.nbytes + DESCRIPTION_BYTES
            if self.stats is not None:
                self.stats.add(delta, nbytes)
        self.sent += 1

    def paused(self, seconds: float) -> None:
        """The caller (a relay) waited `seconds` for buckets to land: not the pair's time."""
        if self.clock is not None:
            self.waited += seconds

    def _usable(self, index: int) -> bool:
        """Whether bucket `index` may go as a delta: the receiver's checksums, taken
        in order up to word `index`, against the base as it stood when the send
        began; never where none were asked for."""
        self._take(index + 1)
        return self.asked == WORDS_CHECKSUMS and self.use_delta[index]

    def _take(self, count: int) -> None:
        """Take the receiver's words, up to `count` of those asked for."""
        while self.taken < min(count, len(self.holding)):
            work, buffer = self.holding[self.taken]
            self.sender._wait_work(work, self.deadline, self.what)
            word = buffer.tolist()
            if self.taken == 0:
                self.held_version, word = word[0], word[1:]
                self.clock = time.monotonic()
            if word:  # bucket `taken`'s checksum
                self.use_delta.append(self.base.usable(self.standing, self.held_version, self.taken, word[0]))
            self.taken += 1

    def finish(self) -> int:
        """Send the buckets not sent yet, wait for every send; returns the bytes put on
        the wire (a full send: the bytes packed)."""
        while self.sent < len(self.tables):
            self.forward()
        for slot in self.in_flight:
            for work, _tensor in slot:
                self.sender._wait_work(work, self.deadline, self.what)
        if self.base is not None:
            self._take(len(self.holding))
            held_none = self.standing[0] is None or self.held_version != self.standing[0] or \
                (self.use_delta and not any(self.use_delta))
            if self.stats is not None and self.tables and held_none:
                self.stats.full_receivers += 1  # it held no base: every bucket went whole
            prescan_s = self.prescanned.seconds if self.prescanned is not None else 0.0
            self.base.finish(self.version, self.full_bytes, time.monotonic() - self.clock - self.waited + prescan_s)
            if self.stats is not None:
                self.stats.density_limit = min(self.stats.density_limit, self.base.density.limit)
        return self.written
