"""A queue of messages over a torch.distributed Store (the controller's own
TCPStore on one host, the rendezvous's Store under torchrun): how the
controller and its executors talk. Nothing here knows the pipeline.

A queue is one of the Store's own queues (`queue_push` / `queue_pop`, each one
request that the Store's server does whole): `put` pushes a message, and the one
consumer's reader thread waits for the next in a blocking pop. A producer that
dies mid-put has pushed its message or not; nothing is left half-written for
the consumer to wait on.

A TCPStore client serves one request at a time: a blocking pop on it holds up
every other request of its process (measured: an `add` issued during a 5 s `wait`
on the same client returned after 4.8 s). So a consumer's reader waits on a
connection of its own (`Store.clone`), and everything else here makes short
requests on the connection it is given: give one that nothing blocks in a long
wait. Connections are not made per queue: each new one stalled the others' next
request by about 200 ms here (100 x (clone + add + add on another connection): 20 s).

Anyone who reaches the Store's port can push to and pop from its queues, so
nothing popped is trusted: a message is data only (wire.py: JSON and raw bytes,
never unpickled) and carries an HMAC tag under the run's secret (auth.py) bound
to its queue, over its producer's id (random, one per StoreQueue object) and that
producer's running number. The consumer drops a message whose tag fails (forged,
or copied from another queue), that does not parse, or whose number is not above
the last one it took from that producer (a copy of a message already taken,
pushed again); it counts it (`dropped`, and auth.refused_count) and logs it, and
the caller never sees it. A copy is known as one to the consumer that took the
original: a StoreQueue made later for the same name under the same secret takes
it again, so a queue that outlives a run (the launcher's, on a torchrun job)
signs under a secret of that job's own. What an intruder can still do is deny
service: pop messages, or push ones that are dropped.
"""

from __future__ import annotations

import atexit
import datetime
import queue
import secrets
import struct
import threading
import weakref

import torch.distributed as dist

from . import auth, wire

# A consumer's reader waits for the next message this long at a time. Each wait
# that times out makes c10d print two warning lines, so it is long; the reader is
# woken by the next message (or by `close`), never by this timeout in a live run.
READER_WAIT_S = 3600.0
_KEY = "messages"  # the Store queue, in the queue's namespace
_PRODUCER_BYTES = 16
_NUMBER = struct.Struct(">Q")
_NO_QUEUES = "StoreQueue needs a TCPStore of torch 2.8 or later on its libuv backend (the default; not USE_LIBUV=0)"

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
    (`put`, each process with StoreQueue objects of its own, any thread), one
    consumer (`get`, `get_nowait`). An object does not cross a fork: its
    connection is its process's, and so is its producer id (a child putting
    under its parent's id and count would have its messages taken for copies).
    Messages are kept in the Store until read. Each producer's messages arrive in
    the order it put them; the queue orders those of different producers as the
    Store received them.
    secret: the run's (auth.py), the same for every producer and the consumer;
    `dropped` counts the messages the consumer refused (forged, copied or malformed)."""

    def __init__(self, store: dist.Store, name: str, secret: bytes):
        self.name, self._secret = name, auth.required_secret(secret, f"queue {name}")
        self.dropped = 0
        self._context = f"llamarl/queue/{name}"
        self._store = dist.PrefixStore(f"{self._context}/", store)
        self._lock = threading.Lock()  # a put's number and push in a row, whichever thread puts
        self._producer = secrets.token_bytes(_PRODUCER_BYTES)
        self._sent = 0
        self._taken: dict[bytes, int] = {}  # producer -> the last number the consumer took from it
        self._items: queue.Queue | None = None  # filled by the reader thread, once someone reads
        self._reader: threading.Thread | None = None

    # -- producers ---------------------------------------------------------------------
    def put(self, message) -> None:
        """Queue `message` (wire.py's types; TypeError before anything is written otherwise)."""
        self._push(wire.encode(message))

    def _push(self, body: bytes) -> None:
        with self._lock:
            self._sent += 1
            signed = self._producer + _NUMBER.pack(self._sent) + body
            try:
                self._store.queue_push(_KEY, auth.sign(self._secret, self._context, signed))
            except (AttributeError, NotImplementedError) as exc:
                raise RuntimeError(f"queue {self.name}: this Store has no queues ({exc}): {_NO_QUEUES}") from exc

    # -- the consumer ------------------------------------------------------------------
    def get(self, timeout: float):
        """The next message, or None when none comes within `timeout` seconds.
        QueueClosed when the Store is gone."""
        try:
            return self._unwrap(self._start_reader().get(timeout=timeout))
        except queue.Empty:
            return None

    def get_nowait(self):
        try:
            return self._unwrap(self._start_reader().get_nowait())
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop the reader (if one runs): it reads up to a close message of its own
        and returns. Messages put after it stay in the Store, which the run owns."""
        _OPEN.discard(self)
        if self._reader is not None and self._reader.is_alive():
            try:
                self._push(b"")  # the close message: signed like any other, and no message encodes to b""
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
            connection = self._store.clone()
            connection.set_timeout(datetime.timedelta(seconds=READER_WAIT_S))
            self._reader = threading.Thread(target=self._read, args=(connection, self._items),
                                            name=f"queue-{self.name}", daemon=True)
            self._reader.start()
            _OPEN.add(self)
        return self._items

    def _read(self, connection: dist.Store, items: queue.Queue) -> None:
        """The reader thread: each message in order into `items`, until closed."""
        try:
            while True:
                try:
                    data = connection.queue_pop(_KEY, block=True)
                except dist.DistStoreError:
                    continue  # nothing for an hour: wait again
                body = self._open(data)
                if body == b"":
                    return  # close()
                if body is not None:
                    try:
                        items.put(wire.decode(body))
                    except wire.WireError as exc:
                        self._drop(exc)
        except dist.DistError as exc:  # the Store's host is gone
            items.put(QueueClosed(f"queue {self.name}: the Store is gone ({exc})"))
        except (AttributeError, NotImplementedError) as exc:
            items.put(QueueClosed(f"queue {self.name}: this Store has no queues ({exc}): {_NO_QUEUES}"))

    def _open(self, data: bytes) -> bytes | None:
        """The body of a popped item, or None (dropped) if it is not a message of this
        queue that the consumer has not taken before."""
        signed = auth.verify(self._secret, self._context, data)
        if signed is None or len(signed) < _PRODUCER_BYTES + _NUMBER.size:
            self._drop("its tag does not verify under the run's secret")
            return None
        producer = signed[:_PRODUCER_BYTES]
        (number,) = _NUMBER.unpack_from(signed, _PRODUCER_BYTES)
        if number <= self._taken.get(producer, 0):
            self._drop(f"a copy of message {number} of producer {producer.hex()[:8]}, taken before")
            return None
        self._taken[producer] = number
        return signed[_PRODUCER_BYTES + _NUMBER.size:]

    def _drop(self, why) -> None:
        self.dropped += 1
        auth.refuse("dropped the message", f"{self._context}/{_KEY}", str(why))
