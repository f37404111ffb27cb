"""The ticket board: the hand-shake of a receiver with the senders of its host in
shared memory, beside the Store.

Over shared memory or CUDA IPC a version moves in two hand-shakes (protocol.py):
the receiver opens a ticket, each sender on its host waits for it, copies, and
answers; the receiver waits for every answer. Through the Store each of those
waits is a process woken from a blocking read, 50-260 us apiece, more than the
copy of a small model and about a fifth of a 1 GiB copy on an H100. The board
carries the same two facts in a small region of POSIX shared memory that the
receiver creates and every sender of its host maps, with a futex to sleep on:
a waiter wakes within microseconds of the word it waits for.

The Store stays the record: every key protocol.py describes is still written,
in the same order, before the board says it. The board only lets a waiter stop
waiting sooner on the usual path; whatever it does not show (a failure, a version
that will not come, a closed or abandoned ticket, a receiver killed between two
steps) is read from the Store as before:

- the receiver writes the ticket it opened and the version it asks for, and the
  ticket it closed; a sender waiting for ticket t returns at once when t is open
  and not closed (`ticket`), and reads the Store otherwise;
- a sender that served ticket t writes (t, the version, the count of the send)
  in its own slot; the receiver returns once every sender of its host has, and
  falls back to the Store when a sender rang the board instead (`ring`: it left
  an answer that is not a version, or reported a failure) or the Store's failure
  count moved;
- the count of the send that served lets pending() tell an offer already served
  from a new one without waiting for the Store to see its withdrawal.

Layout: int64 words; word 0 holds the 32-bit event counter every write bumps
(board_notify); the receiver's words and each sender's slot are on cache lines
of their own.
Only processes of one user on one host map it (the region is mode 0600 and
opened through /proc/<pid>/fd); its handle travels through the Store under the
sync's tag like every other handle.
"""

from __future__ import annotations

import os
import time
import warnings

from .._native import native

_LINE = 8  # words per cache line
_EVENTS = 0  # line 0: the event counter (32 bits)
_OPENED, _EXPECT, _HAS_EXPECT, _CLOSED = 8, 9, 10, 11  # line 1: the receiver's
_ANSWERS = 16  # line 2: rings (senders, atomic adds)
_SLOTS = 24  # line 3 + s: sender s's [ticket served, version, send count]
_DONE_TICKET, _DONE_VERSION, _DONE_OFFER = 0, 1, 2

# What TicketBoard.ticket says besides "open": not opened yet, or the board shows
# a later ticket or this one closed (the Store says which, and what to serve next).
NOT_YET, MOVED = "not yet", "moved"


def read_ticket(load, candidate: int):
    """TicketBoard.ticket on the words `load(index)` returns, loaded in this order
    while the receiver may be storing (open_ticket: expect, then the ticket;
    close_ticket: the ticket): what it returns held at its last load."""
    opened = load(_OPENED)
    if opened < candidate:
        return MOVED if load(_CLOSED) >= candidate else NOT_YET
    if opened > candidate:
        return MOVED
    has_expect, expect = load(_HAS_EXPECT), load(_EXPECT)
    # Loaded after the two above: were they the next ticket's already, this one's close
    # (stored before them) shows here.
    if load(_CLOSED) >= candidate:
        return MOVED
    return (expect if has_expect else None,)


def board_bytes(num_senders: int) -> int:
    return (_SLOTS + _LINE * num_senders) * 8


class TicketBoard:
    """One receiver rank's board (see the module's docstring). `create` on the
    receiver, `open` on each sender of its host; a process's view stays mapped for
    as long as the object lives (a thread's abort() may still ring it)."""

    def __init__(self, region, num_senders: int):
        self.region, self.num_senders = region, num_senders
        self._base = region.address
        self._c = native()

    @classmethod
    def create(cls, num_senders: int) -> "TicketBoard":
        return cls(native().SharedMemoryRegion.create(board_bytes(num_senders)), num_senders)

    @classmethod
    def create_or_warn(cls, num_senders: int, owner: str) -> "TicketBoard | None":
        """A new board, or None with a warning naming `owner` and why (no room in
        /dev/shm): the hand-shake then goes through the Store alone, as correct
        and slower."""
        try:
            return cls.create(num_senders)
        except native().EngineError as exc:
            warnings.warn(f"{owner}: no ticket board ({exc}); its syncs hand over through the Store alone, "
                          "50-260 us slower per wait", RuntimeWarning, stacklevel=3)
            return None

    @classmethod
    def open(cls, handle: dict, num_senders: int) -> "TicketBoard":
        """Map the board a receiver published (`handle()`), checked to hold a slot per sender."""
        if not isinstance(handle, dict) or handle.get("nbytes") != board_bytes(num_senders):
            raise ValueError(f"a ticket board for {num_senders} senders has {board_bytes(num_senders)} bytes, the "
                             f"receiver published {handle!r}")
        region = native().SharedMemoryRegion.open(handle["pid"], handle["fd"], handle["name"], handle["nbytes"])
        return cls(region, num_senders)

    @classmethod
    def open_or_warn(cls, handle: dict, num_senders: int, owner: str) -> "TicketBoard | None":
        """`open`, or None with a warning naming `owner` and why (the receiver's
        /proc/<pid>/fd cannot be read from here): the receiver then finds this
        sender's answers in the Store, within protocol.FAILURE_POLL_S."""
        try:
            return cls.open(handle, num_senders)
        except native().EngineError as exc:
            warnings.warn(f"{owner}: cannot map the receiver's ticket board ({exc}); each version it serves "
                          "reaches that receiver up to 0.125 s later", RuntimeWarning, stacklevel=3)
            return None

    def handle(self) -> dict:
        return {"pid": os.getpid(), "fd": self.region.fd, "name": self.region.name, "nbytes": self.region.nbytes}

    # ---------------------------------------------------------------- words

    def _address(self, index: int) -> int:
        return self._base + 8 * index

    def _load(self, index: int) -> int:
        return self._c.board_load(self._address(index))

    def _store(self, index: int, value: int) -> None:
        self._c.board_store(self._address(index), value)

    def _slot(self, src: int, field: int) -> int:
        if not 0 <= src < self.num_senders:
            raise ValueError(f"sender rank {src} has no slot on a board of {self.num_senders} senders")
        return _SLOTS + _LINE * src + field

    def notify(self) -> None:
        """Wake every process waiting on the board (after this thread's writes)."""
        self._c.board_notify(self._address(_EVENTS))

    def wait_until(self, ready, until: float):
        """ready()'s first result that is not None, or None once time.monotonic()
        passes `until`; sleeps on the board between looks (a look follows every
        write to it)."""
        while True:
            seen = self._c.board_events(self._address(_EVENTS))
            found = ready()
            if found is not None:
                return found
            left = until - time.monotonic()
            if left <= 0:
                return None
            self._c.board_wait(self._address(_EVENTS), seen, left)

    # ---------------------------------------------------------------- the receiver

    def open_ticket(self, ticket: int, expect: int | None) -> None:
        """Ticket `ticket` is open, asking for `expect` (None: whatever is sent)."""
        self._store(_EXPECT, 0 if expect is None else expect)
        self._store(_HAS_EXPECT, int(expect is not None))
        self._store(_OPENED, ticket)  # last: a sender that sees it sees the two above
        self.notify()

    def close_ticket(self, ticket: int) -> None:
        self._store(_CLOSED, ticket)
        self.notify()

    def rings(self) -> int:
        return self._load(_ANSWERS)

    def closed(self) -> int:
        """The last ticket the receiver closed (on the board, before the Store says so)."""
        return self._load(_CLOSED)

    def served(self, ticket: int, senders: list[int]) -> list[int] | None:
        """The versions `senders` wrote for `ticket`, once every one has served it; else None."""
        versions = []
        for src in senders:
            if self._load(self._slot(src, _DONE_TICKET)) != ticket:
                return None
            versions.append(self._load(self._slot(src, _DONE_VERSION)))
        return versions

    def served_offer(self, src: int) -> int:
        """The count of sender `src`'s last send that served this receiver (0: none yet)."""
        return self._load(self._slot(src, _DONE_OFFER))

    # ---------------------------------------------------------------- a sender

    def ticket(self, candidate: int):
        """(version asked for,) while ticket `candidate` is open and not closed;
        NOT_YET before the receiver opened it; MOVED otherwise (closed, or a later
        ticket open: the Store says what to serve)."""
        return read_ticket(self._load, candidate)

    def serve(self, src: int, ticket: int, version: int, offer: int) -> None:
        """Sender `src` wrote `version` for `ticket`, in its `offer`-th send to this receiver."""
        self._store(self._slot(src, _DONE_VERSION), version)
        self._store(self._slot(src, _DONE_OFFER), offer)
        self._store(self._slot(src, _DONE_TICKET), ticket)  # last: the receiver reads it first
        self.notify()

    def ring(self) -> None:
        """A sender left the receiver something the board does not carry (an answer
        that is not a version, a failure): the receiver reads the Store."""
        self._c.board_add(self._address(_ANSWERS), 1)
        self.notify()
