"""The Store side of a weight sync: a namespaced channel with JSON values and waits
that always time out, the keys senders and receivers exchange, and the small
decisions taken on them (a sender's reports and offers, a receiver's view of them,
what a receive's answers did to its weights: decide_receive).

Keys, under `llamarl/sync/<name>/`. Values are JSON (nothing read is unpickled or
run) with an HMAC tag under the sync's secret bound to the key (auth.py's
AuthenticatedStore: a value that does not verify reads as not set, so a forged
layout, device info, memory handle, relay table or answer is never acted on);
counters are plain integers (a forged count is only a hint to look again):

    src/layout, src/bucket_bytes                      sender rank 0, at set-up
    dst/layout, dst/bucket_bytes                      receiver rank 0, at set-up
    src/<s>/info, dst/<d>/info                        every rank: device_info + transport
    src/<s>/relay_buckets                             a relay's buckets (None: the plan's)
    src/<s>/incarnation, dst/<d>/incarnation          counters: registrations under this name
    dst/<d>/handle                                    receiver d's memory handle (shm, CUDA IPC),
                                                      with its incarnation
    dst/reregistered                                  counter: receivers registered again, each
                                                      counted once its handle is published
    dst/<d>/board                                     receiver d's ticket board (board.py), set before
                                                      the handle: the same hand-shake in shared memory
    dst/<d>/ticket                                    counter: the last ticket receiver d took
    dst/<d>/open/<t>                                  ticket t opened: the version asked for
                                                      (or null); "closed" once over; "abandoned"
    dst/<d>/done/<t>/<s>                              sender s served ticket t: the version it
                                                      wrote; {"abandoned", "holds"} (that version
                                                      will not come); {"failed", "error",
                                                      "wrote"} (a sender failed: see below)
    src/<s>/offer/<d>                                 [version, n]: sender s's n-th send to
                                                      receiver d waits for it (or runs); null
                                                      once over (shm, CUDA IPC pairs)
    src/<s>/error                                     "Type: message": sender s failed; null
                                                      again once it sends anew
    src/failures                                      counter: failure reports ever made
    abandoned                                         abandon_receivers' reason
    src/amax/<version>/<n>/<digest>/flag/<s>          the FP8 exchange (amax.py): "ok", "nonfinite",
    src/amax/<version>/<n>/<digest>/values/<s>        "timed-out"; the amaxes of the shared groups
    src/amax/<version>/<n>/<digest>/done              (raw float32); a counter. Deleted by the last
                                                      sender done (digest: every sender's incarnation)
    pg/...                                            the point-to-point group's rendezvous
                                                      (tagged too: a forged peer address is never read)

Keys do not pile up with versions: once a receiver has opened ticket t it deletes
ticket t - 1's answers and ticket t - 2's `open` (a sender one ticket behind still
finds t - 1 closed). An answer a sender writes after the receiver moved on,
on a failure path, stays: one key per such failure.

A sender that fails (its set-up or a send raises, or `abort`) publishes its error
(`SenderReports.fail`) before it re-raises: the error, the count of failures, then
a "failed" answer in every slot of the open ticket of each receiver it has not
served, which ends that receiver's wait at once. A receiver reads the count (one
request) before it opens a ticket; a failure reported after that read rings the
receiver's ticket board (board.py) or, from a sender that has not mapped it yet,
moves the count, which the receiver looks at every FAILURE_POLL_S while it waits:
either way it then reads the answers from the Store, where the failed sender
answered every slot if it found the ticket open, and raises the failure
(weights torn) if none came within FAILURE_POLL_S. Set-up waits poll the count
instead (`Channel.wait` with `failure`).

Between a receiver and the senders of its host (shared memory, CUDA IPC) the two
waits of a version, for the ticket to open and for the answers, sleep on the
receiver's ticket board instead of the Store; the keys above are written all the
same, sent before the board shows them, and are read whenever the board does not
show what a waiter needs (board.py). A Store set is not answered, so a key the
board already shows may still be on its way to the Store: a waiter that reads
such a key from the Store waits for it (a blocking get or a wait with a
deadline), never takes its absence for an answer.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from typing import Callable, Iterable, Mapping

import torch.distributed as dist

from ..control.auth import AuthenticatedStore, required_secret
from .errors import SyncError, SyncTimeoutError
from .layout import Layout

# A sync's set-up waits, and each send or receive by default, in seconds (every endpoint's `timeout`).
DEFAULT_TIMEOUT_S = 120.0

SRC, DST = "src", "dst"
# Set by abandon_receivers: the reason under this key, and this value in the tickets it opens.
ABANDONED = "abandoned"
# What a receiver writes over its ticket's `open` value when it closes the ticket: a
# sender waiting for the ticket after the one it served last sees it there.
CLOSED = "closed"
FAILURES = f"{SRC}/failures"
# Counter: receivers that registered again under the sync's name (a restarted rank), each
# once its memory handle is published; a sender reads it at every send.
REREGISTERED = f"{DST}/reregistered"
# The longest pause between two polls of a wait that watches for failures: a failure
# is seen within this of its report. Every poll is a request to the Store (a check of
# the keys, a read of the failure count), so a wait that lasts polls about 8 times a second.
FAILURE_POLL_S = 0.125


class Channel:
    """The Store of one sync (`name`), namespaced, with authenticated JSON values
    (`secret`: every sender and receiver of the sync holds the same) and waits that
    always time out."""

    def __init__(self, store: dist.Store, name: str, secret: bytes | None):
        self.name = name
        prefix = f"llamarl/sync/{name}/"
        secret = required_secret(secret, f"the weight sync {name!r}")
        self.store = AuthenticatedStore(dist.PrefixStore(prefix, store), secret, label=prefix)

    def set(self, key: str, value) -> None:
        self.store.set(key, json.dumps(value))

    def get(self, key: str):
        return json.loads(self.store.get(key))

    def get_if_set(self, key: str):
        """The key's value, None if it was never set, without waiting; SyncError
        when it holds a value that does not verify (what a rank decides on it, it
        would decide on a stranger's word: an optional set-up value)."""
        is_set, body = self.store.read(key)
        if is_set and body is None:
            raise SyncError(f"the sync {self.name!r}: {key} holds a value that does not verify under the sync's "
                            "secret (forged, or written by a rank given another secret); nothing is planned on it")
        return None if body is None else json.loads(body)

    def lookup(self, key: str) -> tuple[bool, object]:
        """(True, value) when the key holds a genuine value (JSON null included),
        else (False, None), without waiting."""
        body = self.store.read(key)[1]
        return (False, None) if body is None else (True, json.loads(body))

    def genuine(self, key: str):
        """The key's value, None if it was never set or holds a value that does not
        verify (a report or marker a stranger forged is as good as none), without waiting."""
        return self.lookup(key)[1]

    def counter(self, key: str, delta: int = 0) -> int:
        return self.store.add(key, delta)

    def set_counter(self, key: str, value: int) -> None:
        """Set the counter `key` (untagged, as every counter: `counter` reads it)."""
        self.store.set_counter(key, value)

    def has(self, key: str) -> bool:
        """Whether the key holds a genuine value, without waiting."""
        return self.store.check([key])

    def wait(self, keys: Mapping[str, str], deadline: float, what: str,
             failure: Callable[[], str | None] | None = None) -> list[bytes]:
        """Return the raw values of `keys` (key -> who sets it, e.g. "sender rank 1")
        once every one holds a genuine value. Past `deadline` (time.monotonic) raises
        SyncTimeoutError naming `what` and who never answered. failure: called
        between polls, returns the message of a failure that ends the wait (raised
        as SyncError) or None; without it the wait is one blocking Store request (no
        poll: a TCPStore logs every wait that times out) and a read of each key, with
        it the keys are read, FAILURE_POLL_S apart at most. The client's own timeout
        is never touched (it may be shared)."""
        names = list(keys)
        if failure is None:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise dist.DistStoreError("deadline passed")
                # At least 1 ms: a timeout that rounds down to 0 ms means "no timeout" to c10d.
                return self.store.wait_get(names, datetime.timedelta(seconds=max(remaining, 1e-3)))
            except RuntimeError as exc:
                raise self._timeout(exc, keys, what) from exc
        # 1 ms, doubling: a wait overshoots the keys' arrival by at most its own length so far.
        pause = 1e-3
        while True:
            found = [self.store.read(k)[1] for k in names]
            if all(body is not None for body in found):
                return found
            message = failure()
            if message is not None:
                raise SyncError(message)
            if time.monotonic() >= deadline:
                raise self._timeout(dist.DistStoreError("deadline passed"), keys, what)
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(2 * pause, FAILURE_POLL_S)

    def get_all(self, keys: Mapping[str, str], deadline: float, what: str) -> list:
        """The values of `keys` once every one is genuine, within the deadline (wait)."""
        return [json.loads(v) for v in self.wait(keys, deadline, what)]

    def _timeout(self, exc: RuntimeError, keys: Mapping[str, str], what: str) -> Exception:
        """The SyncTimeoutError of a wait that failed with `exc`, or `exc` itself when
        it was not a timeout. A timeout is a DistStoreError from TCPStore and
        HashStore but a plain RuntimeError ("Wait timeout") from FileStore; other
        DistErrors (a lost connection: DistNetworkError) are not timeouts."""
        if isinstance(exc, dist.DistError) and not isinstance(exc, dist.DistStoreError):
            return exc
        missing = [k for k in keys if not self.store.check([k])]
        silent = ", ".join(dict.fromkeys(keys[k] for k in missing))
        forged = self.store.forged(missing)
        return SyncTimeoutError(f"timed out waiting for {what}: no word from {silent or 'nobody'} (missing {missing}"
                                + (f"; {forged} hold values that do not verify under the sync's secret: forged, or "
                                   "written by a rank given another secret" if forged else "") + ")")


def ticket_closed(channel: Channel, dst: int, ticket: int) -> bool:
    """Whether receiver `dst` closed `ticket` (CLOSED over its `open` value)."""
    return channel.genuine(f"{DST}/{dst}/open/{ticket}") == CLOSED


def error_key(rank: int) -> str:
    return f"{SRC}/{rank}/error"


def offer_key(src: int, dst: int) -> str:
    return f"{SRC}/{src}/offer/{dst}"


def done_key(dst: int, ticket: int, src: int) -> str:
    return f"{DST}/{dst}/done/{ticket}/{src}"


class SenderReports:
    """What sender `rank` tells its receivers beside the bytes: the version each is
    offered (`offer`, `withdraw`: what WeightReceiver.pending reads) and its failure
    (`fail`, `clear`)."""

    def __init__(self, channel: Channel, rank: int):
        self.channel, self.rank = channel, rank

    def offer(self, dst: int, version: int, count: int) -> None:
        """This rank's `count`-th send to receiver `dst`, of `version`, waits for it."""
        self.channel.set(offer_key(self.rank, dst), [version, count])

    def withdraw(self, dsts: Iterable[int]) -> None:
        """No send of this rank waits for these receivers any more. Over shared memory
        or CUDA IPC, withdrawn before the done answer: a receiver that has its version
        never sees the offer still standing."""
        for dst in dsts:
            self.channel.set(offer_key(self.rank, dst), None)

    def fail(self, message: str, unserved: Mapping[int, tuple[int, Iterable[int]]],
             wrote: Iterable[int] = ()) -> dict[int, int]:
        """Publish this rank's failure, then end the waits it leaves hanging. unserved:
        receiver -> (the last ticket this rank served it, the ranks that write to it
        over shared memory or CUDA IPC): an open ticket after that one gets a
        {"failed", "error", "wrote"} answer in every slot not answered yet ("wrote":
        whether this rank began writing to that receiver: in `wrote`), so its receive()
        raises at once instead of waiting for senders that may never come (a rank
        stuck in a collective with this one). Receivers this rank serves point to
        point wait in the process group: they see the failure in pending().
        Returns receiver -> its current ticket, answered here or closed: this rank
        has nothing more to do with it (its next send looks at the ticket after)."""
        self.channel.set(error_key(self.rank), message)
        self.channel.counter(FAILURES, 1)
        wrote = set(wrote)
        current = {}
        for dst, (served, writers) in unserved.items():
            answer = {"failed": self.rank, "error": message, "wrote": dst in wrote}
            ticket = current[dst] = self.channel.counter(f"{DST}/{dst}/ticket")
            if ticket <= served or ticket_closed(self.channel, dst, ticket):
                continue
            for src in writers:
                if not self.channel.has(done_key(dst, ticket, src)):
                    self.channel.set(done_key(dst, ticket, src), answer)
        return current

    def clear(self) -> None:
        """This rank sends again (or registered again): its failure no longer stands."""
        self.channel.set(error_key(self.rank), None)


class SenderWatch:
    """A receiver's view of its senders' reports: `failure` (one standing) and
    `offered` (the version they offer it)."""

    def __init__(self, channel: Channel, rank: int):
        self.channel, self.rank = channel, rank
        self._seen = 0  # the failure count when no sender watched had a failure standing
        self._read = 0  # the failure count `failure` read last
        self.offer_counts: dict[int, int] = {}  # sender -> the count of its latest offer `offered` read
        # The counter's key made now (reading it creates it), whichever waits ask it later: a
        # sync's keys in the Store are the same whatever path its receives take.
        channel.counter(FAILURES)

    def failure(self, senders: Iterable[int]) -> str | None:
        """"sender rank s failed: <its error>" for the first of `senders` whose failure
        stands, else None. One request while no failure was reported since the last
        call that found none; then one more per sender."""
        count = self._read = self.channel.counter(FAILURES)
        if count == self._seen:
            return None
        for src in senders:
            report = self.report(src)
            if report is not None:
                return report
        self._seen = count
        return None

    def reported_since(self) -> bool:
        """Whether a failure was reported (by any sender) since `failure` last looked: one request."""
        return self.channel.counter(FAILURES) != self._read

    def report(self, src: int) -> str | None:
        """"sender rank s failed: <its error>" if sender `src`'s failure stands, else
        None: one request, whatever `failure` saw before."""
        error = self.channel.genuine(error_key(src))
        return None if error is None else f"sender rank {src} failed: {error}"

    def offered(self, received: Mapping[int, int | None]) -> int | None:
        """The version offered to this receiver by every sender in `received` (sender ->
        how many point-to-point versions this receiver took from it, None for a pair
        over shared memory or CUDA IPC, whose offers are withdrawn once served); the
        highest if they differ (the receive then refuses the mix). None while some
        sender offers nothing new."""
        offers = [self.channel.genuine(offer_key(src, self.rank)) for src in received]
        self.offer_counts.update({src: offer[1] for src, offer in zip(received, offers) if offer is not None})
        if not offers or any(offer is None or (taken is not None and offer[1] <= taken)
               for offer, taken in zip(offers, received.values())):
            return None
        return max(version for version, _ in offers)


def abandon_receivers(store: dist.Store, name: str, reason: str, *, secret: bytes | None = None) -> None:
    """The receivers of sync `name` are gone for good (their processes died; new
    ones register under another name): a send waiting for one of them to ask for a
    version raises SyncError naming `reason` at once instead of at its timeout.
    Called by whoever watches the receivers' processes (the pipeline's controller),
    with the sync's secret (as WeightSender's)."""
    channel = Channel(store, name, secret)
    channel.set(ABANDONED, reason)
    if not channel.has(f"{DST}/layout"):
        return  # never registered: no sender can be waiting for a ticket
    for rank in range(Layout.from_dict(channel.get(f"{DST}/layout")).world_size):
        # Wake the senders waiting for a ticket to open: the next one, and the last one taken,
        # which a receiver killed between taking it and opening it never opened. The mark in
        # its place makes them raise; a ticket opened already is left as it is.
        last = channel.counter(f"{DST}/{rank}/ticket")
        for ticket in (last, last + 1):
            if ticket and not channel.has(f"{DST}/{rank}/open/{ticket}"):
                channel.set(f"{DST}/{rank}/open/{ticket}", ABANDONED)


def next_ticket(served: int, current: int, current_closed: bool) -> int:
    """The ticket a sender looks at next on a receiver once the one it looked at
    was closed unserved (a receive that timed out) or did not open in time (a
    receiver killed after taking it, or a slow one). served: the last ticket it
    served there; current: the receiver's counter, the last ticket it took;
    current_closed: whether that one is closed (True where it is not newer than
    the served one). The current ticket if it is newer than the one served and
    still open (a receive under way), else the one after it, or after the served
    one, whichever is later: the receiver's next receive."""
    if current > served and not current_closed:
        return current
    return max(current, served) + 1


LANDED, FAILED, STALE, MIXED = "landed", "failed", "stale", "mixed"


@dataclasses.dataclass(frozen=True)
class ReceiveOutcome:
    """What one receive did to the receiver's weights (decide_receive). kind:
    LANDED (every sender wrote one version: `version`, None when no sender
    answered, the held version kept), FAILED (a sender failed: `answer`),
    STALE (a sender will not send the version asked for: `answer`, its
    "abandoned" and "holds"), MIXED (the senders wrote different versions:
    `versions`); wrote: whether a sender wrote, or may have, into the weights;
    torn: whether the weights are torn after this receive."""

    kind: str
    wrote: bool
    torn: bool
    version: int | None = None
    versions: frozenset = frozenset()
    answer: dict | None = None


def decide_receive(answers: list, senders: list[int], p2p_versions: Iterable[int], was_torn: bool) -> ReceiveOutcome:
    """The outcome of a receive from its senders' answers. answers: the answer of
    each sender on this host to the receive's ticket (in the order of `senders`):
    the version it wrote, {"abandoned", "holds", "wrote"} (the version asked for
    will not come), or {"failed", "error", "wrote"} (a sender failed, the one
    named: a failure answers for every slot it finds open, so only the failed
    sender's own "wrote" speaks for its slot; an answer without "wrote" may have
    written); p2p_versions: the versions the
    senders on other hosts wrote (each wrote); was_torn: the weights torn before
    this receive. A failure comes first, then a stale answer, then versions that
    differ. Weights no sender wrote into are as they were (torn or not); any
    other failed receive leaves them torn."""
    versions = frozenset(p2p_versions)
    reports = [answer for answer in answers if isinstance(answer, dict)]
    failed = [answer for answer in reports if "failed" in answer]
    if failed:
        untouched = not versions and all(
            isinstance(answer, dict) and answer.get("wrote") is False
            and ("abandoned" in answer or answer.get("failed") == src)
            for src, answer in zip(senders, answers))
        return ReceiveOutcome(FAILED, not untouched, was_torn or not untouched, answer=failed[0])
    if reports:
        untouched = len(reports) == len(answers) and not versions and all(a.get("wrote") is False for a in reports)
        return ReceiveOutcome(STALE, not untouched, was_torn or not untouched, answer=reports[0])
    versions |= frozenset(answers)
    if len(versions) > 1:
        return ReceiveOutcome(MIXED, True, True, versions=versions)
    return ReceiveOutcome(LANDED, bool(versions), False, version=next(iter(versions), None), versions=versions)


def relay_name(name: str, replica: int) -> str:
    """The Store namespace of the sync that fills `replica` (replica 0: the trainer's)."""
    return f"{name}/replica{replica}" if replica else name
