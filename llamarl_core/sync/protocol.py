"""The Store side of a weight sync: a namespaced channel with JSON values and waits
that always time out, the keys senders and receivers exchange, and the decisions
taken on what they say, as plain classes and functions (no Store, board, thread
or clock inside): a sender's account of its receivers (SenderBook: which ticket
it serves, what its answers say it wrote), what a board's answers stand for
(board_answers) and what a receive's answers did to the weights (decide_receive).

One channel per pair of ranks: the Store for set-up, offers and failure
reports; a receiver's ticket board (board.py) for the hand-shakes of every
version with the senders of its host (shared memory, CUDA IPC); the
point-to-point group for pairs across hosts (stream.py).

Keys, under `llamarl/sync/<name>/`. Values are JSON (nothing read is unpickled or
run) with an HMAC tag under the sync's secret bound to the key (auth.py's
AuthenticatedStore: a value that does not verify reads as not set, so a forged
layout, device info, memory handle or report is never acted on); counters are
plain integers (a forged count is only a hint to look again):

    src/layout, src/bucket_bytes                      sender rank 0, at set-up
    dst/layout, dst/bucket_bytes                      receiver rank 0, at set-up
    src/<s>/info, dst/<d>/info                        every rank: device_info + transport
    src/<s>/relay_buckets                             a relay's buckets (None: the plan's)
    src/<s>/incarnation, dst/<d>/incarnation          counters: registrations under this name
    dst/<d>/board                                     receiver d's ticket board (board.py), with its
                                                      incarnation, set before the handle
    dst/<d>/handle                                    receiver d's memory handle (shm, CUDA IPC),
                                                      with its incarnation
    dst/reregistered                                  counter: receivers registered again, each
                                                      counted once its handle is published
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

Nothing is written per version but the offers: the keys do not pile up.

A sender that fails (its set-up or a send raises, or `abort`) publishes its error
(`SenderReports.fail`) before it re-raises: the error, then the count of
failures; then it answers FAILED on the open ticket of each receiver of its host
it has not served (ending that receiver's wait at once: it does not wait for the
others, which may be stuck in a collective with the failed one), and rings the
board of each. A receiver reads the count (one request) before it opens a ticket;
while it waits on its board it reads the reports when a sender rings, and every
FAILURE_POLL_S for a sender that failed before it mapped the board: a sender
whose failure stands and that has not answered within FAILURE_POLL_S fails the
receive (weights torn). Set-up waits poll the count instead (`Channel.wait` with
`failure`). A sender waiting on a board for a ticket reads the Store every
FAILURE_POLL_S: receivers abandoned (`abandon_receivers`), or registered again.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import numbers
import threading
import time
from typing import Callable, Iterable, Mapping

import torch.distributed as dist

from ..control.auth import AuthenticatedStore, required_secret
from .board import FAILED as FAILED_SLOT
from .board import STALE as STALE_SLOT
from .errors import SyncError, SyncTimeoutError

# A sync's set-up waits, and each send or receive by default, in seconds (every endpoint's `timeout`).
DEFAULT_TIMEOUT_S = 120.0


def check_timeout(value, name: str = "timeout", optional: bool = False) -> None:
    """Refuse, with ValueError naming `name`, a timeout that is not a positive
    number of seconds a wait can take (a bool, a string, NaN, 0, a negative, or
    past threading.TIMEOUT_MAX, about 292 years: inf among them); None passes
    where `optional` (the call's default then applies). Checked before anything
    is sent or posted: a wait given NaN would never end, and a point-to-point
    send that timed out at once would leave its header posted."""
    if value is None and optional:
        return
    # Compared, not converted: NaN fails both comparisons, and an int past a float's range is no OverflowError.
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= threading.TIMEOUT_MAX:
        raise ValueError(f"{name} must be a positive number of seconds, at most {threading.TIMEOUT_MAX:.4g}, "
                         f"got {value!r}")


SHM, CUDA_IPC, P2P = "shm", "cuda_ipc", "p2p"  # how a sender and a receiver rank may pair (transports.py)
TRANSPORTS = (SHM, CUDA_IPC, P2P)


def check_transport_name(requested: str) -> None:
    """Refuse, with ValueError naming `transport`, anything but "auto" or one of
    TRANSPORTS (checked where the argument is given, before anything is set up)."""
    if requested not in ("auto", *TRANSPORTS):
        raise ValueError(f"transport must be 'auto' or one of {TRANSPORTS}, got {requested!r}")


SRC, DST = "src", "dst"
# Set by abandon_receivers: the reason under this key.
ABANDONED = "abandoned"
FAILURES = f"{SRC}/failures"
# Counter: receivers that registered again under the sync's name (a restarted rank), each
# once its memory handle is published; a sender reads it at every send.
REREGISTERED = f"{DST}/reregistered"
# The point-to-point messages' format (stream.py, receiver.py), in every rank's device
# info and checked at set-up: ranks of two llamarl_core versions are refused, named,
# instead of misreading each other. 2: a header of 4 int64 asking for the receiver's words;
# 3: the keyed product checksum of the receiver's words (505fef6: one of format 2 never
# matches it, and every version would go whole unsaid).
P2P_WIRE_FORMAT = 3
# The longest pause between two polls of a wait that watches for failures: a failure
# is seen within this of its report. Every poll is a request or two to the Store (a
# check of the keys, a read of the failure count), about 8 a second while a wait lasts.
FAILURE_POLL_S = 0.125


class Channel:
    """The Store of one sync (`name`), namespaced, with authenticated JSON values
    (`secret`: every sender and receiver of the sync holds the same) and waits that
    always time out."""

    def __init__(self, store: dist.Store, name: str, secret: bytes | None):
        check_name(name)
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

    def genuine(self, key: str):
        """The key's value, None if it was never set or holds a value that does not
        verify (a report or marker a stranger forged is as good as none), without waiting."""
        body = self.store.read(key)[1]
        return None if body is None else json.loads(body)

    def counter(self, key: str, delta: int = 0) -> int:
        return self.store.add(key, delta)

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


def error_key(rank: int) -> str:
    return f"{SRC}/{rank}/error"


def offer_key(src: int, dst: int) -> str:
    return f"{SRC}/{src}/offer/{dst}"


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

    def fail(self, message: str) -> None:
        """Publish this rank's failure: its error, then the count a receiver's waits
        watch (the sender then answers FAILED on the boards it serves, see above)."""
        self.channel.set(error_key(self.rank), message)
        self.channel.counter(FAILURES, 1)

    def clear(self) -> None:
        """This rank sends again (or registered again): its failure no longer stands."""
        self.channel.set(error_key(self.rank), None)


class SenderWatch:
    """A receiver's view of its senders' reports: `failure` (one standing) and
    `offered` (the version they offer it)."""

    def __init__(self, channel: Channel, rank: int):
        self.channel, self.rank = channel, rank
        self._seen = 0  # the failure count when no sender watched had a failure standing
        self.offer_counts: dict[int, int] = {}  # sender -> the count of its latest offer `offered` read
        # The counter's key made now (reading it creates it), whichever waits ask it later: a
        # sync's keys in the Store are the same whatever path its receives take.
        channel.counter(FAILURES)

    def failure(self, senders: Iterable[int]) -> str | None:
        """"sender rank s failed: <its error>" for the first of `senders` whose failure
        stands, else None. One request while no failure was reported since the last
        call that found none; then one more per sender."""
        count = self.channel.counter(FAILURES)
        if count == self._seen:
            return None
        for src in senders:
            report = self.report(src)
            if report is not None:
                return report
        self._seen = count
        return None

    def error(self, src: int) -> str | None:
        """The error sender `src` published, while its failure stands (else None): one request."""
        return self.channel.genuine(error_key(src))

    def report(self, src: int) -> str | None:
        """"sender rank s failed: <its error>" if sender `src`'s failure stands, else
        None: one request, whatever `failure` saw before."""
        error = self.error(src)
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


class SenderBook:
    """One sender's account of its receivers, kept event by event with no Store,
    board, thread or clock (WeightSender does the I/O around it): the last ticket
    it answered on each receiver's board (it serves only a later one:
    board.to_serve), the count of its latest send offered to each receiver, whose
    offer stands, and whose memory it may have written since it last served it
    whole: what any answer it gives that receiver says (`wrote`), so that no
    answer calls weights untouched that a copy began to write."""

    def __init__(self, incarnation: int):
        # Offers count on from (incarnation - 1) * 2**32: a restarted rank's count above its
        # predecessor's (a receiver's board keeps the count of the send that served it last).
        self._first_offer = (incarnation - 1) << 32
        self.served: dict[int, int] = {}
        self.sends: dict[int, int] = {}
        self.offered: set[int] = set()
        self._inherited: set[int] = set()  # receivers a predecessor of this rank may have half written
        self._writing: set[int] = set()  # receivers the last send began to write and did not finish

    def new_board(self, dst: int) -> None:
        """Receiver `dst`'s board was mapped anew (its tickets count from 1 again)."""
        self.served[dst] = 0

    def inherit(self, dst: int, opened: int, sole: bool, answered: bool) -> None:
        """A restarted sender meets receiver `dst`, whose board last opened ticket
        `opened`, which this rank's predecessor `answered` or not. Where other senders
        write too (not `sole`), a receive open now may hold their previous version
        beside the predecessor's partial writes: joining it would mix versions, so it
        serves from the next ticket on. A receiver this rank alone writes (a relay's
        child rank) it serves at once (all of it is written again, and it may be
        waiting for exactly the version the predecessor died on), unless the
        predecessor answered that ticket; until served whole, any answer says written."""
        self.served[dst] = max(opened - (sole and not answered), 0)
        if sole:
            self._inherited.add(dst)

    def offer(self, dst: int) -> int:
        """This rank offers receiver `dst` a send: its count."""
        self.sends[dst] = self.sends.get(dst, self._first_offer) + 1
        self.offered.add(dst)
        return self.sends[dst]

    def withdraw(self, dsts: Iterable[int] | None = None) -> list[int]:
        """These offers (default: every standing one) no longer stand: the ones that did."""
        gone = sorted(self.offered if dsts is None else self.offered & set(dsts))
        self.offered -= set(gone)
        return gone

    def send_begins(self) -> None:
        """A send begins: what an earlier one began to write belongs to an earlier receive."""
        self._writing = set()

    def writes(self, dst: int) -> None:
        """A copy into receiver `dst`'s memory begins."""
        self._writing.add(dst)

    def wrote(self, dst: int) -> bool:
        """Whether this rank (or its predecessor) may have written receiver `dst`'s
        memory since it last served it whole."""
        return dst in self._writing or dst in self._inherited

    def answers(self, dst: int, ticket: int, failed: bool = False) -> bool:
        """Whether to answer `ticket` of receiver `dst` (a FAILED answer to a ticket
        served meanwhile is not given: that copy is whole); the ticket is then done
        with (the next send serves a later one)."""
        if failed and ticket <= self.served.get(dst, 0):
            return False
        self.served[dst] = max(self.served.get(dst, 0), ticket)
        return True

    def served_whole(self, dst: int) -> None:
        """Receiver `dst` got the whole version (its SERVED answer is given)."""
        self._writing.discard(dst)
        self._inherited.discard(dst)


def abandon_receivers(store: dist.Store, name: str, reason: str, *, secret: bytes | None = None) -> None:
    """The receivers of sync `name` are gone for good (their processes died; new
    ones register under another name): a send waiting for one of them to ask for a
    version raises SyncError naming `reason` within FAILURE_POLL_S instead of at its
    timeout. Called by whoever watches the receivers' processes (the pipeline's
    controller), with the sync's secret (as WeightSender's)."""
    Channel(store, name, secret).set(ABANDONED, reason)


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


def board_answers(slots: list, senders: list[int], expect: int | None,
                  report: Callable[[int], str | None]) -> list:
    """decide_receive's answers from a ticket board's slots (TicketBoard.answers:
    (kind, version, wrote) or None, in the order of `senders`), for the ticket
    that asked for `expect`: SERVED -> the version; STALE -> {"abandoned",
    "holds", "wrote"}; FAILED -> {"failed", "error", "wrote"} (error: report(src),
    the error the sender published, None once it sends again); a slot not
    answered beside a FAILED one -> that failure without "wrote" (its sender may
    have written, or be writing)."""

    def failure(src: int) -> str:
        return report(src) or "its report no longer stands (it sends again)"

    failed = [src for src, slot in zip(senders, slots) if slot is not None and slot[0] == FAILED_SLOT]
    answers = []
    for src, slot in zip(senders, slots):
        if slot is None:
            answers.append({"failed": failed[0], "error": failure(failed[0])})
        elif slot[0] == FAILED_SLOT:
            answers.append({"failed": src, "error": failure(src), "wrote": slot[2]})
        elif slot[0] == STALE_SLOT:
            answers.append({"abandoned": expect, "holds": slot[1], "wrote": slot[2]})
        else:
            answers.append(slot[1])
    return answers


def check_name(name) -> None:
    """ValueError unless a sync's `name` is a non-empty str (None and "None", 5 and
    "5" would be one sync)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")


def relay_name(name: str, replica: int) -> str:
    """The Store namespace of the sync that fills `replica` (replica 0: the trainer's)."""
    check_name(name)
    return f"{name}/replica{replica}" if replica else name
