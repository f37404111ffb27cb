"""The weight sync's decisions as plain functions (sync/protocol.py), on thousands
of random cases: what a receive's answers did to the receiver's weights, and
which ticket a sender looks at next while a receiver's receives come and go."""

from __future__ import annotations

import random

from llamarl_core.sync.protocol import FAILED, LANDED, MIXED, STALE, decide_receive, next_ticket


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


def test_a_sender_chasing_tickets_serves_every_receive_it_can_and_nothing_closed():
    """2,000 random runs of one receiver and one sender. The receiver takes ticket
    after ticket; each receive opens its ticket and waits to be served, or times
    out (closed unserved), or the receiver dies after taking the ticket and
    before opening it (a restarted one counts on). The sender looks at one
    candidate at a time: an open one it serves; a closed one, or one that has
    not opened within its poll, sends it to the counter (next_ticket). Whatever
    the interleaving, it serves only open tickets, each newer than the last, and
    serves a receive that stays open within two looks of its opening."""
    rng = random.Random(1)
    served_any = skipped_any = 0
    for _ in range(2_000):
        counter, state = 0, {}  # ticket -> "taken" (never opened), "open", "closed" (unserved), "served"
        served, candidate, opened_at = 0, 1, None
        for look in range(rng.randint(5, 60)):
            if state.get(counter) != "open" and rng.random() < 0.4:
                counter += 1  # the receiver's next receive takes its ticket
                state[counter] = "taken" if rng.random() < 0.15 else "open"
                opened_at = look if state[counter] == "open" else None
            elif state.get(counter) == "open" and rng.random() < 0.1:
                state[counter], opened_at = "closed", None  # timed out, unserved
                skipped_any += 1
            if state.get(candidate) == "open":  # the sender's look at its candidate
                assert candidate > served
                served, state[candidate], opened_at = candidate, "served", None
                served_any += 1
                continue
            candidate = next_ticket(served, counter, state.get(counter) != "open")
            assert candidate > served
            if opened_at is not None:
                assert look - opened_at < 2, (state, counter, candidate)
        assert all(v != "served" for t, v in state.items() if t > served), state
    assert served_any > 10_000 and skipped_any > 300  # both kinds of run met, often
