"""The weight sync's decisions as plain functions (sync/protocol.py, board.py), on
thousands of random cases: what a receive's answers did to the receiver's
weights, how a ticket board's slots read as those answers, and which ticket a
sender serves while a receiver's receives come and go."""

from __future__ import annotations

import random

from llamarl_core.sync import board
from llamarl_core.sync.protocol import FAILED, LANDED, MIXED, STALE, SenderBook, board_answers, decide_receive


def random_answers(rng: random.Random, senders: list[int]) -> list:
    """One answer per sender: a version it wrote, a version it will not send, or a
    failure (its own, or another sender's left in its slot)."""
    answers = []
    for _ in senders:
        pick = rng.random()
        if pick < 0.5:
            answers.append(rng.randint(1, 3))
        elif pick < 0.75:
            answers.append({"abandoned": rng.randint(1, 3), "holds": rng.randint(4, 6), "wrote": rng.random() < 0.3})
        else:
            answers.append({"failed": rng.choice(senders), "error": "RuntimeError: boom",
                            "wrote": rng.choice([True, False, None])})
        if isinstance(answers[-1], dict) and rng.random() < 0.05:
            del answers[-1]["wrote"]  # an answer that does not say: it may have written
    return answers


def test_a_receive_leaves_the_weights_torn_exactly_when_a_sender_may_have_written():
    """Over 20,000 random receives (0-4 senders on this host, 0-2 senders on other
    hosts, the weights torn or not before): a version lands only when every sender
    wrote the same one, and then the weights are whole; a failure is reported
    before a stale answer, a stale answer before differing versions; a receive
    that fails leaves the weights torn if any sender wrote or may have (a version
    written, a sender on another host, a failure saying it wrote or not saying,
    a failure answering another sender's slot), and as they were otherwise, torn
    ones never mended by a receive that wrote nothing."""
    rng = random.Random(0)
    seen = set()
    for _ in range(20_000):
        senders = rng.sample(range(8), rng.randint(0, 4))  # none: every sender on another host
        answers = random_answers(rng, senders)
        p2p = {rng.randint(1, 3) for _ in range(rng.randint(0, 2))}
        was_torn = rng.random() < 0.3
        outcome = decide_receive(answers, senders, p2p, was_torn)
        seen.add((outcome.kind, outcome.wrote, was_torn))
        written = {a for a in answers if isinstance(a, int)} | p2p
        failed = [a for a in answers if isinstance(a, dict) and "failed" in a]
        stale = [a for a in answers if isinstance(a, dict) and "abandoned" in a]
        if failed:
            assert outcome.kind == FAILED and outcome.answer is failed[0]
        elif stale:
            assert outcome.kind == STALE and outcome.answer is stale[0]
        elif len(written) > 1:
            assert outcome.kind == MIXED and outcome.versions == written and outcome.torn
        else:
            assert outcome.kind == LANDED and not outcome.torn
            # the version every sender wrote; none at all (no sender): the held version is kept (None)
            assert outcome.version == (written.pop() if written else None) and outcome.wrote == bool(outcome.version)
            continue
        # A sender's own answer speaks for its slot ("wrote": False, nothing written); a version answered, a
        # sender on another host, an answer that does not say, and a failure left in another sender's slot
        # (it says nothing of that sender) may have written.
        may_have_written = bool(written) or any(
            a.get("wrote", True) is not False or ("failed" in a and a["failed"] != src)
            for src, a in zip(senders, answers) if isinstance(a, dict))
        assert outcome.wrote == may_have_written, (answers, senders, p2p)
        assert outcome.torn == (was_torn or may_have_written), (answers, senders, p2p, was_torn)
    # every kind met, with and without a write, from torn and whole weights
    assert {(FAILED, True), (FAILED, False), (STALE, True), (STALE, False)} <= {(k, w) for k, w, _ in seen}
    assert {(STALE, False, True), (FAILED, False, True), (LANDED, False, False)} <= seen


def test_a_stale_receive_that_wrote_nothing_keeps_torn_weights_torn():
    """The version asked for will not come and no sender wrote: the weights are as
    they were, torn ones too (a receive that landed nothing does not mend them)."""
    answer = {"abandoned": 3, "holds": 4, "wrote": False}
    assert decide_receive([answer], [0], [], was_torn=True).torn
    assert not decide_receive([answer], [0], [], was_torn=False).torn
    assert decide_receive([answer, 3], [0, 1], [], was_torn=False).torn  # the other sender wrote version 3


def test_a_boards_slots_decide_the_receive_as_the_answers_they_stand_for():
    """20,000 random sets of slots (served, stale, failed, not answered beside a
    failure): board_answers gives each its answer, and decide_receive on them says
    the weights are untouched only when every sender answered itself that it wrote
    nothing; a failure names the sender and the error it published."""
    rng = random.Random(2)
    errors = {src: f"RuntimeError: boom {src}" for src in range(8)}
    untouched = 0
    for _ in range(20_000):
        senders = rng.sample(range(8), rng.randint(1, 4))
        slots = [rng.choice([(board.SERVED, rng.randint(1, 3), True), (board.STALE, rng.randint(4, 6), rng.random() < 0.5),
                             (board.FAILED, 0, rng.random() < 0.5), None]) for _ in senders]
        if None in slots and not any(slot and slot[0] == board.FAILED for slot in slots):
            slots[slots.index(None)] = (board.FAILED, 0, rng.random() < 0.5)  # a receive ends with every slot or a failure
        expect = rng.choice([None, 2])
        answers = board_answers(slots, senders, expect, errors.get)
        outcome = decide_receive(answers, senders, [], was_torn=False)
        failed = [src for src, slot in zip(senders, slots) if slot and slot[0] == board.FAILED]
        if failed:
            assert outcome.kind == FAILED and (outcome.answer["failed"], outcome.answer["error"]) == (
                failed[0], errors[failed[0]])
            assert answers[senders.index(failed[0])] == {"failed": failed[0], "error": errors[failed[0]],
                                                         "wrote": slots[senders.index(failed[0])][2]}
        quiet = all(slot is not None and slot[0] != board.SERVED and not slot[2] for slot in slots)
        assert outcome.wrote == (not quiet), (slots, outcome)
        if not outcome.wrote:
            untouched += 1
            assert outcome.kind in (FAILED, STALE) and not outcome.torn
        for slot, answer in zip(slots, answers):
            if slot and slot[0] == board.STALE:
                assert answer == {"abandoned": expect, "holds": slot[1], "wrote": slot[2]}
            elif slot and slot[0] == board.SERVED:
                assert answer == slot[1]
    assert untouched > 500
    # A failure whose report was cleared since (the sender sends again) is still named.
    answers = board_answers([(board.FAILED, 0, False)], [3], None, lambda src: None)
    assert answers == [{"failed": 3, "error": "its report no longer stands (it sends again)", "wrote": False}]


def test_a_sender_serves_every_receive_it_can_and_nothing_closed_or_served():
    """2,000 random runs of one receiver and one sender on a board: the receiver
    opens ticket after ticket; each receive is served, or times out (closed
    unserved); the sender looks (read_open, to_serve) at random moments. It serves
    only open tickets, each newer than the last it served, and every receive that
    is open when it looks."""
    rng = random.Random(1)
    served_any = skipped_any = 0
    for _ in range(2_000):
        words = {board._OPENED: 0, board._EXPECT: 0, board._HAS_EXPECT: 0, board._CLOSED: 0}
        served, state = 0, {}  # ticket -> "open", "closed" (unserved), "served"
        for _ in range(rng.randint(5, 60)):
            opened = words[board._OPENED]
            if state.get(opened) != "open" and rng.random() < 0.4:
                words[board._CLOSED] = opened
                words[board._OPENED] = opened + 1
                state[opened + 1] = "open"
            elif state.get(opened) == "open" and rng.random() < 0.1:
                words[board._CLOSED] = opened
                state[opened] = "closed"
                skipped_any += 1
            if rng.random() < 0.5:
                continue  # the sender is busy elsewhere (another receiver, a copy)
            choice = board.to_serve(served, board.read_open(words.__getitem__))
            if choice is None:
                assert all(v != "open" for t, v in state.items() if t > served), state
                continue
            ticket = choice[0]
            assert state[ticket] == "open" and ticket > served
            # the receive is served: the receiver closes it once the answer is in
            served, state[ticket] = ticket, "served"
            words[board._CLOSED] = ticket
            served_any += 1
        assert all(v != "served" for t, v in state.items() if t > served), state
    assert served_any > 10_000 and skipped_any > 300  # both kinds of run met, often


def test_a_senders_book_never_calls_a_receive_it_wrote_untouched():
    """3,000 random runs of one sender (killed and registered again at random: mid
    copy, or after answering) serving one receiver whose receives open, time out
    and close at random: a STALE or FAILED answer says the weights are untouched
    only for a receive no incarnation of the sender began to write; a sender never
    serves a ticket it (or, where other senders write too, its predecessor) served
    or began; its offers' counts only grow, across incarnations too."""
    from llamarl_core.sync.board import to_serve

    rng = random.Random(3)
    clean = {"stale": 0, "failed": 0}
    dirty = {"stale": 0, "failed": 0}  # answers that said written, on a ticket a copy began to write
    restarted = late_aborts = 0
    for _ in range(3_000):
        sole = rng.random() < 0.5  # the receiver's only writer (a relay's child rank), or one of several
        incarnation, book = 1, SenderBook(1)
        book.new_board(0)
        opened = closed = 0
        written: dict[int, bool] = {}  # ticket -> a copy of some incarnation began while it was open
        offers = []

        def open_now():
            return (opened, None) if opened > closed else None

        def check_untouched(kind: str, ticket: int) -> None:
            if not book.wrote(0):
                assert not written.get(ticket), (kind, ticket, written)
                clean[kind] += 1
            elif written.get(ticket):
                dirty[kind] += 1

        for _ in range(rng.randint(5, 40)):
            event = rng.random()
            if opened == closed and event < 0.3:
                opened += 1  # the receiver's next receive opens its ticket
            elif opened > closed and event < 0.4:
                closed = opened  # it timed out, or got its answers
            elif event < 0.75:  # a send
                book.send_begins()
                offers.append(book.offer(0))
                choice = to_serve(book.served.get(0, 0), open_now())
                if choice is None:
                    continue
                ticket = choice[0]
                how = rng.choice(["stale", "whole", "aborted", "died", "answered-then-died"])
                if how == "stale":
                    assert book.answers(0, ticket)
                    check_untouched("stale", ticket)
                    continue
                book.writes(0)
                written[ticket] = True
                if how == "aborted":
                    if book.answers(0, ticket, failed=True):
                        assert book.wrote(0)
                    continue
                if how in ("whole", "answered-then-died"):
                    book.withdraw([0])
                    assert book.answers(0, ticket)
                    book.served_whole(0)
                    if rng.random() < 0.3:  # an abort() that read the ticket before it was served comes now
                        assert not book.answers(0, ticket, failed=True)  # that copy is whole: no FAILED over it
                        late_aborts += 1
                if how in ("died", "answered-then-died"):
                    incarnation, book = incarnation + 1, SenderBook(incarnation + 1)
                    book.new_board(0)
                    book.inherit(0, opened, sole, answered=how == "answered-then-died")
                    restarted += 1
                    if not sole or how == "answered-then-died":
                        assert book.served[0] >= ticket  # that receive is not served again
            else:  # an abort between sends
                current = to_serve(book.served.get(0, 0), open_now())
                if current is not None and book.answers(0, current[0], failed=True):
                    check_untouched("failed", current[0])
        assert offers == sorted(set(offers)), offers
    assert min(clean.values()) > 500 and min(dirty.values()) > 10, (clean, dirty)
    assert restarted > 1000 and late_aborts > 300, (restarted, late_aborts)
