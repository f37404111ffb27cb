"""A generator rank's end of a weight sync: WeightReceiver, with its relays to the
replicas it feeds."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Iterable, Mapping

import torch
import torch.distributed as dist

from .endpoint import Endpoint, check_endpoint, packed, register_receiver
from .engine import (check_distinct_memory, prepared_table, run_segment_table, segment_table, storage_key,
                     wait_for_queued_work)
from .errors import StaleReceiveError, SyncError, SyncTimeoutError, TornWeightsError
from .board import FAILED as FAILED_SLOT
from .board import TicketBoard
from .delta import DENSE, pair_codecs
from .delta_pair import HOLDING_TAG, WORDS_CHECKSUMS, WORDS_NONE, WORDS_VERSION, PairHeld
from .layout import Layout
from .plan import DEFAULT_BUCKET_BYTES, check_replica, relay_tree
from .protocol import (DEFAULT_TIMEOUT_S, DST, FAILED, FAILURE_POLL_S, LANDED, MIXED, REREGISTERED, Channel,
                       ReceiveOutcome, SenderWatch, board_answers, check_name, decide_receive, relay_name)
from .relay import Forwarding, Relays, arrival_regions
from .sender import WeightSender
from .stream import NOTHING_FOLLOWS
from .transports import CUDA_IPC, P2P, SHM, cuda_ipc_handle, share_in_place

# The largest point-to-point bucket of a sync into generator replicas (shared memory
# and CUDA IPC keep theirs: there a bucket is a unit of work). A replica forwards a bucket
# to the next one once all of it has landed, so a relay level adds about one
# bucket's transfer: 16 MiB is 0.13 s at 1 Gbit/s, 1.3 ms at 100. With the default
# 256 MiB a 129 MiB model crossed 1 Gbit hosts in one large bucket per rank pair,
# and one relay level added 0.8 s to a 1.1 s sync.
RELAY_BUCKET_BYTES = 16 << 20


def _outcome(wrote: bool, was_torn: bool) -> str:
    """How a failed receive leaves the weights: torn where a sender wrote (or may
    have); else untouched, and still torn if an earlier receive left them so."""
    if wrote:
        return "weights torn"
    return "nothing was written" + (" (the weights are still torn from an earlier receive)" if was_torn else "")


# A header's fields before it lands (no count or version is ever this).
_UNSET = -(1 << 62)


class _Refused(SyncError):
    """A sender's delta bucket not taken (refused: it did not describe itself truly;
    or its write failed); the rest of that sender's version was taken off the wire,
    so the pair stays in step."""


class WeightReceiver(Endpoint):
    """A generator rank: registers its own parameter tensors once, then
    `receive()` per sync. The destination is the tensors' own storage.

    store: a torch.distributed Store every sender and receiver of the sync reaches.
    layout: the generator's layout (every rank passes the same); rank: this
    process's rank in it. tensors: vLLM-style local parameter name -> the
    generator's parameter tensor (shapes and dtypes as `layout` says for `rank`).
    Every receive writes the memory of these tensors, so every tensor sharing it
    sees the new version: the model's own Parameters behind `p.data` or
    `p.detach()` aliases, views. With the shared-memory transport (CPU tensors on
    one machine) their storages are moved into shared memory at registration, in
    place, values kept (transports.share_in_place): register them before anything
    caches their data pointers. Two tensors sharing bytes are refused, naming
    them. A model whose Parameters are rebound after registration (`model.to()`,
    `load_state_dict(assign=True)`) no longer holds the registered memory:
    `module_receiver` checks the live model before every receive.
    name, transport, timeout, num_threads, secret: as WeightSender's (timeout: for
    set-up and the default of every receive; secret: its relays' too). bucket_bytes: the buckets of the relays
    this rank sends to the replicas it feeds (the trainer's sender rank 0 sets the
    sync's own). p2p_bucket_bytes: a cap on the buckets of point-to-point pairs;
    receiver rank 0's applies (16 MiB at most with replicas).
    FP8 parameters (layout `fp8=`) are registered as their float8_e4m3fn weight
    and float32 scale; the senders quantize (fp8.py), so the receiver holds
    nothing more and does no arithmetic (its relays copy both as they are).
    A point-to-point sender made with `delta=True` (WeightSender) sends deltas:
    once its header of a version asks, this rank tells it what it holds of it (the
    version, and where some bucket may go as a delta a checksum of each bucket read
    from its tensors: one pass over the bytes that sender writes) and applies what
    comes in place. On the host it reads those checksums while the header is on its
    way (a sender on the host scans the version before it offers it: the pause of
    a generator that calls receive() before the offer holds both at once), until
    the header comes; those read ahead of a header that asks for none go unused.
    Its relays then send deltas
    too (each against what it last sent its child rank, point to point: the same
    elements, as each bucket lands).
    replica / num_replicas: this rank's generator replica, of that many
    data-parallel copies of `layout` (each a tensor-parallel group). The trainer
    ranks send to replica 0 only; a version then goes down the replicas'
    `relay_tree`, rank to same rank, each a sync of its own under the Store names
    `<name>/replica<r>` (or `relay_names[r]`): receive() returns once the version
    has landed here and has been copied to the replicas this one feeds. Where this
    rank receives point to point only (its senders on other hosts), a child it
    reaches point to point gets each bucket as soon as it has landed here (the
    relay's buckets mirror the received ones), so a version crosses the relay tree
    in about the time of one link, not one link per level; otherwise the relay
    starts once everything has landed. A relay that fails raises RelayError once
    the others are done: the version landed here; one that broke off in the middle
    of a version fails every later receive at once until `replace_relay`. A child
    replica restarted under a new name is fed through `replace_relay`.

    The handshake, for a generator of one's own (each trainer rank holds a
    WeightSender of the same `name`):
    1. Once: register the tensors and the layout (this constructor, on every
       generator rank; the senders' constructors meanwhile).
    2. Per version: the trainer's `send(v)` offers v to every receiver it writes
       and waits for each to ask for a version. `pending()` (no wait: a few Store
       requests) returns v once every sender of this rank offers it; the
       generator finishes its decode step, pauses, calls `receive()` (which waits
       for the kernels queued on the current stream, then lets the senders write
       into the tensors and returns v once all of it has landed) and resumes
       sampling with the new weights.
    3. Who touches what: between receives the tensors are the generator's (read
       them freely; do not move their storage: a moved tensor is refused by the
       next receive); during receive() the senders write them, so nothing may read
       them. The trainer may read its own tensors during a send (forward passes)
       but changes them (optimizer step) only after send(), or the handle's
       wait(), has returned.
    A sender that fails (set-up, a send, `abort`) says so: set-up waits,
    receive() and pending() raise SyncError naming its rank and its error, a
    receive waiting over shared memory or CUDA IPC at once (within
    protocol.FAILURE_POLL_S, 0.125 s, for a sender that failed before the ticket
    opened or has not mapped this rank's ticket board), set-up within
    FAILURE_POLL_S (a receiver fed only point to point: in pending(); its
    receive() hears from the pair that nothing follows), until that sender sends
    again. A sender killed without a word leaves a timeout, which names the ranks
    that never answered. A sender that failed after it served the open ticket
    leaves that receive to the others.
    """

    side = "receiver"

    def __init__(self, store: dist.Store, layout: Layout, rank: int, tensors: Mapping[str, torch.Tensor], *,
                 name: str = "weights", transport: str = "auto", timeout: float = DEFAULT_TIMEOUT_S,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, num_threads: int | None = None,
                 p2p_bucket_bytes: int | None = None, replica: int = 0,
                 num_replicas: int = 1, relay_names: Mapping[int, str] | None = None, secret: bytes | None = None):
        check_replica(replica, num_replicas)
        children = relay_tree(num_replicas)[replica]
        relay_names = {child: relay_name(name, child) for child in children} | dict(relay_names or {})
        if sorted(relay_names) != children:
            raise ValueError(f"relay_names: replica {replica} feeds replicas {children}, got names for "
                             f"{sorted(relay_names)}")
        for child_name in relay_names.values():
            check_name(child_name)
        device = check_endpoint(self.side, layout, rank, tensors, transport, timeout, num_threads, bucket_bytes,
                                p2p_bucket_bytes)
        check_distinct_memory(tensors, f"receiver rank {rank}")
        if num_replicas > 1:
            p2p_bucket_bytes = min(p2p_bucket_bytes or RELAY_BUCKET_BYTES, RELAY_BUCKET_BYTES)
        channel = Channel(store, relay_name(name, replica), secret)
        self.watch = SenderWatch(channel, rank)
        registration = register_receiver(channel, layout, rank, tensors, device, transport=transport, timeout=timeout,
                                         p2p_bucket_bytes=p2p_bucket_bytes, watch=self.watch)
        super().__init__(channel, layout, rank, tensors, device, registration, timeout=timeout,
                         num_threads=num_threads)
        self.version: int | None = None
        self.torn = False
        self.senders = self.plan.senders_of(self.rank)
        self._local_senders = [src for src in self.senders if self.transports[(src, self.rank)] != P2P]
        self._board: TicketBoard | None = None  # see below
        self._ticket = 0  # the last ticket this rank opened on its board
        # Sender -> how many of its sends were offered up to the last header taken from it
        # point to point (pending() compares its offers with it); None for a sender that
        # writes through memory (its offers are withdrawn).
        self._taken: dict[int, int | None] = {src: None if src in self._local_senders else 0 for src in self.senders}
        local_transports = {self.transports[(src, self.rank)] for src in self._local_senders}
        handle = None
        if SHM in local_transports:
            # In place: every tensor sharing a storage with a registered one (the model's own
            # Parameters behind `p.data` aliases) sees what the senders write.
            handle = share_in_place(self.tensors, f"receiver rank {self.rank}")
        elif CUDA_IPC in local_transports:
            # Senders in this process write to the addresses; the others need IPC handles.
            me = self._dst_infos[self.rank]["process"]
            remote = any(self._src_infos[src]["process"] != me for src in self._local_senders)
            handle = cuda_ipc_handle(self.tensors, self.device, remote)
        if handle is not None:
            # The hand-shake with the senders of this host (board.py), published before the
            # memory handle they wait for.
            self._board = TicketBoard.create(self.plan.src_layout.world_size, f"receiver rank {self.rank}")
            self.channel.set(f"{DST}/{self.rank}/board", self._board.handle() | {"incarnation": self._incarnation})
            # Senders compare the incarnation with the receiver's counter at every send: one
            # that mapped a predecessor registered under this name maps this one instead.
            self.channel.set(f"{DST}/{self.rank}/handle", handle | {"incarnation": self._incarnation})
            if self._incarnation > 1:
                self.channel.counter(REREGISTERED, 1)  # after the handle: a sender that sees it finds this one
        self._staging_bufs = self._staging([self.plan.buckets[(src, self.rank)] for src in self._p2p_peers])
        self._unpack: dict[int, list] = {}
        for src in self._p2p_peers:
            self._unpack[src] = []
            for i, bucket in enumerate(self.plan.buckets[(src, self.rank)]):
                staging = self._staging_bufs[i % 2].data_ptr()
                table = segment_table(packed(bucket)[1], lambda seg: staging,
                                      lambda seg: self.tensors[seg.dst_name].data_ptr())
                self._unpack[src].append((prepared_table(table, self.device), sum(seg.nbytes for seg in bucket)))
        # Point-to-point sender of deltas -> what this rank holds of it (delta_pair.py PairHeld).
        self._held = {src: PairHeld(pair_codecs(self.plan.buckets[(src, self.rank)])) for src in self._p2p_peers
                      if self._src_infos[src].get("delta")}
        self._writer_pool: ThreadPoolExecutor | None = None  # see _writer
        # Whether delta receives write each bucket in on the receiving thread (on a GPU, queued on
        # its current stream, as a full receive's) rather than on the writer thread (the host's).
        self._write_here = self.device.type != "cpu"
        # Where the senders' segments (and the unpack tables) write: checked before every receive().
        self._dst_keys = {name: storage_key(t) for name, t in self.tensors.items()}
        self.replica = replica
        # A receiver that takes deltas relays deltas: each relay keeps its own base per child rank.
        relay_kwargs = dict(transport=transport, bucket_bytes=bucket_bytes, num_threads=num_threads, secret=secret,
                            delta=bool(self._held))
        regions = arrival_regions(self.plan, self.rank, self._p2p_peers, self._local_senders)
        self.relays = Relays(store, relay_names, lambda relay_store, relay: WeightSender(
            relay_store, layout, rank, self.tensors, name=relay, timeout=timeout, relay_buckets=regions,
            **relay_kwargs), forwarded=regions is not None, rank=rank, replica=replica)

    def pending(self) -> int | None:
        """The version the trainer side offers this receiver and it has not received
        yet, without waiting: not None once every sender that writes to this rank has
        offered one (its send() started; the highest, should they differ: receive()
        then refuses the mix). A generator polls it between decode steps and calls
        receive() when it returns a version (see the handshake above). A few Store
        requests; raises SyncError naming the sender when one reported a failure that
        still stands (it failed, or aborted, and has not sent again)."""
        failure = self.watch.failure(self.senders)
        if failure is not None:
            raise SyncError(f"receiver rank {self.rank}: {failure}")
        taken = dict(self._taken)
        if self._board is not None:
            # An offer that served this rank already is not new, whether or not the Store
            # has seen its withdrawal yet (the board's answer can come before it).
            taken |= {src: self._board.served_offer(src) for src in self._local_senders}
        return self.watch.offered(taken)

    def _raise_if_senders_failed(self) -> None:
        """SyncError for a failure reported by one of this rank's senders, before a
        ticket is opened (nothing written): one Store request. Asked only where a
        sender writes over shared memory or CUDA IPC (the wait for its answers
        reads the reports anyway): a receiver fed only point to point (its senders on other hosts)
        keeps to the process group and its timeout within receive(), since a Store
        request over a link that went down waits for the Store's own timeout;
        pending() reports there."""
        if not self._local_senders:
            return
        failure = self.watch.failure(self.senders)
        if failure is not None:
            raise SyncError(f"receiver rank {self.rank}: {failure}; " + _outcome(False, self.torn))

    def replace_relay(self, child: int, name: str) -> None:
        """Feed replica `child` through the sync `name` from now on (a restarted child
        registers its receiver under a new name); the old relay is closed. The new
        one is set up in a thread of its own, on a Store connection of its own: set-up
        waits for the child's receiver to register (seconds, while a new process
        starts), and this rank goes on meanwhile. The next receive() that relays to
        `child` waits for it, within its own timeout."""
        check_name(name)
        self.relays.replace(child, name)

    def receive(self, timeout: float | None = None, relay_to: Iterable[int] | None = None,
                expect: int | None = None) -> int:
        """Take the next version from the senders; returns it once every segment
        has landed and been relayed to the replicas in `relay_to` (default: every
        replica this one feeds; one left out misses this version). expect: the
        version asked for; a sender on this host that already holds a newer one
        (the one that was to send it died, and a restarted one took its place)
        makes this receive raise SyncError instead of filling it with another. Raises
        SyncTimeoutError (tensors torn, version unchanged), or SyncError before
        anything is written if a tensor's storage moved since registration; a relay
        that fails raises RelayError after the other relays, this replica holding
        the version."""
        deadline = self._deadline(timeout)
        children = self.relays.chosen(relay_to)
        forwarding = self.relays.start(children, deadline)
        try:
            version = self._receive(deadline, expect, forwarding)
        except BaseException as exc:
            self.relays.broke_off(forwarding, exc)
            raise
        self.relays.complete(forwarding, children, version, deadline)
        return version

    def _receive(self, deadline: float, expect: int | None, forwarding: Forwarding) -> int:
        self._check_storage()
        # Read before the check below: a failure reported after that check rings the board
        # (a sender that mapped it), or moves the Store's count (one that has not yet).
        rings = self._board.rings() if self._board is not None else 0
        self._raise_if_senders_failed()  # before anything is asked for: the weights stay as they are
        if not self._local_senders:
            # The unpack copies run on a stream that waits for the current one: the GPU orders them.
            was_torn = self.torn
            versions = self._receive_p2p(deadline, forwarding)
            return self._adopt(decide_receive([], [], versions, was_torn), was_torn)
        # Senders on this host write from other processes and streams, ordered by
        # nothing but the ticket: open it only once the generator's queued kernels
        # have stopped reading.
        wait_for_queued_work(self.device, deadline, f"the kernels queued on {self.device} (receiver {self.rank})")
        # Whatever happens from here on, the ticket is closed before receive() returns or raises.
        self._ticket += 1
        ticket, was_torn = self._ticket, self.torn
        try:
            self.torn = True  # from here on senders may be writing into the tensors
            self._board.open_ticket(ticket, expect)
            versions = self._receive_p2p(deadline, forwarding)  # senders on other hosts, meanwhile
            answers = self._answers_on_board(ticket, expect, rings, deadline)
        finally:
            self._board.close_ticket(ticket)
        return self._adopt(decide_receive(answers, self._local_senders, versions, was_torn), was_torn)

    def _answers_on_board(self, ticket: int, expect: int | None, rings: int, deadline: float) -> list:
        """The answers of the senders of this host to `ticket` (protocol.board_answers),
        once every one answered or one failed. When a sender rings (`rings`: the
        count read before the ticket opened), and every FAILURE_POLL_S, the failure
        reports are read (one request while none was reported): a sender whose
        failure stands and that leaves its slot empty for FAILURE_POLL_S (it failed
        before this ticket opened, or before it mapped the board) fails the receive,
        the weights torn. Past `deadline` SyncTimeoutError names the senders that
        never answered. A sender that failed after serving this ticket changes nothing."""
        board, senders = self._board, self._local_senders

        def settled():
            slots = board.answers(ticket, senders)
            done = all(slot is not None for slot in slots) or any(slot is not None and slot[0] == FAILED_SLOT
                                                                  for slot in slots)
            return slots if done else None

        silent_since = None  # when a sender with a standing failure was first seen not to answer
        while True:
            slots = board.wait_until(lambda: settled() or (None if board.rings() == rings else False),
                                     min(deadline, time.monotonic() + FAILURE_POLL_S))
            if slots:
                return board_answers(slots, senders, expect, self.watch.error)
            rings = board.rings()
            now = time.monotonic()
            slots = board.answers(ticket, senders)
            silent = [] if self.watch.failure(self.senders) is None else [
                src for src, slot in zip(senders, slots) if slot is None and self.watch.report(src)]
            if not silent:
                silent_since = None
            elif silent_since is None:
                silent_since = now
            elif now - silent_since >= FAILURE_POLL_S:
                report = self.watch.report(silent[0]) or f"sender rank {silent[0]} failed"
                raise SyncError(f"receiver rank {self.rank}: {report}; " + _outcome(True, self.torn))
            if now >= deadline:
                missing = [src for src, slot in zip(senders, slots) if slot is None]
                raise SyncTimeoutError(f"timed out waiting for senders to finish (receiver {self.rank}, ticket "
                                       f"{ticket}): no word from " + ", ".join(f"sender rank {src}" for src in missing)
                                       + " (no answer on its slot of the ticket board)")

    def _check_storage(self) -> None:
        """Refuse to sync into a tensor whose storage moved since registration: the
        senders' tables (and the unpack tables) hold the registered addresses."""
        for name, t in self.tensors.items():
            now, then = storage_key(t), self._dst_keys[name]
            if now != then:
                raise SyncError(
                    f"receiver rank {self.rank}: parameter {name!r} moved since registration (data_ptr "
                    f"{then[0]:#x} -> {now[0]:#x}, storage {then[1]} -> {now[1]} bytes, shape {then[2]} -> "
                    f"{now[2]}, {then[3]} -> {now[3]}); the senders write to the registered storage, so nothing "
                    "was written: register a new WeightReceiver after the generator re-allocates its weights"
                )

    def _receive_p2p(self, deadline: float, forwarding: Forwarding) -> set[int]:
        """The point-to-point senders' buckets, in round order; returns their
        versions. Bucket i arrives in staging buffer i % 2 (tag 1 + i): the receive
        of bucket i + 1 is posted before bucket i is unpacked, and the receive of
        bucket i + 2 into the same buffer only after that unpack has completed.
        Each bucket, once unpacked, goes on to the relays `forwarding` feeds. A
        sender that failed before writing sends a header saying so: the other
        senders are still received, then SyncError names it (the weights counted
        torn if another sender wrote, or may have: one on this host)."""
        versions, failed, refused = set(), [], []
        was_torn, self.torn = self.torn, True
        for src in self._p2p_peers:  # in round order
            what = f"receiving from sender {src}"
            held = self._held.get(src)
            if held is not None and held.broken:
                raise SyncError(f"receiver rank {self.rank}: {held.broken}; its messages can no longer be read "
                                "in step: register every sender and receiver again under a new name")
            early: list[int] = []  # checksums read while the header was on its way
            while True:
                header = torch.full((4,), _UNSET, dtype=torch.int64, device=self.device)
                work = self._post("recv", header, src, 0, what)
                if held is not None and not early and self.device.type == "cpu":
                    # The sender of deltas may be scanning before its header (stream.prescan): this
                    # rank reads its checksums meanwhile. Gloo lands the header in place before its
                    # work completes (is_completed says so only after wait()): the count read here,
                    # in a race with that write, only says when to stop reading ahead.
                    try:
                        early = held.early_checksums(
                            self.tensors, lambda: int(header[1]) != _UNSET or time.monotonic() >= deadline)
                    except Exception:  # noqa: BLE001 - optional: read on the header's ask, which raises what fails
                        early = []
                self._wait_work(work, deadline, what)
                version, num_buckets, offered, asked = (int(x) for x in header.tolist())
                error = None
                if num_buckets not in (NOTHING_FOLLOWS, len(self._unpack[src])):
                    error = f"sender {src} sends {num_buckets} buckets, the plan has {len(self._unpack[src])}"
                elif asked not in ((WORDS_NONE,) if held is None or num_buckets == NOTHING_FOLLOWS else
                                   (WORDS_VERSION, WORDS_CHECKSUMS)):
                    error = (f"sender {src} asks for words {asked} on what this receiver holds "
                             f"({'a delta' if held is not None else 'a full'} pair), out of step")
                if error is not None:  # before any word: a sender of deltas waits for words it asked for
                    if held is not None:
                        held.broken = error
                    raise SyncError(f"receiver rank {self.rank}: {error}")
                # A sender of deltas decides bucket i once word i has come: each sent as soon as it is made.
                words = []
                for i in range(PairHeld.words(num_buckets, asked) if held is not None else 0):
                    try:
                        word = held.word(i, self.tensors, self.device, checksum=asked == WORDS_CHECKSUMS,
                                         early=early)
                    except Exception as exc:  # the sender waits for a word that does not come: out of step
                        held.broken = f"its word on what it holds of sender {src} could not be made: {exc}"
                        raise SyncError(f"receiver rank {self.rank}: {held.broken}") from exc
                    words.append((self._post("send", word, src, HOLDING_TAG + i, what), word))
                for work, _word in words:
                    self._wait_work(work, deadline, what)
                self._taken[src] = offered  # the sender's offers so far: pending() compares the next with it
                # A "nothing follows" of a send superseded by one pending() has seen offered
                # since (this receiver was not in receive() when that send failed): skipped.
                if num_buckets != NOTHING_FOLLOWS or offered >= self.watch.offer_counts.get(src, 0):
                    break
            if num_buckets == NOTHING_FOLLOWS:
                failed.append((src, version))
                continue
            tables = self._unpack[src]
            versions.add(version)
            forwarding.start(version)
            what = f"version {version} from sender {src}"
            if held is not None:
                try:
                    self._receive_deltas(src, held, version, deadline, forwarding)
                except _Refused as exc:  # that sender's stream was drained: the others are still taken
                    refused.append(str(exc))
                continue
            pending = self._post("recv", self._staging_bufs[0][: tables[0][1]], src, 1, what) if tables else None
            for i, (table, _) in enumerate(tables):
                self._wait_work(pending, deadline, what)
                if i + 1 < len(tables):
                    pending = self._post("recv", self._staging_bufs[(i + 1) % 2][: tables[i + 1][1]], src, 2 + i, what)
                run_segment_table(table, self.device, self.num_threads, self._copy_timeout(deadline))
                forwarding.landed()
        if refused:
            raise SyncError("; ".join(refused) + "; weights torn (the next version comes whole from that sender)")
        if failed:
            wrote = bool(versions) or bool(self._local_senders)
            self.torn = was_torn or wrote
            reports = "; ".join(self.watch.report(src) or f"sender rank {src}: its report no longer stands (it "
                                "sends again)" for src, _ in failed)
            raise SyncError(f"receiver rank {self.rank}: sender ranks {[src for src, _ in failed]} failed before "
                            f"writing version {failed[0][1]} ({reports})"
                            + "; " + _outcome(wrote, was_torn))
        return versions

    def _receive_deltas(self, src: int, held: PairHeld, version: int, deadline: float,
                        forwarding: Forwarding) -> None:
        """Sender `src`'s buckets of `version`, each a description (encoding, payload
        bytes, changed elements; tag 1 + 2i) and its payload (tag 2 + 2i): DENSE
        unpacked as a full send's, a delta applied in place (delta.py). What it holds
        of `src` counts from the first byte until the last has landed. A bucket
        refused (_Refused) leaves the pair in step (the rest was taken off the wire);
        any other failure part way marks the pair broken."""
        what = f"version {version} from sender {src}"
        held.version = None
        try:
            self._take_deltas(src, held, version, deadline, forwarding, what)
        except _Refused:
            raise
        except BaseException as exc:  # messages of this version may be left on the wire: out of step
            held.broken = held.broken or f"receiving {what} stopped part way ({type(exc).__name__}: {exc})"
            raise
        held.version = version

    def _take_deltas(self, src: int, held: PairHeld, version: int, deadline: float, forwarding: Forwarding,
                     what: str) -> None:
        """_receive_deltas' loop over the buckets. Bucket i lands in staging buffer
        i % 2 and is written in (unpacked, or its delta applied) on the host by the
        receiver's writer thread while bucket i + 1 comes off the wire; bucket i's
        payload is received only once bucket i - 2 (the same buffer) is written in,
        and every write has ended before this returns or raises. On a GPU the
        writes are queued on the current stream here, as a full receive's."""
        # The first write that failed, raised once every payload is off the wire (_Refused: a
        # payload refused, out of memory, a copy that failed; the pair stays in step), or, not an
        # Exception, before the next payload. No write after it runs, and the relays stop.
        failure: list[BaseException] = []

        def write(i: int, table, encoding: int, payload: torch.Tensor, changed: int, codec) -> None:
            if failure:
                return
            try:
                if encoding == DENSE:
                    run_segment_table(table, self.device, self.num_threads, self._copy_timeout(deadline))
                else:
                    codec.apply(encoding, payload, changed, self.tensors)
                forwarding.landed()
            except Exception as exc:  # noqa: BLE001 - raised by the receiving thread, in step
                how = "could not be written in" if encoding == DENSE else "refused"
                failure.append(_Refused(f"receiver rank {self.rank}: bucket {i} of {what} {how}: "
                                        f"{type(exc).__name__}: {exc}"))
            except BaseException as exc:  # noqa: BLE001 - the receiving thread raises it
                failure.append(exc)
            if failure:
                forwarding.abort()  # no child may complete a version that fails here

        def check() -> None:
            if failure and not isinstance(failure[0], _Refused):
                raise failure[0]

        writes: list[Future | None] = []  # per bucket, its write on the writer thread (None: written here)
        try:
            for i, ((table, nbytes), codec) in enumerate(zip(self._unpack[src], held.codecs)):
                meta = torch.empty(3, dtype=torch.int64, device=self.device)
                self._wait_work(self._post("recv", meta, src, 1 + 2 * i, what), deadline, what)
                encoding, size, changed = (int(x) for x in meta.tolist())
                if not 0 <= size <= nbytes or (encoding == DENSE and size != nbytes):
                    # Its payload cannot be taken off the wire: the pair's next messages would be misread.
                    held.broken = (f"sender {src} described bucket {i} of {what} as {size} bytes (encoding "
                                   f"{encoding}); the bucket holds {nbytes}")
                    raise SyncError(f"receiver rank {self.rank}: {held.broken}")
                if i >= 2 and writes[i - 2] is not None:
                    wait([writes[i - 2]])  # written in from the buffer this bucket lands in
                check()
                payload = self._staging_bufs[i % 2][:size]  # where the bucket's unpack table reads
                self._wait_work(self._post("recv", payload, src, 2 + 2 * i, what), deadline, what)
                if self._write_here:
                    write(i, table, encoding, payload, changed, codec)
                    writes.append(None)
                else:
                    writes.append(self._writer().submit(write, i, table, encoding, payload, changed, codec))
        finally:
            wait([w for w in writes if w is not None])
        if failure:
            raise failure[0]

    def _writer(self) -> ThreadPoolExecutor:
        """The thread that writes delta receives' buckets in on the host (_take_deltas)."""
        if self._writer_pool is None:
            self._writer_pool = ThreadPoolExecutor(1, thread_name_prefix=f"receiver-{self.rank}-write")
        return self._writer_pool

    def _adopt(self, outcome: ReceiveOutcome, was_torn: bool) -> int:
        """The receive's outcome taken on: the version that landed, or its error raised."""
        self.torn = outcome.torn
        if outcome.kind == LANDED:
            self.version = self.version if outcome.version is None else outcome.version
            return self.version
        if outcome.kind == MIXED:
            raise SyncError(f"receiver rank {self.rank}: senders sent different versions {sorted(outcome.versions)}; "
                            "weights torn")
        answer = outcome.answer
        if outcome.kind == FAILED:
            raise SyncError(f"receiver rank {self.rank}: sender rank {answer['failed']} failed: {answer['error']}; "
                            + _outcome(outcome.wrote, was_torn))
        message = (f"receiver rank {self.rank}: version {answer['abandoned']} will not come (its sender holds version "
                   f"{answer['holds']})")
        if outcome.wrote:
            raise SyncError(f"{message}; weights torn")
        raise StaleReceiveError(message + ("; the weights are still torn from an earlier receive" if was_torn else ""))

    def weights(self) -> dict[str, torch.Tensor]:
        """The registered tensors, for sampling; raises TornWeightsError while torn."""
        if self.torn:
            raise TornWeightsError(
                f"receiver rank {self.rank}: a sync was interrupted and the weights are torn "
                f"(last complete version {self.version}); call receive() again"
            )
        return self.tensors

    def close(self) -> None:
        self._closed = True
        try:
            self.relays.close()
        finally:
            if self._writer_pool is not None:
                self._writer_pool.shutdown(wait=True)
                self._writer_pool = None
