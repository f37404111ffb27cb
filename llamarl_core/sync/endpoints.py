"""WeightSender (trainer ranks) and WeightReceiver (generator ranks).

Set-up, once: each side registers its tensors and its layout; layouts, device
infos and memory handles are exchanged through a torch.distributed Store
(TCPStore or FileStore) under `llamarl/sync/<name>/`; each rank computes the
same plan and the transport all ranks agree on (transports.py).

Every sync, one call on each side:
- `receiver.receive()` checks that its tensors still own the storage registered
  (else raises, before any byte moves), waits until the kernels already queued
  on its device's current stream (the generator's last decode step, which may
  still read the weights) have completed, then opens a ticket (the generator is
  now paused between decode steps: its tensors may change), waits until every
  sender that writes to it reports the ticket done, and only then reports the
  version. On a timeout or a disagreement on the version it raises, keeps the
  last complete version, and refuses to serve the torn tensors (`weights()`
  raises TornWeightsError) until a complete version lands.
- `sender.send(version)` writes its segments straight into each receiver's
  parameter storage (shared memory or CUDA IPC) or sends packed buckets over
  the process group (p2p), and returns only once every byte it reads from its
  tensors has been copied. This is the version lock: the trainer's next
  optimizer step, which runs after send() returns, can never tear a copy, so no
  snapshot of the trainer's weights is needed.

Every wait has a timeout that raises SyncTimeoutError; every failure raises a
SyncError, and only once no copy this process queued is still running (a GPU
that stays hung 60 s past the deadline is the exception, and the error says so).
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import nullcontext
from dataclasses import replace
from typing import Iterable, Mapping

import numpy as np
import torch
import torch.distributed as dist

from .engine import (
    DEFAULT_COPY_TIMEOUT_S,
    check_local_tensors,
    prepared_table,
    run_segment_table,
    segment_table,
    storage_key,
    tensors_device,
    wait_for_queued_work,
)
from .errors import RelayError, StaleReceiveError, SyncError, SyncTimeoutError, TornWeightsError
from .fp8 import Fp8Destinations, reduce_max
from .layout import Layout
from .plan import (
    DEFAULT_BUCKET_BYTES,
    Segment,
    TransferPlan,
    bipartite_rounds,
    check_replicas,
    plan_transfer,
    relay_tree,
)
from .transports import (
    CUDA_IPC,
    P2P,
    SHM,
    OpenedCudaHandles,
    check_transport_name,
    choose_transports,
    cuda_ipc_handle,
    device_info,
    make_process_group,
    open_shm_handle,
    rehome_into_shared_memory,
    shm_handle,
)

DEFAULT_TIMEOUT_S = 120.0
# The largest point-to-point bucket of a sync into generator replicas (shared memory
# and CUDA IPC keep theirs: there a bucket is a unit of work). A replica forwards a bucket
# to the next one once all of it has landed, so a relay level adds about one
# bucket's transfer: 16 MiB is 0.13 s at 1 Gbit/s, 1.3 ms at 100. With the default
# 256 MiB a 129 MiB model crossed 1 Gbit hosts in one large bucket per rank pair,
# and one relay level added 0.8 s to a 1.1 s sync.
RELAY_BUCKET_BYTES = 16 << 20
_SRC, _DST = "src", "dst"
# Set by abandon_receivers: the reason under this key, and this value in the tickets it opens.
_ABANDONED = "abandoned"
# What a receiver writes over its ticket's `open` value when it closes the ticket: a
# sender waiting for the ticket after the one it served last sees it there.
_CLOSED = "closed"
# How long a sender waits for a ticket to open before it reads the receiver's counter
# again (a ticket taken and never opened, by a receiver killed in between, is skipped
# once a newer one is taken).
_TICKET_POLL_S = 1.0


class _Channel:
    """The Store, namespaced, with JSON values and waits that always time out."""

    def __init__(self, store: dist.Store, name: str):
        self.store = dist.PrefixStore(f"llamarl/sync/{name}/", store)

    def set(self, key: str, value) -> None:
        self.store.set(key, json.dumps(value))

    def get(self, key: str):
        return json.loads(self.store.get(key))

    def wait(self, keys: list[str], deadline: float, what: str) -> None:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise dist.DistStoreError("deadline passed")
            # At least 1 ms: a timeout that rounds down to 0 ms means "no timeout" to c10d.
            self.store.wait(keys, datetime.timedelta(seconds=max(remaining, 1e-3)))
        except RuntimeError as exc:
            raise self._timeout(exc, keys, what) from exc

    def get_all(self, keys: list[str], deadline: float, what: str) -> list:
        """The values of `keys` once every one is set, within the deadline: a wait
        (the Store answers it when the last is set), then one read of them all. The
        client's own timeout is never touched (it may be shared)."""
        self.wait(keys, deadline, what)
        return [json.loads(v) for v in self.store.multi_get(keys)]

    def _timeout(self, exc: RuntimeError, keys: list[str], what: str) -> Exception:
        """The SyncTimeoutError of a wait that failed with `exc`, or `exc` itself when
        it was not a timeout. A timeout is a DistStoreError from TCPStore and
        HashStore but a plain RuntimeError ("Wait timeout") from FileStore; other
        DistErrors (a lost connection: DistNetworkError) are not timeouts."""
        if isinstance(exc, dist.DistError) and not isinstance(exc, dist.DistStoreError):
            return exc
        missing = [k for k in keys if not self.store.check([k])]
        return SyncTimeoutError(f"timed out waiting for {what} (missing {missing})")

    def counter(self, key: str, delta: int = 0) -> int:
        return self.store.add(key, delta)

    def has(self, key: str) -> bool:
        return self.store.check([key])


class _Endpoint:
    """Shared set-up of both sides.

    store: a torch.distributed Store every sender and receiver reaches.
    layout / rank / tensors: this side's layout, this process's rank in it, and
    its local tensors (name -> tensor). name: namespaces the Store keys, so
    several syncs can share one Store. transport: 'auto', 'shm', 'cuda_ipc' or
    'p2p' (torch.distributed, the path used across machines). timeout: seconds,
    for set-up and the default of every call. bucket_bytes: see plan_transfer;
    sender rank 0's value is used by every rank. p2p_bucket_bytes (receivers): a
    cap on the buckets of point-to-point pairs; receiver rank 0's applies.
    num_threads: host copy threads (default: LLAMARL_COPY_THREADS or all cores).
    relay_buckets: set by a WeightReceiver on the sender that relays to the next
    replica: that pair's buckets, mirroring the ones it receives, in arrival
    order; the receiving replica reads them from the Store.
    """

    side = ""

    def __init__(
        self,
        store: dist.Store,
        layout: Layout,
        rank: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        name: str = "weights",
        transport: str = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        num_threads: int | None = None,
        relay_buckets: list | None = None,
        p2p_bucket_bytes: int | None = None,
    ):
        if not 0 <= rank < layout.world_size:
            raise ValueError(f"{self.side} rank {rank} is outside the layout's world size {layout.world_size}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        check_transport_name(transport)
        if bucket_bytes <= 0 or (p2p_bucket_bytes is not None and p2p_bucket_bytes <= 0):
            raise ValueError(f"bucket sizes must be positive, got bucket_bytes={bucket_bytes}, "
                             f"p2p_bucket_bytes={p2p_bucket_bytes}")
        check_local_tensors(layout, rank, tensors, self.side)
        self.layout, self.rank, self.timeout = layout, rank, timeout
        self.tensors = dict(tensors)
        self.device = tensors_device(self.tensors, f"{self.side} rank {rank}")
        self.num_threads = num_threads
        self.channel = _Channel(store, name)
        self._closed = False

        deadline = time.monotonic() + timeout
        me = _SRC if self.side == "sender" else _DST
        exported = self.tensors if me == _DST else None  # receivers' memory is what CUDA IPC exports
        if me == _SRC:  # before the info key, which receivers wait for
            self.channel.set(f"{_SRC}/{rank}/relay_buckets", relay_buckets)
        self.channel.set(f"{me}/{rank}/info", {**device_info(self.device, exported), "transport": transport})
        if rank == 0:  # before the layout, which the other side waits for
            self.channel.set(f"{me}/bucket_bytes", bucket_bytes if me == _SRC else p2p_bucket_bytes)
            if me == _SRC:  # the receivers' cap applies only where the senders know it too (not older senders)
                self.channel.set(f"{_SRC}/reads_p2p_cap", True)
            self.channel.set(f"{me}/layout", layout.to_dict())
        self.channel.wait([f"{_SRC}/layout", f"{_DST}/layout"], deadline, "both sides' layouts")
        bucket_bytes = self.channel.get(f"{_SRC}/bucket_bytes")  # both sides must bucket alike (p2p)
        p2p_cap = self._get_if_set(f"{_DST}/bucket_bytes") if self.channel.has(f"{_SRC}/reads_p2p_cap") else None
        if Layout.from_dict(self.channel.get(f"{me}/layout")) != layout:
            raise ValueError(f"{self.side} rank {rank}: its layout differs from the one rank 0 registered")
        other = _DST if me == _SRC else _SRC
        other_layout = Layout.from_dict(self.channel.get(f"{other}/layout"))
        src_layout, dst_layout = (layout, other_layout) if me == _SRC else (other_layout, layout)
        self.plan: TransferPlan = plan_transfer(src_layout, dst_layout, bucket_bytes)
        info_keys = [f"{_SRC}/{r}/info" for r in range(src_layout.world_size)]
        info_keys += [f"{_DST}/{r}/info" for r in range(dst_layout.world_size)]
        self.channel.wait(info_keys, deadline, "every rank's device info")
        infos = [self.channel.get(k) for k in info_keys]
        requested = {i["transport"] for i in infos}
        if len(requested) > 1:
            raise ValueError(f"ranks asked for different transports {sorted(requested)}; pass the same to every rank")
        self._src_infos, self._dst_infos = infos[: src_layout.world_size], infos[src_layout.world_size :]
        # One transport per (sender, receiver) pair; every rank computes the same.
        self.transports = choose_transports(transport, self._src_infos, self._dst_infos, self.plan.pairs)
        # What the sync uses, e.g. "shm", or "p2p+shm" where some pairs span hosts.
        self.transport = "+".join(sorted(set(self.transports.values())))
        own_pairs = [(rank, d) for d in self.plan.receivers_of(rank)] if me == _SRC else [
            (s, rank) for s in self.plan.senders_of(rank)]
        for pair in own_pairs:
            if p2p_cap is not None and self.transports[pair] == P2P:
                self.plan.cap_buckets(pair, p2p_cap)
            relayed = relay_buckets if me == _SRC else self._get_if_set(f"{_SRC}/{pair[0]}/relay_buckets")
            if relayed is not None:
                self.plan.buckets[pair] = self._relayed_buckets(relayed, pair)
        # Point-to-point pairs run round by round, each round a matching (no rank in two pairs).
        self._p2p_rounds = bipartite_rounds(pair for pair, t in self.transports.items() if t == P2P)
        # This rank's point-to-point peers (receivers of a sender, senders of a receiver), in round order.
        own, peer = (0, 1) if me == _SRC else (1, 0)
        self._p2p_peers = [pair[peer] for pairs in self._p2p_rounds for pair in pairs if pair[own] == rank]
        # A rank registered again under the same name (a restarted process) gets a
        # higher incarnation; point-to-point pairs cannot take it back: the process
        # group's rendezvous keys in the Store serve one group once.
        self._incarnation = self.channel.counter(f"{me}/{rank}/incarnation", 1)
        if self._incarnation > 1 and self._p2p_peers:
            raise ValueError(f"{self.side} rank {rank} registered again under the name {name!r}, but it has "
                             "point-to-point pairs, which cannot be rejoined: register every sender and receiver "
                             "again under a new name")
        self.group = None
        if self._p2p_rounds:
            num_src = src_layout.world_size
            self.group = make_process_group(
                dist.PrefixStore("pg/", self.channel.store),
                rank if me == _SRC else num_src + rank,
                num_src + dst_layout.world_size,
                self.device.type,
                timeout,
            )

    def _get_if_set(self, key: str):
        """The key's value, None if it was never set (a get would wait out the Store's timeout)."""
        return self.channel.get(key) if self.channel.has(key) else None

    def _relayed_buckets(self, relayed: list, pair: tuple[int, int]) -> list[tuple[Segment, ...]]:
        """The buckets of a relay pair (rank r of one replica to rank r of the next, one
        layout) in its sender's order: each segment copies a region of a tensor to the
        same region of the same tensor. Checked to stay inside the tensors and to
        write exactly the bytes the plan's own buckets write, none twice."""
        src, dst = pair
        where = f"{self.side} rank {self.rank}: the relay buckets of pair {src} -> {dst}"
        if src != dst or self.plan.src_layout != self.plan.dst_layout:
            raise ValueError(f"{where}: not a relay between replicas of one layout")
        buckets = []
        for bucket in relayed:
            segments = []
            for name, offset, pitch, width, height in bucket:
                tensor = self.tensors.get(name)
                itemsize = tensor.element_size() if tensor is not None else 0
                row = width * itemsize  # the pitch of a single row is unused
                if tensor is None or not (0 <= offset and 0 < row and height > 0 and (height == 1 or row <= pitch)
                                          and offset + (height - 1) * pitch + row <= tensor.nbytes):
                    raise ValueError(f"{where}: segment {name!r} at byte {offset} ({height} x {width}, pitch {pitch}) "
                                     "is not inside a tensor of this rank")
                segments.append(Segment(src, name, offset, pitch, dst, name, offset, pitch, width, height, itemsize,
                                        False))
            buckets.append(tuple(segments))
        given, planned = (_written_runs([s for b in bs for s in b]) for bs in (buckets, self.plan.buckets[pair]))
        if given is None or planned is None:
            raise ValueError(f"{where} write some bytes twice")
        if given.keys() != planned.keys() or any(not np.array_equal(given[n], planned[n]) for n in given):
            raise ValueError(f"{where} do not write the bytes the plan writes")
        return buckets

    def _deadline(self, timeout: float | None) -> float:
        if self._closed:
            raise SyncError(f"{self.side} rank {self.rank} is closed")
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    @staticmethod
    def _copy_timeout(deadline: float) -> float:
        """What is left of the call's deadline for a device copy (never more than the engine's cap)."""
        return min(DEFAULT_COPY_TIMEOUT_S, max(deadline - time.monotonic(), 1e-3))

    def _wait_work(self, work, deadline: float, what: str) -> None:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0 or not work.wait(datetime.timedelta(seconds=remaining)):
                raise SyncTimeoutError(f"{what} did not complete in time")
        except RuntimeError as exc:
            if isinstance(exc, SyncError):
                raise
            raise _p2p_failure(what, exc) from exc

    def _post(self, op: str, tensor: torch.Tensor, peer: int, tag: int, what: str):
        """Post a point-to-point `op` ("send" / "recv") on the group; returns its work.
        Gloo may refuse already at posting (a pair closed by an earlier timeout)."""
        try:
            return getattr(self.group, op)([tensor], peer, tag)
        except RuntimeError as exc:
            raise _p2p_failure(what, exc) from exc

    def _staging(self, pair_buckets) -> list[torch.Tensor]:
        """Staging for the p2p transport, from each p2p pair's buckets: bucket i goes
        through buffer i % 2, so packing (or unpacking) one bucket overlaps the
        transfer of the next. The second buffer, one more bucket of memory (256 MiB by
        default, 16 MiB into generator replicas), only where some pair has more than
        one bucket."""
        largest = max((sum(seg.nbytes for seg in b) for buckets in pair_buckets for b in buckets), default=0)
        count = 2 if any(len(buckets) > 1 for buckets in pair_buckets) else 1
        return [torch.empty(largest, dtype=torch.uint8, device=self.device) for _ in range(count)]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def abandon_receivers(store: dist.Store, name: str, reason: str) -> None:
    """The receivers of sync `name` are gone for good (their processes died; new
    ones register under another name): a send waiting for one of them to ask for a
    version raises SyncError naming `reason` at once instead of at its timeout.
    Called by whoever watches the receivers' processes (the pipeline's controller)."""
    channel = _Channel(store, name)
    channel.set(_ABANDONED, reason)
    if not channel.has(f"{_DST}/layout"):
        return  # never registered: no sender can be waiting for a ticket
    for rank in range(Layout.from_dict(channel.get(f"{_DST}/layout")).world_size):
        # Wake the senders waiting for a ticket to open: the next one, and the last one taken,
        # which a receiver killed between taking it and opening it never opened. The mark in
        # its place makes them raise; a ticket opened already is left as it is.
        last = channel.counter(f"{_DST}/{rank}/ticket")
        for ticket in (last, last + 1):
            if ticket and not channel.has(f"{_DST}/{rank}/open/{ticket}"):
                channel.set(f"{_DST}/{rank}/open/{ticket}", _ABANDONED)


def relay_name(name: str, replica: int) -> str:
    """The Store namespace of the sync that fills `replica` (replica 0: the trainer's)."""
    return f"{name}/replica{replica}" if replica else name


def _p2p_failure(what: str, exc: RuntimeError) -> SyncError:
    """The sync's error for a failed point-to-point op: gloo reports its own timeouts
    as RuntimeError ("Timed out waiting ..."), which is a SyncTimeoutError here."""
    if "Timed out" in str(exc):
        return SyncTimeoutError(f"{what} did not complete in time: {exc}")
    return SyncError(f"{what} failed (a peer died or its connection broke): {exc}")


def _written_runs(segments: list[Segment]) -> dict[str, np.ndarray] | None:
    """Destination tensor -> the byte runs the segments write, merged: rows of
    [start, end), sorted; None if two segments write a byte twice."""
    rows: dict[str, list] = {}
    for seg in segments:
        starts = seg.dst_offset + seg.dst_pitch * np.arange(seg.height, dtype=np.int64)
        rows.setdefault(seg.dst_name, []).append(np.stack([starts, starts + seg.width * seg.itemsize], axis=1))
    runs = {}
    for name, parts in rows.items():
        spans = np.concatenate(parts)
        spans = spans[np.argsort(spans[:, 0], kind="stable")]
        if (spans[1:, 0] < spans[:-1, 1]).any():
            return None
        joined = np.flatnonzero(spans[1:, 0] != spans[:-1, 1]) + 1  # where a new run begins
        runs[name] = np.stack([spans[np.r_[0, joined], 0], spans[np.r_[joined - 1, len(spans) - 1], 1]], axis=1)
    return runs


def _packed(bucket: tuple[Segment, ...]) -> tuple[list[Segment], list[Segment]]:
    """(pack, unpack) segments moving a bucket through a dense staging buffer:
    pack reads the source tensors (casting) into staging, unpack copies staging
    into the destination tensors."""
    pack, unpack, offset = [], [], 0
    for seg in bucket:
        row = seg.width * seg.itemsize
        pack.append(replace(seg, dst_offset=offset, dst_pitch=row))
        unpack.append(replace(seg, src_offset=offset, src_pitch=row, cast=False))
        offset += seg.nbytes
    return pack, unpack


class WeightSender(_Endpoint):
    """A trainer rank: registers its shard tensors once, then `send(version)` per step.

    tensors: local parameter name -> shard tensor, shapes and dtypes as `layout`
    says for `rank`, contiguous, all on one device. They are read in place (no
    copy is kept); if their storage moves between sends, they are checked and
    their addresses resolved again.
    """

    side = "sender"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.receivers = self.plan.receivers_of(self.rank)
        local = [d for d in self.receivers if self.transports[(self.rank, d)] != P2P]
        # Start with a different receiver on each sender so they do not all queue on one.
        shift = self.rank % len(local) if local else 0
        self._local_receivers = local[shift:] + local[:shift]
        self._served: dict[int, int] = {}
        if self._incarnation > 1:
            # A restarted sender: a receive() open now, where other senders write too, may
            # hold their previous version beside the predecessor's partial writes; joining
            # it would mix versions: serve from the next ticket on. A receiver this rank
            # alone writes (a relay's child rank) is served at once: all of it is written
            # again, and it may be waiting for exactly the version the predecessor died on.
            self._served = {dst: self.channel.counter(f"{_DST}/{dst}/ticket") for dst in local
                            if len(self.plan.senders_of(dst)) > 1}
        self._opened: list = []
        self._dst_addresses: dict[int, dict[str, int]] = {}
        deadline = time.monotonic() + self.timeout
        for dst in self._local_receivers:
            self.channel.wait([f"{_DST}/{dst}/handle"], deadline, f"receiver {dst}'s memory handle")
            handle = self.channel.get(f"{_DST}/{dst}/handle")
            if self.transports[(self.rank, dst)] == SHM:
                region, addresses = open_shm_handle(handle)
                self._opened.append(region)
            else:
                opened = OpenedCudaHandles(handle, self.device)
                self._opened.append(opened)
                addresses = opened.addresses
            self._dst_addresses[dst] = addresses
        self._staging_bufs = self._staging([self.plan.buckets[(self.rank, d)] for d in self._p2p_peers])
        self._build_tables()

    def _build_tables(self) -> None:
        self._src_keys = {name: storage_key(t) for name, t in self.tensors.items()}
        src_base = lambda seg: self._src_keys[seg.src_name][0]  # noqa: E731
        self._tables: dict[int, list] = {}
        for dst in self._local_receivers:
            addresses = self._dst_addresses[dst]
            tables = [segment_table(b, src_base, lambda seg: addresses[seg.dst_name])
                      for b in self.plan.buckets[(self.rank, dst)]]
            if self.device.type == "cuda":
                # One launch of the copy kernel for all of them (a bucket is a unit of the
                # host engine's work): uploaded once, run at every send.
                tables = [prepared_table(np.concatenate(tables), self.device)] if tables else []
            self._tables[dst] = tables
        for dst in self._p2p_peers:
            self._tables[dst] = []
            for i, bucket in enumerate(self.plan.buckets[(self.rank, dst)]):
                staging = self._staging_bufs[i % 2].data_ptr()
                table = prepared_table(segment_table(_packed(bucket)[0], src_base, lambda seg: staging), self.device)
                self._tables[dst].append((table, sum(seg.nbytes for seg in bucket)))

    def _receiver_gone(self, dst: int) -> SyncError:
        return SyncError(f"sender rank {self.rank}: receiver {dst} is gone ({self.channel.get(_ABANDONED)})")

    def _await_ticket(self, dst: int, deadline: float) -> tuple[int, int | None]:
        """(ticket, version asked for) of receiver `dst`'s open receive() that this
        sender has not served. Raises SyncError at once if the receivers were abandoned
        (abandon_receivers). Receivers take tickets one after the other, so the one
        after the ticket served last is usually the next to open: its `open` key is
        waited for without reading the counter first. When a candidate is closed
        unserved (a receive that timed out), or not opened within _TICKET_POLL_S (a
        receiver killed after taking it; a slow one), the receiver's counter names
        the current ticket: the candidate becomes that ticket if it is still open,
        else the one after it."""
        last = self._served.get(dst, 0)
        candidate = last + 1
        what = f"receiver {dst} to ask for a version"
        while True:
            try:
                poll = min(deadline, time.monotonic() + _TICKET_POLL_S)
                wanted = self.channel.get_all([f"{_DST}/{dst}/open/{candidate}"], poll, what)[0]
            except SyncTimeoutError:
                if time.monotonic() >= deadline:
                    raise
                wanted = _CLOSED  # not opened yet: look again below
            if wanted == _ABANDONED or (wanted == _CLOSED and self.channel.has(_ABANDONED)):
                raise self._receiver_gone(dst)
            if wanted != _CLOSED:
                return candidate, wanted
            current = self.channel.counter(f"{_DST}/{dst}/ticket")
            is_open = current > last and not self.channel.has(f"{_DST}/{dst}/closed/{current}")
            candidate = current if is_open else max(current, last) + 1

    def send(self, version: int, timeout: float | None = None) -> int:
        """Move `version` of this rank's shards to every receiver that needs them;
        returns the bytes written. Raises SyncTimeoutError if a receiver does not
        ask for a version, or a transfer does not finish, within the timeout."""
        deadline = self._deadline(timeout)
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        if any(storage_key(t) != self._src_keys[n] for n, t in self.tensors.items()):
            check_local_tensors(self.layout, self.rank, self.tensors, self.side)
            self._build_tables()
        written = 0
        # Receivers on this host first: their receive() opens its ticket before it
        # waits on any point-to-point peer, so these copies never wait on a round.
        for dst in self._local_receivers:
            ticket, wanted = self._await_ticket(dst, deadline)
            while wanted is not None and wanted < version:
                # The receive asks for an older version, which nobody will send now (its sender
                # died): tell it so, untouched, rather than fill it with this one, then serve the
                # receive that follows.
                self.channel.set(f"{_DST}/{dst}/done/{ticket}/{self.rank}", {"abandoned": wanted, "holds": version})
                self._served[dst] = ticket
                ticket, wanted = self._await_ticket(dst, deadline)
            for table in self._tables[dst]:
                written += run_segment_table(table, self.device, self.num_threads, self._copy_timeout(deadline))
            self.channel.set(f"{_DST}/{dst}/done/{ticket}/{self.rank}", version)
            self._served[dst] = ticket
        for dst in self._p2p_peers:  # in round order
            written += _P2PStream(self, dst, version, deadline).finish()
        return written

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for opened in self._opened:
            opened.close()
        self._opened = []


class _P2PStream:
    """One version from a sender to one point-to-point receiver: a header (tag 0:
    version, bucket count), then bucket i packed into staging buffer i % 2 and sent
    (tag 1 + i), so that packing bucket i + 1 overlaps the send of bucket i.
    Packing is done when run_segment_table returns (on GPU its stream waited for
    the current one, so the optimizer's pending writes came first): what is in
    flight reads the staging buffers only, never the sender's tensors. `forward`
    sends the buckets one at a time (a relay sends each as it lands on its own
    rank); `finish` sends the rest and waits for every send."""

    def __init__(self, sender: WeightSender, dst: int, version: int, deadline: float):
        self.sender, self.deadline = sender, deadline
        self.peer = sender.plan.src_layout.world_size + dst
        self.tables = sender._tables[dst]
        self.what = f"sending version {version} to receiver {dst}"
        self.header = torch.tensor([version, len(self.tables)], dtype=torch.int64, device=sender.device)
        self.in_flight = [sender._post("send", self.header, self.peer, 0, self.what), None, None]
        self.sent = 0  # buckets posted
        self.written = 0

    def forward(self) -> None:
        """Pack and post the next bucket, once the send still reading its buffer is done."""
        s, i = self.sender, self.sent
        table, nbytes = self.tables[i]
        if self.in_flight[1 + i % 2] is not None:
            s._wait_work(self.in_flight[1 + i % 2], self.deadline, self.what)
        self.written += run_segment_table(table, s.device, s.num_threads, s._copy_timeout(self.deadline))
        self.in_flight[1 + i % 2] = s._post("send", s._staging_bufs[i % 2][:nbytes], self.peer, 1 + i, self.what)
        self.sent += 1

    def finish(self) -> int:
        """Send the buckets not sent yet, wait for every send; returns the bytes packed."""
        while self.sent < len(self.tables):
            self.forward()
        for work in self.in_flight:
            if work is not None:
                self.sender._wait_work(work, self.deadline, self.what)
        return self.written


class _Forwarding:
    """The relays one receive() feeds bucket by bucket (relay buckets mirror the
    receiver's point-to-point buckets, in arrival order: relay bucket k holds the
    regions of received bucket k). At the first header each relay gets a thread of
    its own, which posts the header with that version and sends every bucket once
    it has landed here, waiting on its own sends (on a GPU under a CUDA stream of
    its own, so that no wait of a relay's lands on the stream the receive's copies
    follow); the receiving thread never waits on a child (and could not poll: gloo's
    is_completed() stays False until someone waits on the work). A slow or dead
    child only falls behind; `finish`, once the version has landed here, waits for
    the threads until the deadline. A relay that fails stops, its error kept in
    `failed`; `abort` stops them all at their next bucket, as does a second header
    with another version (the receive fails then: no child may complete it)."""

    def __init__(self, relays: dict[int, WeightSender], deadline: float):
        self.relays, self.deadline = relays, deadline
        self._version: int | None = None
        self._failed: dict[int, str] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._changed = threading.Condition()
        self._landed = 0
        self._all_landed = self._aborted = False

    @property
    def started(self) -> list[int]:
        """The children a relay thread was started for."""
        return list(self._threads)

    @property
    def failed(self) -> dict[int, str]:
        with self._changed:
            return dict(self._failed)

    def start(self, version: int) -> None:
        if self._version is not None:
            if version != self._version:
                self.abort()
            return
        self._version = version
        for child, relay in self.relays.items():
            self._threads[child] = threading.Thread(target=self._feed, args=(child, relay, version), daemon=True,
                                                    name=f"relay-{relay.rank}-to-replica-{child}")
            self._threads[child].start()

    def landed(self) -> None:
        with self._changed:
            self._landed += 1
            self._changed.notify_all()

    def finish(self) -> None:
        """Everything has landed here: let the relays send the rest; wait for them."""
        with self._changed:
            self._all_landed = True
            self._changed.notify_all()
        for child, thread in self._threads.items():
            thread.join(timeout=max(self.deadline - time.monotonic(), 0.0) + 1.0)
            if thread.is_alive():
                self._fail(child, "SyncTimeoutError: the relay's sends did not complete in time")

    def abort(self) -> None:
        with self._changed:
            self._aborted = True
            self._changed.notify_all()

    def _fail(self, child: int, message: str) -> None:
        with self._changed:
            self._failed.setdefault(child, message)

    def _feed(self, child: int, relay: WeightSender, version: int) -> None:
        try:
            with torch.cuda.stream(torch.cuda.Stream(relay.device)) if relay.device.type == "cuda" else nullcontext():
                stream = _P2PStream(relay, relay.rank, version, self.deadline)
                while True:
                    with self._changed:
                        self._changed.wait_for(lambda: self._aborted or self._all_landed or stream.sent < self._landed,
                                               timeout=max(self.deadline - time.monotonic(), 0.0))
                        if self._aborted:
                            self._fail(child, "SyncError: stopped in the middle of the version")  # the lock is an RLock
                            return
                        if stream.sent >= self._landed:
                            if self._all_landed:
                                break
                            raise SyncTimeoutError("the relay waited past the deadline for buckets to land")
                    stream.forward()
                stream.finish()
        except BaseException as exc:  # noqa: BLE001 - any failure is this relay's; receive() reports it
            self._fail(child, f"{type(exc).__name__}: {exc}")


class WeightReceiver(_Endpoint):
    """A generator rank: registers its own parameter tensors once, then
    `receive()` per sync. The destination is the tensors' own storage.

    tensors: vLLM-style local parameter name -> the generator's parameter tensor
    (shapes and dtypes as `layout` says for `rank`). With the shared-memory
    transport (CPU tensors on one machine) the tensors are moved into a shared
    region at registration, values kept: the same tensor objects (and
    nn.Parameters) then live in memory the senders write, so register them
    before anything caches their data pointers.
    group: optional torch.distributed group spanning exactly the receiver ranks
    in rank order (the generator's tensor-parallel group); FP8 amaxes that span
    ranks are then reduced over it, on the tensors' device, instead of through
    Store keys. As with any collective every rank must take part: a NaN on one
    rank fails all at once, but a rank whose receive fails before the exchange
    leaves the others' all-reduce to time out.
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
    """

    side = "receiver"

    def __init__(self, store: dist.Store, layout: Layout, rank: int, tensors: Mapping[str, torch.Tensor], *,
                 group: dist.ProcessGroup | None = None, replica: int = 0, num_replicas: int = 1,
                 relay_names: Mapping[int, str] | None = None, **kwargs):
        check_replicas(layout, num_replicas)
        if not 0 <= replica < num_replicas:
            raise ValueError(f"replica must be in [0, {num_replicas}), got {replica}")
        name = kwargs.pop("name", "weights")
        if num_replicas > 1:
            kwargs["p2p_bucket_bytes"] = min(kwargs.get("p2p_bucket_bytes") or RELAY_BUCKET_BYTES, RELAY_BUCKET_BYTES)
        children = relay_tree(num_replicas)[replica]
        relay_names = {child: relay_name(name, child) for child in children} | dict(relay_names or {})
        if sorted(relay_names) != children:
            raise ValueError(f"relay_names: replica {replica} feeds replicas {children}, got names for "
                             f"{sorted(relay_names)}")
        super().__init__(store, layout, rank, tensors, name=relay_name(name, replica), **kwargs)
        if group is not None and (group.size(), group.rank()) != (self.layout.world_size, self.rank):
            raise ValueError(f"receiver rank {self.rank}: group= must span the {self.layout.world_size} receiver ranks "
                             f"in rank order, got rank {group.rank()} of {group.size()}")
        self._amax_group = group
        self._amax_attempt: tuple[int | None, int] = (None, 0)  # see _amax_sync_id
        # The last ticket this rank took (a restarted rank goes on from its predecessor's,
        # and closes it: a predecessor killed in a receive left it open, or never opened it).
        self._ticket = self.channel.counter(f"{_DST}/{self.rank}/ticket")
        if self._ticket and not self.channel.has(f"{_DST}/{self.rank}/closed/{self._ticket}"):
            self._close_ticket(self._ticket)
        self.version: int | None = None
        self.torn = False
        self.senders = self.plan.senders_of(self.rank)
        self._local_senders = [src for src in self.senders if self.transports[(src, self.rank)] != P2P]
        # What the senders write: the registered tensors, and landing rows for FP8 weights.
        self.fp8 = Fp8Destinations(self.layout, self.rank)
        self.landing = self.fp8.landing(self.tensors, self.device)
        local_transports = {self.transports[(src, self.rank)] for src in self._local_senders}
        if SHM in local_transports:
            # The region stays mapped for as long as the tensors viewing it live.
            region, offsets = rehome_into_shared_memory(self.landing, f"receiver rank {self.rank}")
            self.channel.set(f"{_DST}/{self.rank}/handle", shm_handle(region, offsets))
        elif CUDA_IPC in local_transports:
            # Senders in this process write to the addresses; the others need IPC handles.
            me = self._dst_infos[self.rank]["process"]
            remote = any(self._src_infos[src]["process"] != me for src in self._local_senders)
            self.channel.set(f"{_DST}/{self.rank}/handle", cuda_ipc_handle(self.landing, self.device, remote))
        self._staging_bufs = self._staging([self.plan.buckets[(src, self.rank)] for src in self._p2p_peers])
        self._unpack: dict[int, list] = {}
        for src in self._p2p_peers:
            self._unpack[src] = []
            for i, bucket in enumerate(self.plan.buckets[(src, self.rank)]):
                staging = self._staging_bufs[i % 2].data_ptr()
                table = segment_table(_packed(bucket)[1], lambda seg: staging,
                                      lambda seg: self.landing[seg.dst_name].data_ptr())
                self._unpack[src].append((prepared_table(table, self.device), sum(seg.nbytes for seg in bucket)))
        # Where the senders' segments (and the unpack tables) write: checked before every receive().
        self._landing_keys = {name: storage_key(t) for name, t in self.landing.items()}
        # Set up in the background (see replace_relay): a relay waits for its child's receiver,
        # which may still be starting, or be gone (a child that died as this replica started
        # fails that relay at the first receive, naming it, instead of this replica's start).
        self.replica = replica
        self._store = store
        self._relay_kwargs = {k: kwargs[k] for k in ("transport", "bucket_bytes", "num_threads") if k in kwargs}
        self._relay_regions = self._regions_in_arrival_order()
        self._relays: dict[int, WeightSender | Future] = {
            child: self._relay_in_background(child, relay_names[child]) for child in children}

    def _relay_sender(self, store: dist.Store, name: str) -> WeightSender:
        return WeightSender(store, self.layout, self.rank, self.tensors, name=name, timeout=self.timeout,
                            relay_buckets=self._relay_regions, **self._relay_kwargs)

    def _regions_in_arrival_order(self) -> list | None:
        """What a relay from this rank sends, bucket by bucket: the regions of the
        buckets this rank receives point to point, in the order they arrive, so each
        goes on to the child replica as soon as it has landed (see receive). None (the
        relay plan's own buckets, sent once everything has landed) where a sender on
        this host writes too: its regions land all at once, at the end."""
        if self._local_senders or not self._p2p_peers:
            return None
        return [[[seg.dst_name, seg.dst_offset, seg.dst_pitch, seg.width, seg.height] for seg in bucket]
                for src in self._p2p_peers for bucket in self.plan.buckets[(src, self.rank)]]

    def _forwarded_relays(self, children: list[int]) -> dict[int, WeightSender]:
        """The relays among `children` that receive() feeds bucket by bucket: this rank
        receives point to point only, and the relay is set up and point to point too
        (through shared memory a child is filled after landing, at memory speed)."""
        if self._relay_regions is None:
            return {}
        ready = {}
        for child in children:
            relay = self._relays[child]
            if isinstance(relay, Future) and relay.done() and relay.exception() is None:
                relay = self._relays[child] = relay.result()
            if isinstance(relay, WeightSender) and relay._p2p_peers:
                ready[child] = relay
        return ready

    def _break_relay(self, child: int, reason: str) -> None:
        """The relay to `child` stopped in the middle of a version: the child holds part
        of it, and sends of that version may still wait in the pair. Every later
        receive fails that relay at once, until replace_relay feeds the child anew."""
        self._close_relay(self._relays[child])
        broken = Future()
        broken.set_exception(SyncError(f"the relay to replica {child} broke off in the middle of a version "
                                       f"({reason}); replace_relay feeds the replica again"))
        self._relays[child] = broken

    def replace_relay(self, child: int, name: str) -> None:
        """Feed replica `child` through the sync `name` from now on (a restarted child
        registers its receiver under a new name); the old relay is closed. The new
        one is set up in a thread of its own, on a Store connection of its own: set-up
        waits for the child's receiver to register (seconds, while a new process
        starts), and this rank goes on meanwhile. The next receive() that relays to
        `child` waits for it, within its own timeout."""
        if child not in self._relays:
            raise ValueError(f"replica {self.replica} feeds replicas {sorted(self._relays)}, not {child}")
        self._close_relay(self._relays.pop(child))
        self._relays[child] = self._relay_in_background(child, name)

    def _relay_in_background(self, child: int, name: str) -> Future:
        future, store = Future(), self._store.clone()

        def set_up():
            try:
                future.set_result(self._relay_sender(store, name))
            except BaseException as exc:  # noqa: BLE001 - receive() reports it as this child's relay failure
                future.set_exception(exc)

        # A daemon: a set-up still waiting for a child that never comes must not hold the process at exit.
        threading.Thread(target=set_up, name=f"relay-setup-{self.replica}-{child}", daemon=True).start()
        return future

    @staticmethod
    def _close_relay(relay: WeightSender | Future) -> None:
        if isinstance(relay, Future):  # closed once its set-up ends (it cannot be interrupted)
            relay.add_done_callback(lambda f: f.exception() is None and f.result().close())
        else:
            relay.close()

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
        children = sorted(self._relays) if relay_to is None else sorted(set(relay_to))
        if not set(children) <= set(self._relays):
            raise ValueError(f"relay_to={children}: replica {self.replica} feeds replicas {sorted(self._relays)}")
        forwarding = _Forwarding(self._forwarded_relays(children), deadline)
        try:
            version = self._receive(deadline, expect, forwarding)
        except BaseException as exc:
            forwarding.abort()
            for child in forwarding.started:
                self._break_relay(child, f"this replica's receive failed: {type(exc).__name__}: {exc}")
            raise
        forwarding.finish()
        failed = forwarding.failed
        for child, message in failed.items():
            self._break_relay(child, message)
        for child in children:
            if child in forwarding.relays:
                continue
            try:
                self._ready_relay(child, deadline).send(version, timeout=max(deadline - time.monotonic(), 1e-3))
            except (ValueError, RuntimeError) as exc:  # SyncError, and set-up's errors too; the other children go on
                failed[child] = f"{type(exc).__name__}: {exc}"
        if failed:
            raise RelayError(f"receiver rank {self.rank} of replica {self.replica}: version {version} landed here, but "
                             "relaying it failed: " + "; ".join(f"to replica {c}: {m}" for c, m in failed.items()),
                             version, failed)
        return version

    def _ready_relay(self, child: int, deadline: float) -> WeightSender:
        """The relay to `child`, waiting for its set-up (replace_relay) until `deadline`."""
        relay = self._relays[child]
        if isinstance(relay, Future):
            try:
                relay = relay.result(timeout=max(deadline - time.monotonic(), 0.0))
            except FutureTimeout:
                raise SyncTimeoutError(f"the relay to replica {child} was not set up in time (its receiver has "
                                       "not registered)") from None
            self._relays[child] = relay
        return relay

    def _receive(self, deadline: float, expect: int | None, forwarding: _Forwarding) -> int:
        self._check_storage()
        if not self._local_senders:
            # The unpack copies run on a stream that waits for the current one: the GPU orders them.
            return self._complete(self._receive_p2p(deadline, forwarding), deadline)
        # Senders on this host write from other processes and streams, ordered by
        # nothing but the ticket: open it only once the generator's queued kernels
        # have stopped reading.
        wait_for_queued_work(self.device, deadline, f"the kernels queued on {self.device} (receiver {self.rank})")
        key = f"{_DST}/{self.rank}"
        # This rank alone takes its tickets: counted here and published (a set needs no
        # answer from the Store), before the ticket is opened. Whatever happens from
        # here on, the ticket is closed before receive() returns or raises.
        self._ticket += 1
        ticket = self._ticket
        done = [f"{key}/done/{ticket}/{src}" for src in self._local_senders]
        try:
            self.channel.set(f"{key}/ticket", ticket)
            self.torn = True  # from here on senders may be writing into the tensors
            self.channel.set(f"{key}/open/{ticket}", expect)
            versions = self._receive_p2p(deadline, forwarding)  # senders on other hosts, meanwhile
            answers = self.channel.get_all(done, deadline, f"senders to finish (receiver {self.rank}, ticket {ticket})")
        finally:
            self._close_ticket(ticket)
        stale = [answer for answer in answers if isinstance(answer, dict)]
        if stale:
            message = (f"receiver rank {self.rank}: version {stale[0]['abandoned']} will not come (its sender holds "
                       f"version {stale[0]['holds']})")
            if len(stale) == len(answers) and not versions:
                self.torn = False  # no sender wrote
                raise StaleReceiveError(message)
            raise SyncError(f"{message}; weights torn")
        return self._complete(versions | set(answers), deadline)

    def _close_ticket(self, ticket: int) -> None:
        """No sender may serve `ticket` from now on: _CLOSED over its `open` value (what
        a waiting sender reads), then its closed marker (what the counter's readers check)."""
        key = f"{_DST}/{self.rank}"
        self.channel.set(f"{key}/open/{ticket}", _CLOSED)
        self.channel.set(f"{key}/closed/{ticket}", 1)

    def _check_storage(self) -> None:
        """Refuse to sync into a tensor whose storage moved since registration: the
        senders' tables (and the unpack tables) hold the registered addresses."""
        for name, t in self.landing.items():
            now, then = storage_key(t), self._landing_keys[name]
            if now != then:
                raise SyncError(
                    f"receiver rank {self.rank}: parameter {name!r} moved since registration (data_ptr "
                    f"{then[0]:#x} -> {now[0]:#x}, storage {then[1]} -> {now[1]} bytes, shape {then[2]} -> "
                    f"{now[2]}, {then[3]} -> {now[3]}); the senders write to the registered storage, so nothing "
                    "was written: register a new WeightReceiver after the generator re-allocates its weights"
                )

    def _receive_p2p(self, deadline: float, forwarding: _Forwarding) -> set[int]:
        """The point-to-point senders' buckets, in round order; returns their
        versions. Bucket i arrives in staging buffer i % 2 (tag 1 + i): the receive
        of bucket i + 1 is posted before bucket i is unpacked, and the receive of
        bucket i + 2 into the same buffer only after that unpack has completed.
        Each bucket, once unpacked, goes on to the relays `forwarding` feeds."""
        versions = set()
        self.torn = True
        for src in self._p2p_peers:  # in round order
            header = torch.empty(2, dtype=torch.int64, device=self.device)
            what = f"receiving from sender {src}"
            self._wait_work(self._post("recv", header, src, 0, what), deadline, what)
            version, num_buckets = (int(x) for x in header.tolist())
            tables = self._unpack[src]
            if num_buckets != len(tables):
                raise SyncError(f"sender {src} sends {num_buckets} buckets, the plan has {len(tables)}")
            versions.add(version)
            forwarding.start(version)
            what = f"version {version} from sender {src}"
            pending = self._post("recv", self._staging_bufs[0][: tables[0][1]], src, 1, what) if tables else None
            for i, (table, _) in enumerate(tables):
                self._wait_work(pending, deadline, what)
                if i + 1 < len(tables):
                    pending = self._post("recv", self._staging_bufs[(i + 1) % 2][: tables[i + 1][1]], src, 2 + i, what)
                run_segment_table(table, self.device, self.num_threads, self._copy_timeout(deadline))
                forwarding.landed()
        return versions

    def _complete(self, versions: set[int], deadline: float) -> int:
        """Every segment has landed: adopt the senders' common version."""
        if len(versions) > 1:
            raise SyncError(f"receiver rank {self.rank}: senders sent different versions {sorted(versions)}; weights torn")
        version = versions.pop() if versions else self.version
        if self.fp8.names:
            self._quantize_fp8(version, deadline)
        self.version = version
        self.torn = False
        return self.version

    def _quantize_fp8(self, version: int, deadline: float) -> None:
        """Quantize the landed rows of FP8 weights, with the amaxes that span ranks
        reduced (MAX) over every receiver rank: an all-reduce over `group` when the
        receiver was given one, else through the Store under this receive's sync id
        (`_amax_sync_id`). A rank that received NaN or inf still takes part, so the
        others fail at once instead of timing out."""
        try:
            amaxes, flat = self.fp8.local_amax(self.landing)
            error = None
        except ValueError as exc:
            amaxes, flat, error = None, None, exc
        reduced = flat
        if self.fp8.num_reduced and self.layout.world_size > 1:
            sync_id = self._amax_sync_id(version)
            exchange = self._amax_over_group if self._amax_group is not None else self._amax_through_store
            reduced = exchange(flat, sync_id, deadline)
        if error is not None:
            raise SyncError(f"receiver rank {self.rank}, version {version}: {error}; weights torn") from error
        if reduced is None:
            raise SyncError(f"receiver rank {self.rank}, version {version}: another rank received NaN or inf; weights torn")
        self.fp8.finish(self.landing, self.tensors, amaxes, reduced)

    def _amax_sync_id(self, version: int) -> tuple[int, int]:
        """(version, n), n = how many FP8 exchanges of `version` this rank has begun
        before: equal on every receiver rank for one send of a version, never equal
        for two attempts of one rank, so a retried version never reads a failed
        attempt's values.

        Why not the receive ticket: tickets count receive() calls per rank, and a
        receive that times out before any sender served it (a short timeout, a slow
        trainer) costs that rank a ticket the others spent on a real sync: its
        tickets then trail theirs at every later sync, forever. The version is what
        all ranks of one sync agree on with no extra message (the p2p transport has
        no tickets at all). A rank that missed an exchange (its receive failed
        before it) puts at most the later attempts of that same version out of
        step: they fail (on a peer's "timed-out" marker, or a timeout); the next
        version starts again at n = 0 on every rank. The one pairing this cannot
        tell apart: one version number sent again with other weights while a peer
        still waits in the exchange of the send this rank missed; telling sends
        apart exactly needs an id written by the senders.
        """
        last, n = self._amax_attempt
        self._amax_attempt = (version, n + 1 if last == version else 0)
        return self._amax_attempt

    def _amax_over_group(self, flat: torch.Tensor | None, sync_id: tuple[int, int], deadline: float) -> torch.Tensor | None:
        """MAX all-reduce over the receivers' own group of [amaxes, nonfinite flag,
        sync id, -sync id] (float64: exact for amaxes and ids below 2**53); None if
        a rank received NaN or inf. Ranks at different sync ids (one missed an
        exchange) raise instead of mixing two syncs' amaxes."""
        count = self.fp8.num_reduced
        buf = torch.zeros(count + 5, dtype=torch.float64)
        if flat is None:
            buf[count] = 1
        else:
            buf[:count] = flat
        buf[count + 1 :] = torch.tensor([*sync_id, -sync_id[0], -sync_id[1]], dtype=torch.float64)
        buf = buf.to(self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        what = f"the FP8 amax all-reduce (receiver rank {self.rank}, sync {sync_id})"
        self._wait_work(self._amax_group.allreduce([buf], options), deadline, what)
        buf = buf.cpu()
        highest, lowest = buf[count + 1 : count + 3], -buf[count + 3 :]
        if not torch.equal(highest, lowest):
            raise SyncError(f"{what}: the receiver ranks were at different syncs, from {lowest.tolist()} "
                            f"to {highest.tolist()} (a rank missed an exchange); weights torn")
        return None if buf[count] else buf[:count].to(torch.float32)

    def _amax_through_store(self, flat: torch.Tensor | None, sync_id: tuple[int, int], deadline: float) -> torch.Tensor | None:
        """MAX of every rank's amaxes through the Store keys of this sync id; None if
        a rank received NaN or inf. The last rank done with the keys deletes them:
        a 70B model at TP 8 posts ~42 MB of channel amaxes per sync."""
        prefix = f"{_DST}/amax/{sync_id[0]}/{sync_id[1]}"
        keys = [f"{prefix}/{r}" for r in range(self.layout.world_size)]
        store = self.channel.store
        # Markers are 9 bytes, a vector a multiple of 4: they cannot be confused.
        store.set(keys[self.rank], b"nonfinite" if flat is None else flat.numpy().tobytes())
        try:
            if flat is None:
                return None  # the others need this rank's marker, not the other way round
            try:
                self.channel.wait(keys, deadline, f"the FP8 amaxes of sync {sync_id} from every receiver")
            except SyncTimeoutError:
                # A rank that never comes leaves the keys behind: shrink this rank's to a marker.
                store.set(keys[self.rank], b"timed-out")
                raise
            values = [store.get(k) for k in keys]
        finally:
            if self.channel.counter(f"{prefix}/done", 1) == len(keys):
                for key in [*keys, f"{prefix}/done"]:
                    store.delete_key(key)
        if b"timed-out" in values:
            raise SyncTimeoutError(f"receiver rank {values.index(b'timed-out')} timed out in the FP8 amax exchange "
                                   f"of sync {sync_id}; weights torn")
        if b"nonfinite" in values:
            return None
        return reduce_max([torch.frombuffer(bytearray(v), dtype=torch.float32) for v in values])

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
        for relay in self._relays.values():
            self._close_relay(relay)
