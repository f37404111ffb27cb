"""A heartbeat over a torch.distributed Store: a process bumps a counter while it
lives (Heartbeat), another tells when the counter stopped moving (HeartbeatWatch).
The counter is a Store key anyone on the network can bump or delete: a watch
can be fooled into seeing a dead process alive, never into running anything."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist


class Heartbeat:
    """A thread that bumps the counter `key` of `store` every `every_s` seconds
    while the process lives; `HeartbeatWatch` on the other side tells when it stopped."""

    def __init__(self, store: dist.Store, key: str, every_s: float = 1.0):
        self._store, self._key, self._every_s = store, key, every_s
        self._stop = threading.Event()
        self._store.add(key, 1)  # the first beat before the constructor returns: a watcher can count from it
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{key}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            try:
                self._store.add(self._key, 1)
            except dist.DistError:
                return  # the Store is gone: nobody to tell

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class HeartbeatWatch:
    """Says whether the Heartbeat at `key` has beaten within the last `grace_s`
    seconds (a process that never beat gets `grace_s` from the watch's creation)."""

    def __init__(self, store: dist.Store, key: str, grace_s: float):
        self._store, self._key, self.grace_s = store, key, grace_s
        self._last_count, self._last_change = self._store.add(key, 0), time.monotonic()

    def silent_for(self) -> float:
        """Seconds since the beat last changed (0 when it just did)."""
        count = self._store.add(self._key, 0)
        now = time.monotonic()
        if count != self._last_count:
            self._last_count, self._last_change = count, now
        return now - self._last_change

    def alive(self) -> bool:
        return self.silent_for() <= self.grace_s
