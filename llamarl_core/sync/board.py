"""The ticket board: the hand-shake of a receiver with the senders of its host,
in shared memory.

Over shared memory or CUDA IPC a version moves in two hand-shakes: the receiver
opens a ticket (asking, or not, for a version), each sender of its host waits
for it, copies, and answers on the ticket; the receiver waits for every answer,
then closes the ticket. The board is where both happen, and the only place: a
small region of POSIX shared memory that the receiver creates and every sender
of its host maps, with a futex to sleep on, so a waiter wakes within
microseconds of the word it waits for (a wait on a Store key costs 50-260 us, more
than the copy of a small model). The Store carries the rest (protocol.py): the
board's handle at set-up, the senders' offers and failure reports, and a
receiver given up for lost (`abandon_receivers`), which a sender waiting on a
board looks at every protocol.FAILURE_POLL_S.

- The receiver numbers its tickets 1, 2, ... on each board (a receiver that
  registers again makes a new board, and its senders map that one): it stores
  the version asked for, then the ticket opened (`open_ticket`); later the
  ticket closed (`close_ticket`). A sender serves the ticket open now
  (`current`) if it has not served it yet.
- Each sender answers in a slot of its own: the ticket, what it did (SERVED the
  version; STALE: the version asked for will not come, it holds another; FAILED:
  its failure report stands in the Store), whether it wrote into the receiver's
  memory, and the count of its send (pending() tells an offer already served from
  a new one by it). The receiver returns once every sender answered, or one failed.
- `ring`: a sender's failure report stands in the Store (one that found no open
  ticket to answer on): a receiver waiting on the board reads the reports at once.

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

from .._native import native
from .errors import SyncError

_LINE = 8  # words per cache line
_EVENTS = 0  # line 0: the event counter (32 bits)
_OPENED, _EXPECT, _HAS_EXPECT, _CLOSED = 8, 9, 10, 11  # line 1: the receiver's
_RINGS = 16  # line 2: rings (senders, atomic adds)
_SLOTS = 24  # line 3 + s: sender s's answer
# An answer's words, and a sequence count odd while its sender writes them (one writer per slot:
# a sender's threads answer one at a time), even after: a reader takes the words only between
# two equal even loads of it.
_DONE_TICKET, _DONE_KIND, _DONE_VERSION, _DONE_WROTE, _DONE_OFFER, _DONE_SEQ = 0, 1, 2, 3, 4, 5

# What a sender's answer says it did with the ticket (see the module's docstring).
SERVED, STALE, FAILED = 0, 1, 2


def read_open(load) -> tuple[int, int | None] | None:
    """(ticket, version asked for or None) of the ticket open now, None when none
    is, from the words `load(index)` returns, loaded in this order while the
    receiver may be storing (open_ticket: expect, then the ticket; close_ticket:
    the ticket). What it returns held at its last load: were the expect loaded a
    later ticket's, that ticket's opening came after this one's close, which the
    last load then shows."""
    opened = load(_OPENED)
    has_expect, expect = load(_HAS_EXPECT), load(_EXPECT)
    if load(_CLOSED) >= opened:
        return None
    return opened, (expect if has_expect else None)


def to_serve(served: int, current: tuple[int, int | None] | None) -> tuple[int, int | None] | None:
    """A sender's choice: the ticket open now (`current`, read_open's) if it is
    newer than the last one this sender served there (`served`), else None (wait)."""
    return current if current is not None and current[0] > served else None


def board_bytes(num_senders: int) -> int:
    return (_SLOTS + _LINE * num_senders) * 8


class TicketBoard:
    """One receiver rank's board (see the module's docstring). `create` on the
    receiver, `open` on each sender of its host; a process's view stays mapped for
    as long as the object lives (a thread's abort() may still answer on it)."""

    def __init__(self, region, num_senders: int):
        self.region, self.num_senders = region, num_senders
        self._base = region.address
        self._c = native()

    @classmethod
    def create(cls, num_senders: int, owner: str) -> "TicketBoard":
        """A new board for `num_senders` sender slots; SyncError naming `owner` when
        /dev/shm has no room for it."""
        try:
            return cls(native().SharedMemoryRegion.create(board_bytes(num_senders)), num_senders)
        except native().EngineError as exc:
            raise SyncError(f"{owner}: no room for its ticket board ({board_bytes(num_senders)} bytes of /dev/shm): "
                            f"{exc}") from None

    @classmethod
    def open(cls, handle: dict, num_senders: int, owner: str = "this process") -> "TicketBoard":
        """Map the board a receiver published (`handle()`), checked to hold a slot per
        sender; SyncError naming `owner` when it cannot be mapped from here."""
        if not isinstance(handle, dict) or handle.get("nbytes") != board_bytes(num_senders):
            raise ValueError(f"a ticket board for {num_senders} senders has {board_bytes(num_senders)} bytes, the "
                             f"receiver published {handle!r}")
        try:
            region = native().SharedMemoryRegion.open(handle["pid"], handle["fd"], handle["name"], handle["nbytes"])
        except native().EngineError as exc:
            raise SyncError(f"{owner}: cannot map the receiver's ticket board ({exc}); senders and receivers on "
                            "one host must be able to read each other's /proc/<pid>/fd (one user; or "
                            "transport='p2p')") from None
        return cls(region, num_senders)

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
        return self._load(_RINGS)

    def answers(self, ticket: int, senders: list[int]) -> list[tuple[int, int, bool] | None]:
        """Each of `senders`' answer to `ticket`: (SERVED / STALE / FAILED, the
        version, whether it wrote), None where it has not answered it (or is
        writing its answer now: the board is notified once it is written)."""
        found = []
        for src in senders:
            seq = self._load(self._slot(src, _DONE_SEQ))
            words = [self._load(self._slot(src, field)) for field in (_DONE_TICKET, _DONE_KIND, _DONE_VERSION,
                                                                      _DONE_WROTE)]
            whole = seq % 2 == 0 and self._load(self._slot(src, _DONE_SEQ)) == seq
            found.append((words[1], words[2], bool(words[3])) if whole and words[0] == ticket else None)
        return found

    def served_offer(self, src: int) -> int:
        """The count of sender `src`'s last send that answered on this board (0: none yet)."""
        return self._load(self._slot(src, _DONE_OFFER))

    # ---------------------------------------------------------------- a sender

    def current(self) -> tuple[int, int | None] | None:
        """(ticket, version asked for) of the ticket open now; None when none is."""
        return read_open(self._load)

    def opened(self) -> int:
        """The last ticket the receiver opened (0: none yet)."""
        return self._load(_OPENED)

    def answer(self, src: int, ticket: int, kind: int, version: int, wrote: bool, offer: int | None = None) -> None:
        """Sender `src`'s answer to `ticket` (SERVED `version`; STALE, holding
        `version`; FAILED); wrote: whether it wrote, or may have, into the receiver's
        memory; offer: the count of the send that served (SERVED only: what pending()
        takes as served). One thread of one sender at a time; a count left odd by a
        writer that died between its two stores is taken up from there."""
        seq = self._load(self._slot(src, _DONE_SEQ)) | 1
        self._store(self._slot(src, _DONE_SEQ), seq)
        fields = [(_DONE_TICKET, ticket), (_DONE_KIND, kind), (_DONE_VERSION, version), (_DONE_WROTE, int(wrote))]
        for field, value in fields + ([(_DONE_OFFER, offer)] if offer is not None else []):
            self._store(self._slot(src, field), value)
        self._store(self._slot(src, _DONE_SEQ), seq + 1)
        self.notify()

    def ring(self) -> None:
        """A failure report of a sender stands in the Store: the receiver reads it."""
        self._c.board_add(self._address(_RINGS), 1)
        self.notify()
