"""A generator replica's relays to the replicas it feeds (`Relays`: each a
WeightSender of the receiving rank's tensors, set up in the background, broken and
replaced), and the buckets one receive() forwards to them as they land (`Forwarding`)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import nullcontext
from typing import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from .delta_pair import SendStats
from .errors import RelayError, SyncError, SyncTimeoutError
from .plan import TransferPlan
from .sender import WeightSender
from .stream import P2PStream


def arrival_regions(plan: TransferPlan, rank: int, p2p_senders: list[int], local_senders: list[int]) -> list | None:
    """What a relay from receiver `rank` sends, bucket by bucket: the regions of the
    buckets it receives point to point (from `p2p_senders`, in round order), in the
    order they arrive, so each goes on to the child replica as soon as it has landed.
    None (the relay plan's own buckets, sent once everything has landed) where a
    sender on its host writes too (`local_senders`): those regions land all at once,
    at the end."""
    if local_senders or not p2p_senders:
        return None
    return [[[seg.dst_name, seg.dst_offset, seg.dst_pitch, seg.width, seg.height] for seg in bucket]
            for src in p2p_senders for bucket in plan.buckets[(src, rank)]]


class Relays:
    """The relays of one receiver rank to the same rank of each replica it feeds
    (plan.relay_tree): child replica -> a WeightSender of the rank's tensors under
    that child's sync name, made by `make_sender(store, name)`. Each is set up in a
    thread of its own, on a Store connection of its own (`store.clone()`): set-up
    waits for the child's receiver, which may still be starting, or be gone (a
    child that died as this replica started fails its relay at the first receive
    that feeds it, naming it, instead of this replica's start). forwarded: whether
    a relay set up point to point is fed bucket by bucket as the version lands
    (the relay's buckets mirror the received ones: `arrival_regions`). rank,
    replica: the receiver's, as errors name them. A relay that breaks off in the
    middle of a version fails every later receive that feeds it, at once, until
    `replace`."""

    def __init__(self, store: dist.Store, names: Mapping[int, str],
                 make_sender: Callable[[dist.Store, str], WeightSender], forwarded: bool, rank: int, replica: int):
        self._store, self._make_sender, self._forwarded = store, make_sender, forwarded
        self.rank, self.replica = rank, replica
        self._relays: dict[int, WeightSender | Future] = {child: self._set_up(child, name)
                                                          for child, name in sorted(names.items())}

    @property
    def children(self) -> list[int]:
        return sorted(self._relays)

    def chosen(self, relay_to: Iterable[int] | None) -> list[int]:
        """The children a receive relays to: `relay_to` (default: every one), checked."""
        children = self.children if relay_to is None else sorted(set(relay_to))
        if not set(children) <= set(self._relays):
            raise ValueError(f"relay_to={children}: replica {self.replica} feeds replicas {self.children}")
        return children

    def start(self, children: list[int], deadline: float) -> Forwarding:
        """A receive that relays to `children` begins: the Forwarding that feeds, as
        buckets land, those whose relay is set up and point to point (through shared
        memory a child is filled after landing, at memory speed)."""
        ready = {}
        for child in children if self._forwarded else ():
            relay = self._relays[child]
            if isinstance(relay, Future) and relay.done() and relay.exception() is None:
                relay = self._relays[child] = relay.result()
            if isinstance(relay, WeightSender) and relay._p2p_peers:
                ready[child] = relay
        return Forwarding(ready, deadline)

    def broke_off(self, forwarding: Forwarding, exc: BaseException) -> None:
        """The receive failed: the relays it started stop, broken (their children hold part of a version)."""
        forwarding.abort()
        for child in forwarding.started:
            self._break(child, f"this replica's receive failed: {type(exc).__name__}: {exc}")

    def complete(self, forwarding: Forwarding, children: list[int], version: int, deadline: float) -> None:
        """`version` landed here: the forwarded relays finish, the other children get
        it now, one after the other. Raises RelayError naming every child that did not
        get it, once all were tried."""
        forwarding.finish()
        failed = forwarding.failed
        for child, message in failed.items():
            self._break(child, message)
        for child in children:
            if child in forwarding.relays:
                continue
            try:
                self.ready(child, deadline).send(version, timeout=max(deadline - time.monotonic(), 1e-3))
            except (ValueError, RuntimeError) as exc:  # SyncError, and set-up's errors too; the other children go on
                failed[child] = f"{type(exc).__name__}: {exc}"
        if failed:
            raise RelayError(f"receiver rank {self.rank} of replica {self.replica}: version {version} landed here, but "
                             "relaying it failed: " + "; ".join(f"to replica {c}: {m}" for c, m in failed.items()),
                             version, failed)

    def ready(self, child: int, deadline: float) -> WeightSender:
        """The relay to `child`, waiting for its set-up until `deadline`; raises what
        broke it, or its set-up's error."""
        relay = self._relays[child]
        if isinstance(relay, Future):
            try:
                relay = relay.result(timeout=max(deadline - time.monotonic(), 0.0))
            except FutureTimeout:
                raise SyncTimeoutError(f"the relay to replica {child} was not set up in time (its receiver has "
                                       "not registered)") from None
            self._relays[child] = relay
        return relay

    def replace(self, child: int, name: str) -> None:
        """Feed replica `child` through the sync `name` from now on (a restarted child
        registers its receiver under a new name); the old relay is closed, the new one
        set up in the background (the next receive that relays to `child` waits for
        it, within its own timeout)."""
        if child not in self._relays:
            raise ValueError(f"replica {self.replica} feeds replicas {self.children}, not {child}")
        self._close(self._relays.pop(child))
        self._relays[child] = self._set_up(child, name)

    def close(self) -> None:
        for relay in self._relays.values():
            self._close(relay)

    def _break(self, child: int, reason: str) -> None:
        """The relay to `child` stopped in the middle of a version: the child holds part
        of it, and sends of that version may still wait in the pair."""
        self._close(self._relays[child])
        broken = Future()
        broken.set_exception(SyncError(f"the relay to replica {child} broke off in the middle of a version "
                                       f"({reason}); replace_relay feeds the replica again"))
        self._relays[child] = broken

    def _set_up(self, child: int, name: str) -> Future:
        future, store = Future(), self._store.clone()

        def set_up():
            try:
                future.set_result(self._make_sender(store, name))
            except BaseException as exc:  # noqa: BLE001 - a receive reports it as this child's relay failure
                future.set_exception(exc)

        # A daemon: a set-up still waiting for a child that never comes must not hold the process at exit.
        threading.Thread(target=set_up, name=f"relay-setup-{name}", daemon=True).start()
        return future

    @staticmethod
    def _close(relay: WeightSender | Future) -> None:
        if isinstance(relay, Future):  # closed once its set-up ends (it cannot be interrupted)
            relay.add_done_callback(lambda f: f.exception() is None and f.result().close())
        else:
            relay.close()


class Forwarding:
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
                stats = SendStats(version)
                stream = P2PStream(relay, relay.rank, version, self.deadline, stats=stats)
                while True:
                    with self._changed:
                        waiting = time.monotonic()
                        self._changed.wait_for(lambda: self._aborted or self._all_landed or stream.sent < self._landed,
                                               timeout=max(self.deadline - time.monotonic(), 0.0))
                        stream.paused(time.monotonic() - waiting)
                        if self._aborted:
                            self._fail(child, "SyncError: stopped in the middle of the version")  # the lock is an RLock
                            return
                        if stream.sent >= self._landed:
                            if self._all_landed:
                                break
                            raise SyncTimeoutError("the relay waited past the deadline for buckets to land")
                    stream.forward()
                stream.finish()
                relay.last_send = stats
        except BaseException as exc:  # noqa: BLE001 - any failure is this relay's; receive() reports it
            self._fail(child, f"{type(exc).__name__}: {exc}")
