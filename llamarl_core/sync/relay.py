"""A generator replica's relays: the buckets one receive() forwards to the replicas
it feeds as they land (`Forwarding`), each relay a WeightSender of this rank."""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext

import torch

from .errors import SyncTimeoutError
from .sender import WeightSender
from .stream import P2PStream


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
                stream = P2PStream(relay, relay.rank, version, self.deadline)
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
