"""A queue of messages over a torch.distributed Store (the controller's own
TCPStore on one host, the rendezvous's Store under torchrun): how the
controller and its executors talk. Nothing here knows the pipeline.

A queue is a counter and one key per message in a namespace of the Store:
`put` takes the next number from the counter (`add`) and writes the message under
it (`compare_set` into the empty slot); the one consumer reads the numbers in
order. A slot numbered but never written (its producer died in between) is
skipped after LOST_SLOT_S by writing a tombstone into it; a producer that was
only slow finds the tombstone and writes its message under a new number.

A TCPStore client serves one request at a time: a `wait` on it holds up every
other request of its process (measured: an `add` issued during a 5 s `wait` on the
same client returned after 4.8 s). So a consumer's reader waits on a connection of
its own (`Store.clone`), and everything else here makes short requests on the
connection it is given: give one that nothing blocks in a long `wait`. Connections
are not made per queue: each new one stalled the others' next request by about
200 ms here (100 x (clone + add + add on another connection): 20 s).

Anyone who reaches the Store's port can read and write its keys, so nothing read
from it is trusted: a message is data only (wire.py: JSON and raw bytes, never
unpickled) and carries an HMAC tag under the run's secret (auth.py) bound to its
queue and number, so a message copied to another queue or slot does not verify
either. The consumer drops a message that fails its tag or does not parse,
counts it (`dropped`, and auth.refused_count) and logs its key; it never reaches the caller. What an
intruder can still do is deny service: bump a counter, delete a key, fill a
slot (each is skipped, not run).
"""

from __future__ import annotations

import atexit
import datetime
import queue
import threading
import time
import weakref

import torch.distributed as dist

from . import auth, wire

# A consumer's reader waits for the next message this long at a time. Each wait
# that times out makes c10d print two warning lines, so it is long; the reader is
# woken by the next message (or by `close`), never by this timeout in a live run.
READER_WAIT_S = 3600.0
# A slot the counter handed out but nobody wrote this long after later ones were
# written: its producer died between `add` and `compare_set`. A SIGKILL lands
# there more often than that window suggests (the kill comes while the process waits
# for the add's answer): with 5 s here, a generator killed while putting samples
# stopped a whole run for 5 s, the reward executor's queue waiting on its slot. A
# producer that is only slow loses nothing (it writes again under a new number), so
# the bound is short. The consumer writes a tombstone into the slot (compare_set:
# never over a real message) and goes on with the next.
LOST_SLOT_S = 0.5
_TOMBSTONE = b"llamarl:lost-message"  # unsigned: one forged only makes a producer write again under a new number


_OPEN: weakref.WeakSet = weakref.WeakSet()  # queues whose reader runs, closed at exit


@atexit.register
def _close_open_queues() -> None:
    """A reader blocked in the Store's wait while the interpreter (or the Store it
    serves) shuts down aborts the process ("terminate called"): wake each first."""
    for open_queue in list(_OPEN):
        open_queue.close()


class QueueClosed(RuntimeError):
    """The Store went away (its host process ended) while a queue was read."""


class StoreQueue:
    """First in, first out, over `store` under `name`: any number of producers
    (`put`, from any process and thread), one consumer (`get`, `get_nowait`).
    Messages are kept in the Store until read and deleted as they are read.
    secret: the run's (auth.py), the same for every producer and the consumer;
    `dropped` counts the messages the consumer refused (forged or malformed)."""

    def __init__(self, store: dist.Store, name: str, secret: bytes):
        self.name, self._secret = name, auth.required_secret(secret, f"queue {name}")
        self.dropped = 0
        self._store = dist.PrefixStore(f"llamarl/queue/{name}/", store)
        self._lock = threading.Lock()  # a put's requests in a row, whichever thread puts
        # The reader's advance (read, delete, count) and the consumer's tombstone are one
        # or the other: a tombstone never goes into a slot just read.
        self._read_lock = threading.Lock()
        self._items: queue.Queue | None = None  # filled by the reader thread, once someone reads
        self._reader: threading.Thread | None = None
        self._head = 0  # the last message number read (the consumer's side)
        self._missing: tuple[int, float] | None = None  # (slot, since when) of a slot not written yet

    # -- producers ---------------------------------------------------------------------
    def put(self, message) -> None:
        """Queue `message` (wire.py's types; TypeError before anything is written otherwise)."""
        self._put_body(wire.encode(message))

    def _put_body(self, body: bytes) -> None:
        with self._lock:
            while True:
                number = self._store.add("tail", 1)
                data = auth.sign(self._secret, self._context(number), body)
                # compare_set answers with the slot's value after it: ours, or what was there first (a
                # tombstone when the consumer gave the slot up, this producer stalled for LOST_SLOT_S; or
                # anything an intruder wrote): then the message goes under a new number.
                if self._store.compare_set(str(number), "", data) == data:
                    return

    def _context(self, number: int) -> str:
        return f"llamarl/queue/{self.name}/{number}"

    # -- the consumer ------------------------------------------------------------------
    def get(self, timeout: float):
        """The next message, or None when none comes within `timeout` seconds.
        QueueClosed when the Store is gone."""
        items = self._start_reader()
        try:
            item = items.get(timeout=timeout)
        except queue.Empty:
            self._skip_lost_slot()
            return None
        return self._unwrap(item)

    def get_nowait(self):
        items = self._start_reader()
        try:
            return self._unwrap(items.get_nowait())
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop the reader (if one runs): it reads up to a close message of its own
        and returns. Messages put after it stay in the Store, which the run owns."""
        _OPEN.discard(self)
        if self._reader is not None and self._reader.is_alive():
            try:
                self._put_body(b"")  # the close message: signed like any other, and no message encodes to b""
            except dist.DistError:
                return  # the Store is gone, and the reader with it
            self._reader.join(timeout=5)

    def _unwrap(self, item):
        if isinstance(item, QueueClosed):
            raise item
        return item

    def _start_reader(self) -> queue.Queue:
        if self._items is None:
            self._items = queue.Queue()
            self._reader = threading.Thread(target=self._read, args=(self._store.clone(), self._items),
                                            name=f"queue-{self.name}", daemon=True)
            self._reader.start()
            _OPEN.add(self)
        return self._items

    def _read(self, connection: dist.Store, items: queue.Queue) -> None:
        """The reader thread: each message in order into `items`, until closed."""
        try:
            while True:
                key = str(self._head + 1)
                try:
                    connection.wait([key], datetime.timedelta(seconds=READER_WAIT_S))
                except dist.DistStoreError:
                    continue  # nothing for an hour: wait again
                with self._read_lock:
                    data = connection.get(key)
                    self._head += 1
                if data == _TOMBSTONE:
                    continue  # kept: a stalled producer must still find it there
                body = auth.verify(self._secret, self._context(int(key)), data)
                if body == b"":
                    connection.delete_key(key)
                    return  # close()
                try:
                    if body is None:
                        raise wire.WireError("its tag does not verify under the run's secret")
                    items.put(wire.decode(body))
                except wire.WireError as exc:
                    self._drop(key, exc)
                # Deleted once the consumer has the message (one round trip off its path); the
                # consumer's tombstones look only past the head, which has moved on.
                connection.delete_key(key)
        except dist.DistError as exc:  # the Store's host is gone
            items.put(QueueClosed(f"queue {self.name}: the Store is gone ({exc})"))

    def _drop(self, key: str, why: Exception) -> None:
        self.dropped += 1
        auth.refuse("dropped the message", self._context(int(key)), str(why))

    def _skip_lost_slot(self) -> None:
        """Called when the consumer found nothing: if the slot the reader waits for
        has stayed empty for LOST_SLOT_S while later slots were handed out, its
        producer died between numbering and writing it; fill it with a tombstone."""
        with self._lock, self._read_lock:
            slot = self._head + 1
            if self._store.add("tail", 0) <= slot or self._store.check([str(slot)]):
                self._missing = None  # nothing after it yet, or it is written and being read
                return
            now = time.monotonic()
            if self._missing is None or self._missing[0] != slot:
                self._missing = (slot, now)
            elif now - self._missing[1] > LOST_SLOT_S:
                self._store.compare_set(str(slot), "", _TOMBSTONE)
                self._missing = None
