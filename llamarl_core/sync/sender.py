"""A trainer rank's end of a weight sync: WeightSender, and the SendHandle of a
send running in the background. A version goes to a point-to-point receiver as a
P2PStream (stream.py)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import nullcontext
from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist

from .endpoint import Endpoint, check_endpoint, packed, register_sender
from .engine import check_local_tensors, prepared_table, run_segment_table, segment_table, storage_key
from .errors import SyncError, SyncTimeoutError
from .layout import Layout
from .amax import AmaxExchange
from .board import FAILED, SERVED, STALE, TicketBoard, to_serve
from .delta import pair_codecs
from .delta_pair import HOLDING_TAG, WORDS_CHECKSUMS, WORDS_NONE, PairBase, PairHeld, SendStats
from .fp8 import Fp8Sources
from .plan import DEFAULT_BUCKET_BYTES, source_address
from .protocol import (ABANDONED, DEFAULT_TIMEOUT_S, DST, FAILURE_POLL_S, REREGISTERED, Channel, SenderBook,
                       SenderReports, check_timeout)
from .stream import NOTHING_FOLLOWS, P2PStream, prescan
from .transports import P2P, SHM, OpenedCudaHandles, OpenedSharedStorages

class SendHandle:
    """A send running in its sender's background thread (`send(version, wait=False)`).

    Until `wait()` has returned, the trainer may read the sender's tensors (forward
    passes) but must not change them (no optimizer step, no `copy_` into them):
    the send copies from them in place, and a change would tear the version the
    receivers get. version: the version this send moves."""

    def __init__(self, version: int, future: Future, offers_made: threading.Event):
        self.version = version
        self._future = future
        self._offers_made = offers_made

    def done(self) -> bool:
        """Whether the send has ended (returned or raised); never blocks."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> int:
        """The bytes the send wrote, once it has ended; re-raises its error (a
        SyncError, its receivers told of it). timeout: seconds to wait (default: until
        it ends, which the send's own timeout bounds); past it raises
        SyncTimeoutError, the send going on."""
        self._wait(timeout)
        return self._future.result()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The send's error once it has ended, None if it succeeded; `timeout` as in wait()."""
        self._wait(timeout)
        return self._future.exception()

    def offered(self, timeout: float | None = None) -> None:
        """Returns once the send has offered the version to every receiver (its
        work before the offers done: FP8 quantization, a delta's scans on the host)
        or has ended (wait() tells how). An engine that pauses its generation for
        the receive can pause then: its pause holds the transfer alone. `timeout`
        as in wait(); past it SyncTimeoutError, the send going on."""
        check_timeout(timeout, optional=True)
        if not self._offers_made.wait(timeout):
            raise SyncTimeoutError(f"the send of version {self.version} has not offered it after {timeout} s")

    def _wait(self, timeout: float | None) -> None:
        check_timeout(timeout, optional=True)
        # Not Future.result(timeout): its timeout is a TimeoutError, as is the send's own SyncTimeoutError.
        if not wait_futures([self._future], timeout).done:
            raise SyncTimeoutError(f"the send of version {self.version} is still running after {timeout} s")


class WeightSender(Endpoint):
    """A trainer rank: registers its shard tensors once, then `send(version)` per step.

    store: a torch.distributed Store (TCPStore, FileStore) every sender and receiver
    of the sync reaches. layout: the trainer's layout (every rank passes the same);
    rank: this process's rank in it. tensors: local parameter name -> shard tensor,
    shapes and dtypes as `layout` says for `rank`, contiguous, all on one device.
    They are read in place (no copy is kept); if their storage moves between sends,
    they are checked and their addresses resolved again.
    name: the sync's Store namespace (`llamarl/sync/<name>/`): several syncs can share
    one Store. transport: 'auto' (shared memory or CUDA IPC within a host,
    point-to-point across), 'shm', 'cuda_ipc' or 'p2p' (torch.distributed, for every
    pair); every rank passes the same. timeout: seconds, for set-up and the default
    of every send. bucket_bytes: the plan's bucket size (see plan_transfer); sender
    rank 0's is used by every rank. num_threads: host copy threads (default:
    LLAMARL_COPY_THREADS, else every core). relay_buckets: set by a WeightReceiver
    on the sender that relays a version to the next replica (that pair's buckets,
    mirroring the ones it receives, in arrival order); None otherwise.
    FP8 destinations (fp8.py): every sender quantizes what it sends and keeps an
    FP8 buffer of it (one byte an element); the senders agree before any byte is
    written (amax.py), so a NaN or inf on one rank fails every sender's send
    (naming the tensor) with the generator untouched.
    group: optional torch.distributed group spanning exactly the sender ranks in
    rank order, used by nothing else while a send runs (a group of its own:
    `dist.new_group`, not the trainer's FSDP group, whose collectives the send's
    thread would interleave with): the FP8 exchange is then one MAX all-reduce
    over it, on the tensors' device, instead of Store keys. As with any
    collective, a rank that misses an exchange (its send of a version never ran)
    leaves the group out of step: register the senders again, with a new group.
    An NCCL group of your own tears the process down on a timeout unless made
    with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (a gloo group does not).
    delta: send each version to every point-to-point receiver as a delta against
    the version it holds (delta.py): per bucket only the elements whose destination
    bytes changed, applied by the receiver in place; a bucket the receiver does not
    hold as this sender last sent it (its first version, a receive that failed, its
    bytes changed since: each bucket's checksum tells) goes whole, decided before a
    byte moves. The sender keeps what it last sent to each such receiver: one more
    byte of memory, on its device, per byte it sends them (plan.bytes_sent_by_src_rank,
    less the pairs on this host). On the host it scans a version's buckets before
    it offers the version (a generator polling the receiver's pending() keeps
    generating meanwhile), keeping the deltas found until they are sent: about an
    eighth of a byte more per byte at most (stream.PRESCAN_SHARE, and the delta
    that passes it; the buckets after it are scanned as they are sent); not where
    it also writes receivers on this host (their offers would wait for the scans). Receivers
    on this host are written in place,
    whole, as without it (transport="p2p" sends deltas to those on other GPUs of
    this host too, through NCCL: docs/delta.md). `last_send` (delta_pair.SendStats): what the last send that
    completed moved (None before the first).
    secret: the sync's (auth.py), the same bytes on every sender and receiver;
    None reads LLAMARL_SECRET / LLAMARL_SECRET_FILE, and with neither set the
    constructor raises ValueError. Every value the sync keeps in the Store carries
    a tag under it: anyone can reach a TCPStore's port, and a value that does
    not verify (a forged memory handle, layout or answer) is never acted on.

    Raises ValueError (bad arguments, tensors that do not match the layout) or
    SyncError / SyncTimeoutError; a set-up that raises is reported to the
    receivers first (see `abort`). As a context manager, an exception leaving the
    block is reported (`abort`) and the sender closed.
    """

    side = "sender"

    def __init__(self, store: dist.Store, layout: Layout, rank: int, tensors: Mapping[str, torch.Tensor], *,
                 name: str = "weights", transport: str = "auto", timeout: float = DEFAULT_TIMEOUT_S,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, num_threads: int | None = None,
                 relay_buckets: list | None = None, group: dist.ProcessGroup | None = None,
                 secret: bytes | None = None, delta: bool = False):
        channel = Channel(store, name, secret)
        self.reports = SenderReports(channel, rank)
        self.rank = rank
        self.book = SenderBook(1)  # its incarnation's once registered (_connect)
        self._reported = False  # whether this rank's failure report stands
        self._unfinished_headers: dict[int, list] = {}  # receiver -> [(work, header, what)] of "nothing follows"
        self._local_receivers: list[int] = []
        # Receiver on this host -> its ticket board (board.py): never unmapped before this object
        # goes (one page each), so that no thread's abort() can answer on an unmapped board.
        self._boards: dict[int, TicketBoard] = {}
        self._closed = False
        # One thread at a time answers on a board (the send's, abort()'s) or maps one anew.
        self._answering = threading.RLock()
        self._opened: dict[int, object] = {}  # receiver on this host -> its memory, mapped (closed by close())
        self._state = threading.Condition()  # guards _sending, _stop and _closed
        self._sending: int | None = None  # the version of the send running now
        self._offers_made = threading.Event()  # set once the running send has offered its version, or ended
        self._stop: str | None = None  # why the running send must stop (close, abort)
        self._worker: ThreadPoolExecutor | None = None  # runs the sends started with wait=False
        self._send_stream: torch.cuda.Stream | None = None  # the worker's CUDA stream (see _run)
        try:
            # A failure this rank reported before it registered again no longer stands.
            self.reports.clear()
            device = check_endpoint(self.side, layout, rank, tensors, transport, timeout, num_threads, bucket_bytes)
            if not isinstance(delta, bool):
                raise ValueError(f"delta must be True or False, got {delta!r}")
            registration = register_sender(channel, layout, rank, tensors, device, transport=transport,
                                           timeout=timeout, bucket_bytes=bucket_bytes, relay_buckets=relay_buckets,
                                           delta=delta)
            super().__init__(channel, layout, rank, tensors, device, registration, timeout=timeout,
                             num_threads=num_threads)
            if group is not None and (group.size(), group.rank()) != (layout.world_size, rank):
                raise ValueError(f"sender rank {rank}: group= must span the {layout.world_size} sender ranks in "
                                 f"rank order, got rank {group.rank()} of {group.size()}")
            self.delta = delta
            self.last_send: SendStats | None = None
            self.fp8 = self._amax = None
            if self.plan.fp8 is not None:
                self.fp8 = Fp8Sources(self.plan.fp8, rank, self.device)
                self._amax = AmaxExchange(channel, rank, layout.world_size, self.fp8, group, self._wait_work)
            self._connect()
        except BaseException as exc:
            self._report_raised(exc)
            for opened in self._opened.values():
                opened.close()
            raise

    def _connect(self) -> None:
        """Open every receiver this rank writes over shared memory or CUDA IPC, and build the copy tables."""
        self.receivers = self.plan.receivers_of(self.rank)
        local = [d for d in self.receivers if self.transports[(self.rank, d)] != P2P]
        # Start with a different receiver on each sender so they do not all queue on one.
        shift = self.rank % len(local) if local else 0
        self._local_receivers = local[shift:] + local[:shift]
        self._dst_addresses: dict[int, dict[str, int]] = {}
        self._dst_incarnations: dict[int, int] = {}  # receiver -> the incarnation whose memory is mapped
        self._reregistered = self.channel.counter(REREGISTERED)  # before any handle is read
        deadline = time.monotonic() + self.timeout
        self.book = SenderBook(self._incarnation)
        for dst in self._local_receivers:
            self._map_receiver(dst, deadline)
        if self._incarnation > 1:  # a restarted sender (SenderBook.inherit)
            for dst in local:
                opened = self._boards[dst].opened()
                self.book.inherit(dst, opened, len(self.plan.senders_of(dst)) == 1,
                                  self._boards[dst].answers(opened, [self.rank])[0] is not None)
            self.reports.withdraw(local)  # what the predecessor offered will not come
        self._staging_bufs = self._staging([self.plan.buckets[(self.rank, d)] for d in self._p2p_peers])
        # Point-to-point receiver -> the base its deltas are made against (delta_pair.py PairBase).
        self._bases = {d: PairBase(pair_codecs(self.plan.buckets[(self.rank, d)]), self.device)
                       for d in self._p2p_peers} if self.delta else {}
        self._build_tables()

    def _map_receiver(self, dst: int, deadline: float, incarnation: int = 0) -> None:
        """Map the memory of receiver `dst` (of `incarnation` or a later one: its handle
        is waited for until `deadline`) and its ticket board, in place of any mapped
        before; this rank has served no ticket of that board yet."""
        key, what = f"{DST}/{dst}/handle", f"receiver {dst}'s memory handle"
        while True:
            self.channel.wait({key: f"receiver rank {dst}"}, deadline, what)
            handle = self.channel.get(key)
            # The board is published before the handle, by the same registration; a later
            # registration's board beside this handle: its handle is on its way.
            board = self.channel.get(f"{DST}/{dst}/board")
            if handle.get("incarnation", 0) >= incarnation and board.get("incarnation") == handle.get("incarnation"):
                break
            if time.monotonic() >= deadline:
                raise SyncTimeoutError(f"sender rank {self.rank}: timed out waiting for receiver {dst}, registered "
                                       f"again (incarnation {incarnation}), to publish its memory handle")
            self._check_stop()
            time.sleep(FAILURE_POLL_S)  # it publishes the handle once its memory is ready
        previous = self._opened.pop(dst, None)
        if previous is not None:
            previous.close()
        if self.transports[(self.rank, dst)] == SHM:
            opened = self._opened[dst] = OpenedSharedStorages(handle, self.plan.dst_layout.local_tensor_specs(dst))
        else:
            opened = self._opened[dst] = OpenedCudaHandles(handle, self.device)
        self._dst_addresses[dst] = opened.addresses
        self._dst_incarnations[dst] = handle.get("incarnation", 0)
        opened_board = TicketBoard.open(board, self.plan.src_layout.world_size, f"sender rank {self.rank}")
        with self._answering:
            self._boards[dst] = opened_board
            self.book.new_board(dst)

    def _follow_reregistered(self, deadline: float) -> None:
        """Receivers on this host that registered again under this sync's name since
        this rank mapped them (a restarted generator rank, with new memory and a new
        board): mapped anew and their tables rebuilt, before this send offers
        anything. One Store request while none did. A receiver registered again on
        another host or device cannot be followed: SyncError."""
        count = self.channel.counter(REREGISTERED) if self._local_receivers else self._reregistered
        if count == self._reregistered:
            return
        for dst in self._local_receivers:
            incarnation = self.channel.counter(f"{DST}/{dst}/incarnation")
            if incarnation == self._dst_incarnations[dst]:
                continue
            info = self.channel.get(f"{DST}/{dst}/info")
            now = {k: info.get(k) for k in ("host", "device", "uuid")}
            then = {k: self._dst_infos[dst].get(k) for k in ("host", "device", "uuid")}
            if now != then:
                raise SyncError(f"sender rank {self.rank}: receiver {dst} registered again on another host or "
                                f"device ({then} -> {now}); register every sender and receiver again under a new name")
            self._dst_infos[dst] = info
            self._map_receiver(dst, deadline, incarnation)
            self._tables[dst] = self._local_tables(dst)
        self._reregistered = count

    def _source_address(self, seg) -> int:
        return source_address(seg, self.tensors, self.fp8)

    def _local_tables(self, dst: int) -> list:
        """The copy tables of receiver `dst` on this host, into its mapped memory."""
        addresses = self._dst_addresses[dst]
        tables = [segment_table(b, self._source_address, lambda seg: addresses[seg.dst_name])
                  for b in self.plan.buckets[(self.rank, dst)]]
        if self.device.type == "cuda":
            # One launch of the copy kernel for all of them (a bucket is a unit of the
            # host engine's work): uploaded once, run at every send.
            tables = [prepared_table(np.concatenate(tables), self.device)] if tables else []
        return tables

    def _build_tables(self) -> None:
        self._src_keys = {name: storage_key(t) for name, t in self.tensors.items()}
        if self.fp8 is not None:
            self.fp8.bind(self.tensors)
        self._tables: dict[int, list] = {dst: self._local_tables(dst) for dst in self._local_receivers}
        for dst in self._p2p_peers:
            self._tables[dst] = []
            for i, bucket in enumerate(self.plan.buckets[(self.rank, dst)]):
                staging = self._staging_bufs[i % 2].data_ptr()
                table = prepared_table(segment_table(packed(bucket)[0], self._source_address, lambda seg: staging),
                                       self.device)
                self._tables[dst].append((table, sum(seg.nbytes for seg in bucket)))

    def _receiver_gone(self, dst: int) -> SyncError:
        return SyncError(f"sender rank {self.rank}: receiver {dst} is gone ({self.channel.get(ABANDONED)})")

    def _await_ticket(self, dst: int, deadline: float) -> tuple[int, int | None]:
        """(ticket, version asked for) of receiver `dst`'s open receive() that this
        sender has not served, as its board shows it. Raises SyncError at once if this
        send is stopped (both wake the board), within FAILURE_POLL_S if the receivers
        were abandoned (abandon_receivers); a receiver registered again meanwhile (a
        restarted generator rank) is mapped anew, and its board waited on instead;
        past `deadline` SyncTimeoutError names the receiver. Every FAILURE_POLL_S of
        waiting: two Store requests."""
        while True:
            self._check_stop()
            board = self._boards[dst]
            found = board.wait_until(lambda: to_serve(self.book.served.get(dst, 0), board.current()) or
                                     (None if self._stop is None else False),
                                     min(deadline, time.monotonic() + FAILURE_POLL_S))
            self._check_stop()
            if found:
                return found
            if self.channel.has(ABANDONED):
                raise self._receiver_gone(dst)
            self._follow_reregistered(deadline)
            if time.monotonic() >= deadline:
                raise SyncTimeoutError(f"timed out waiting for receiver {dst} to ask for a version: no word from "
                                       f"receiver rank {dst} (no ticket open on its board)")

    def send(self, version: int, timeout: float | None = None, *, wait: bool = True) -> int | SendHandle:
        """Move `version` of this rank's shards to every receiver that needs them.

        wait=True (the default): returns the bytes written (in place, or put on the
        wire: a delta's payloads and their descriptions) once every byte read from
        the tensors has been copied, so the optimizer step after it cannot tear a copy.
        wait=False: returns a SendHandle at once, the send running in this sender's
        background thread (on GPU its copies wait for the kernels queued on the
        caller's current stream at this call, not for those queued after: see _run);
        forward passes may run meanwhile, the tensors must
        not change until the handle's wait() has returned. One method with a flag, as
        torch.distributed's `async_op`: the checks, the protocol and the errors are
        the same, and a blocking send runs in the caller's thread as before.

        Each receiver is offered the version when the send starts (what its
        `pending()` reads). timeout: seconds (default: the sender's) for a receiver to
        ask for a version and every transfer to finish; past it SyncTimeoutError.
        Raises ValueError for a bad version and SyncError while another send is in
        flight or once closed, before anything changes; any other failure is reported
        to the receivers (see `abort`) before it is raised (wait=False: by the handle).
        A send clears the failure this rank reported last."""
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**63:
            raise ValueError(f"version must be a non-negative int below 2**63 (it goes as an int64), got {version!r}")
        with self._state:
            deadline = self._deadline(timeout)  # raises once closed
            if self._sending is not None:
                raise SyncError(f"sender rank {self.rank}: the send of version {self._sending} is still in flight; "
                                "wait for it (its handle's wait()) before the next send")
            self._sending, self._stop = version, None
            offers_made = self._offers_made = threading.Event()
        try:
            if self._reported:
                self.reports.clear()
                self._reported = False
            self._check_sources()
        except BaseException as exc:
            self._end_send(exc)
            raise
        if wait:
            return self._run(version, deadline)
        try:
            ready = None
            if self.device.type == "cuda":
                # What the copies wait for: the work queued on the caller's stream now (the
                # optimizer step that wrote the tensors), not forward passes queued after.
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"llamarl-send-{self.rank}")
            return SendHandle(version, self._worker.submit(self._run, version, deadline, ready), offers_made)
        except BaseException as exc:  # nothing started: the next send may
            self._end_send(exc)
            raise

    def _check_sources(self) -> None:
        """Tensors whose storage moved since the copy tables were built are checked
        against the layout (ValueError) and their addresses resolved again."""
        if any(storage_key(t) != self._src_keys[n] for n, t in self.tensors.items()):
            check_local_tensors(self.layout, self.rank, self.tensors, self.side)
            self._build_tables()

    def _run(self, version: int, deadline: float, ready: torch.cuda.Event | None = None) -> int:
        """The send; in the worker thread (ready: the event send() recorded on the
        caller's stream), on a stream of its own that waits for that event alone: the
        copies' side streams wait for this stream (run_segment_table), the point-to-point
        headers and NCCL's work queue on it, so none waits for the caller's later work."""
        try:
            stream = None
            if ready is not None:
                if self._send_stream is None:
                    self._send_stream = torch.cuda.Stream(self.device)
                stream = self._send_stream
                stream.wait_event(ready)
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                written = self._send(version, deadline)
        except BaseException as exc:
            self._end_send(exc)
            raise
        self._end_send(None)
        return written

    def _send(self, version: int, deadline: float) -> int:
        self.book.send_begins()
        try:
            if self.fp8 is not None:  # before any offer: a receiver asks for what is ready to copy
                self._quantize_fp8(version, deadline)
            self._follow_reregistered(deadline)
            self._check_stop()
            # Deltas on the host are scanned before the offers: a generator polling pending() keeps on
            # meanwhile. Not where receivers on this host take the version too: their offers would wait.
            prescans = {dst: None if self._local_receivers else prescan(self, dst) for dst in self._p2p_peers}
        except BaseException as exc:
            # Reported first (receivers on this host see it); those fed point to point
            # wait on the pair: each is offered the version and told nothing follows.
            self._report_early(exc)
            self._tell_nothing_follows(self._p2p_peers, version, exc, offer=True)
            raise
        # Every receiver is offered the version at once: pending() on a receiver that
        # several senders feed point to point needs all their offers, which offers made
        # round by round would hold back behind the transfers of the rounds before.
        for dst in [*self._local_receivers, *self._p2p_peers]:
            self._offer(dst, version)
        self._offers_made.set()
        written, started = 0, 0
        stats = SendStats(version)
        try:
            # Receivers on this host first: their receive() opens its ticket before it
            # waits on any point-to-point peer, so these copies never wait on a round.
            for dst in self._local_receivers:
                ticket, wanted = self._await_ticket(dst, deadline)
                while wanted is not None and wanted < version:
                    # The receive asks for an older version, which nobody will send now (its sender
                    # died): tell it so, untouched, rather than fill it with this one, then serve the
                    # receive that follows.
                    self._answer(dst, ticket, STALE, version)
                    ticket, wanted = self._await_ticket(dst, deadline)
                for table in self._tables[dst]:
                    self.book.writes(dst)  # before the stop check: an abort in between answers "wrote"
                    self._check_stop()
                    wrote = run_segment_table(table, self.device, self.num_threads, self._copy_timeout(deadline))
                    written += wrote
                    stats.add_full(wrote)
                # An abort before this check answered the ticket FAILED and stops the send here;
                # one after it may see its FAILED replaced by the version below: the copy is whole.
                self._check_stop()
                # Withdrawn before the answer: a receiver that has the version never sees the offer stand.
                self.reports.withdraw(self.book.withdraw([dst]))
                self._answer(dst, ticket, SERVED, version)
                self.book.served_whole(dst)
            for dst in self._p2p_peers:  # in round order
                self._check_stop()
                started += 1
                written += P2PStream(self, dst, version, deadline, offered=True, stats=stats,
                                     prescanned=prescans[dst]).finish()
        except BaseException as exc:
            self._report_early(exc)
            self._tell_nothing_follows(self._p2p_peers[started:], version, exc)
            raise
        self.last_send = stats
        return written

    def _report_early(self, exc: BaseException) -> None:
        """Report `exc` now (unless abort() did), not when the send ends (_end_send
        then leaves it); the offers of this send withdrawn either way."""
        if not getattr(exc, "llamarl_reported", False):
            self._report_raised(exc)
            exc.llamarl_reported = True
            return
        try:
            self.reports.withdraw(self.book.withdraw())
        except Exception as failure:  # noqa: BLE001 - `exc` is what the send raises
            exc.add_note(f"sender rank {self.rank} could not withdraw its offers: {failure!r}")

    def _tell_nothing_follows(self, peers: list[int], version: int, exc: BaseException, offer: bool = False) -> None:
        """Point-to-point receivers (offered `version`, or now with `offer`) whose
        stream never began get a header saying nothing follows, posted without
        waiting: a receive() waiting for this rank raises at once instead of timing
        out, and a receiver not in receive() (its pending() raises the failure)
        finds it before the next version's header (P2PStream waits for it first).
        Not for KeyboardInterrupt and the like; what fails is noted on `exc`."""
        if not isinstance(exc, Exception):
            return
        for dst in peers:
            try:
                if offer:
                    self._offer(dst, version)
                header = torch.tensor([version, NOTHING_FOLLOWS, self.book.sends[dst], WORDS_NONE],
                                      dtype=torch.int64, device=self.device)
                peer = self.plan.src_layout.world_size + dst
                what = f"telling receiver {dst} that version {version} will not come"
                self._unfinished_headers.setdefault(dst, []).append((self._post("send", header, peer, 0, what),
                                                                     header, what))
            except Exception as failure:  # noqa: BLE001 - `exc` is what the send raises
                exc.add_note(f"sender rank {self.rank} could not tell receiver {dst} that nothing follows: {failure}")

    def _post_holding(self, dst: int, asked: int, what: str) -> list[tuple]:
        """Post the receives of delta receiver `dst`'s words on what it holds
        (PairHeld.word), which it sends after a header of this rank asks for `asked`
        (delta_pair.WORDS_*); per word, (the work, the buffer it lands in)."""
        buckets, posted = len(self._tables[dst]), []
        for i in range(PairHeld.words(buckets, asked)):
            buffer = torch.empty((i == 0) + (asked == WORDS_CHECKSUMS and i < buckets), dtype=torch.int64,
                                 device=self.device)
            posted.append((self._post("recv", buffer, self.plan.src_layout.world_size + dst, HOLDING_TAG + i, what),
                           buffer))
        return posted

    def _finish_header(self, dst: int, deadline: float) -> None:
        """Wait for the "nothing follows" headers posted to `dst` still in flight (its
        receiver takes them before the next header: a pair's messages arrive in order)."""
        for work, _header, what in self._unfinished_headers.pop(dst, []):  # each header tensor alive until here
            self._wait_work(work, deadline, what)

    def _quantize_fp8(self, version: int, deadline: float) -> None:
        """This rank's part of the FP8 destinations (fp8.py): amaxes, the shared ones
        reduced (MAX) over every sender rank together with who holds NaN or inf
        (amax.py), then scales and the FP8 buffer. A rank holding NaN or inf still
        takes part, so that every sender fails before writing a byte."""
        fp8 = self.fp8
        amax = fp8.local_amax(self.tensors)
        problem = fp8.nonfinite(amax, self.tensors)  # the one host sync
        bad = [] if self.layout.world_size == 1 else self._amax.run(None if problem else amax, version, deadline)
        if problem is not None:
            raise SyncError(f"sender rank {self.rank}, version {version}: {problem}; nothing was written")
        if bad:
            raise SyncError(f"sender rank {self.rank}, version {version}: sender rank(s) {bad} hold NaN or inf for "
                            "an FP8 destination; nothing was written")
        fp8.quantize(self.tensors, amax)

    def _offer(self, dst: int, version: int) -> None:
        self.reports.offer(dst, version, self.book.offer(dst))

    def _check_stop(self) -> None:
        if self._stop is not None:
            exc = SyncError(f"sender rank {self.rank}: {self._stop}")
            exc.llamarl_reported = self._stop.startswith("aborted: ")  # abort() published it
            raise exc

    def _end_send(self, exc: BaseException | None) -> None:
        """The send is over: a failure reported to the receivers (unless _send reported
        it already); the next send may start."""
        if exc is not None and not getattr(exc, "llamarl_reported", False):
            self._report_raised(exc)
        with self._state:
            self._sending = None
            self._offers_made.set()
            self._state.notify_all()

    def _report(self, message: str) -> None:
        """Publish this rank's failure (SenderReports.fail), its offers withdrawn; then
        answer FAILED on the open ticket of every receiver of this host it has not
        served, and ring every board (a receiver waiting on one reads the report)."""
        self._reported = True  # first: a report published in part is cleared by the next send too
        self.reports.withdraw(self.book.withdraw())
        self.reports.fail(message)
        if self._closed:  # its boards are another sender's to answer on now (a rank registered again)
            return
        for dst in self._local_receivers:
            with self._answering:
                board = self._boards.get(dst)
                if board is None:  # not mapped yet: the receiver sees the report in the Store
                    continue
                current = to_serve(self.book.served.get(dst, 0), board.current())
                if current is not None:
                    self._answer(dst, current[0], FAILED, 0)
                board.ring()

    def _answer(self, dst: int, ticket: int, kind: int, version: int) -> None:
        """Answer `ticket` of receiver `dst` on its board (SERVED, STALE, FAILED), as
        the book says (SenderBook.answers; its `wrote` for STALE and FAILED)."""
        with self._answering:
            if self.book.answers(dst, ticket, failed=kind == FAILED):
                self._boards[dst].answer(self.rank, ticket, kind, version, kind == SERVED or self.book.wrote(dst),
                                         self.book.sends.get(dst, 0) if kind == SERVED else None)

    def _report_raised(self, exc: BaseException) -> None:
        try:
            self._report(f"{type(exc).__name__}: {exc}")
        except Exception as failure:  # noqa: BLE001 - the Store is unreachable: `exc` says so, and is raised
            exc.add_note(f"sender rank {self.rank} could not report this failure to its receivers: {failure!r}")

    def abort(self, reason: str) -> None:
        """Tell the receivers that this rank will not send as they expect (the trainer's
        own code failed between sends, say): a receive() waiting for this rank over
        shared memory or CUDA IPC raises SyncError naming this rank and `reason` at
        once, and every later receive() or pending() of its receivers raises it
        (receivers fed only point to point: in pending()), until this sender
        sends again. A send in flight is stopped at its next step (it raises
        SyncError, at once or after a bucket's copy); close() waits
        for it. A point-to-point receiver's version, once its stream began, is not
        called back (a posted transfer cannot be): the stream ends when that
        receiver has taken every bucket (the whole version lands there, the report
        standing) or at the send's timeout, which closes the pair (docs/sync.md);
        the send stops before the next receiver (after the last one it returns,
        as on shared memory once the last copy is answered). Raises what the
        Store raises if the report cannot be published."""
        with self._state:
            if self._sending is not None:
                # Set before the report: a copy the send starts after reading it is in the
                # report's "wrote" (_send adds a receiver there before it checks the stop).
                self._stop = f"aborted: {reason}"
        self._report(f"aborted: {reason}")  # the send it stops leaves the report to this

    def close(self, timeout: float | None = None) -> None:
        """Stop using the receivers' memory. A send in flight is stopped first (at its
        next step: it raises SyncError, reported to the receivers) and waited for,
        `timeout` seconds at most (default: the sender's timeout); past it raises
        SyncTimeoutError with everything left mapped (a copy may still be running):
        call close() again. Closing a closed sender does nothing."""
        with self._state:
            if self._closed:
                return
            check_timeout(timeout, optional=True)
            if self._sending is not None:
                self._stop = f"closed while sending version {self._sending}"
                for board in list(self._boards.values()):
                    board.notify()  # a send waiting on a board looks at the stop now
                if not self._state.wait_for(lambda: self._sending is None,
                                            timeout=self.timeout if timeout is None else timeout):
                    raise SyncTimeoutError(f"sender rank {self.rank}: the send of version {self._sending} did not "
                                           "stop in time; nothing was closed")
            self._closed = True
        if self._worker is not None:
            self._worker.shutdown()  # idle: no send runs
        for opened in self._opened.values():
            opened.close()
        self._opened = {}

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            try:
                self.abort(f"{exc_type.__name__}: {exc}")
            except Exception as failure:  # noqa: BLE001 - the block's own exception is the one raised
                exc.add_note(f"sender rank {self.rank} could not report this failure to its receivers: {failure!r}")
        self.close()
