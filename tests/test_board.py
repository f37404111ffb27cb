"""The ticket board (sync/board.py): its words and futex across real processes, the
sender's reading of a ticket under thousands of random interleavings with the
receiver's stores, and that a sync over shared memory runs its hand-shake on it."""

import multiprocessing
import random
import time

import pytest
import torch

from llamarl_core._native import native
from llamarl_core.sync.board import (
    _CLOSED,
    _EXPECT,
    _HAS_EXPECT,
    _OPENED,
    MOVED,
    NOT_YET,
    TicketBoard,
    board_bytes,
    read_ticket,
)


def _serve_when_open(handle: dict, results) -> None:
    """A sender in another process: wait for ticket 1, answer it, report what it was asked."""
    board = TicketBoard.open(handle, 2)
    asked = board.wait_until(lambda: (lambda t: t if isinstance(t, tuple) else None)(board.ticket(1)),
                             time.monotonic() + 60)
    board.serve(1, 1, 7, 3)
    results.put(asked)


def test_a_process_sleeping_on_the_board_wakes_when_a_ticket_opens_and_answers_on_it():
    board = TicketBoard.create(2)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_serve_when_open, args=(board.handle(), results))
    child.start()
    try:
        assert board.served(1, [1]) is None and board.served_offer(1) == 0
        board.open_ticket(1, 5)
        assert board.wait_until(lambda: board.served(1, [1]), time.monotonic() + 60) == [7]
        assert results.get(timeout=60) == (5,)
        assert board.served_offer(1) == 3 and board.served(1, [0, 1]) is None  # sender 0 never answered
    finally:
        child.join(timeout=60)
    assert child.exitcode == 0


def test_waits_time_out_rings_count_and_slots_are_checked():
    board = TicketBoard.create(1)
    start = time.monotonic()
    assert board.wait_until(lambda: None, start + 0.05) is None
    assert time.monotonic() - start >= 0.05  # slept until the deadline, not less
    seen = native().board_events(board.region.address)
    board.ring()
    board.ring()
    assert board.rings() == 2 and native().board_events(board.region.address) == (seen + 2) % 2**32
    # Woken by the counter, not by the deadline: the counter already moved past `seen`.
    assert native().board_wait(board.region.address, seen, 60.0) != seen
    with pytest.raises(ValueError, match="sender rank 1 has no slot"):
        board.serve(1, 1, 1, 1)
    with pytest.raises(ValueError, match="for 2 senders"):
        TicketBoard.open(board.handle(), 2)


def test_native_words_refuse_unaligned_addresses():
    board = TicketBoard.create(1)
    with pytest.raises(RuntimeError, match="aligned"):
        native().board_load(board.region.address + 4)
    assert board.region.nbytes == board_bytes(1) == 4 * 64  # three lines of the receiver's, one slot


def _receiver_steps(rng: random.Random, tickets: int):
    """The receiver's stores, one word at a time ((word, value); word None: time
    passing with the ticket open), and each ticket's expected version."""
    steps, expects = [], {}
    if rng.random() < 0.3:
        steps.append((_CLOSED, 0))  # a restarted receiver closes the ticket its predecessor left
    for ticket in range(1, tickets + 1):
        expect = rng.choice([None, rng.randrange(100)])
        expects[ticket] = expect
        steps += [(_EXPECT, 0 if expect is None else expect), (_HAS_EXPECT, int(expect is not None)),
                  (_OPENED, ticket), *[(None, 0)] * rng.randrange(6), (_CLOSED, ticket)]
    return steps, expects


def test_a_ticket_read_while_the_receiver_stores_is_never_one_that_is_closed_or_not_asked_for():
    """read_ticket's loads interleaved at random with the receiver's stores (open:
    expect, has-expect, ticket; close: ticket), 20,000 reads: an "open" answer is a
    ticket opened and not closed at its last load, with that ticket's expected
    version; NOT_YET a ticket not opened at its first load; MOVED one closed, or
    passed, by its last load."""
    rng = random.Random(0)
    outcomes = {"open": 0, NOT_YET: 0, MOVED: 0}
    for _ in range(20_000):
        steps, expects = _receiver_steps(rng, rng.randint(1, 4))
        words = {_OPENED: 0, _EXPECT: 0, _HAS_EXPECT: 0, _CLOSED: 0}
        position = rng.randrange(len(steps) + 1)  # the receiver's stores made before the read starts
        for index, value in steps[:position]:
            if index is not None:
                words[index] = value
        # Mostly the ticket open (or opening) where the read starts, else a neighbour.
        current = sum(index == _OPENED for index, _ in steps[:position])
        candidate = max(1, current + rng.choice([-1, 0, 0, 0, 1, 1]))
        states = []  # (opened, closed) at each load

        def load(index):
            nonlocal position
            for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 4])):  # the receiver moves on between two loads
                if position < len(steps):
                    if steps[position][0] is not None:
                        words[steps[position][0]] = steps[position][1]
                    position += 1
            states.append((words[_OPENED], words[_CLOSED]))
            return words[index]

        found = read_ticket(load, candidate)
        opened_first, _ = states[0]
        opened_last, closed_last = states[-1]
        if isinstance(found, tuple):
            outcomes["open"] += 1
            assert opened_last == candidate and closed_last < candidate, (found, candidate, states)
            assert found == (expects[candidate],), (found, candidate, expects)
        elif found == NOT_YET:
            outcomes[NOT_YET] += 1
            assert opened_first < candidate, (candidate, states)
        else:
            assert found == MOVED
            outcomes[MOVED] += 1
            assert closed_last >= candidate or opened_last > candidate, (candidate, states)
    assert min(outcomes.values()) > 1000, outcomes


def test_a_shared_memory_sync_hands_over_on_the_board_without_a_blocking_store_wait():
    """Ten versions between a sender and a receiver (two threads) over shared memory: neither
    side makes a blocking Store wait (the board carries both hand-shakes), every
    version lands, and an offer whose withdrawal the Store has not seen yet is not
    taken for a new one (pending() reads the board's count of the send that served)."""
    import datetime

    import torch.distributed as dist

    from helpers import in_threads, small_config, store_client
    from llamarl_core.sync import WeightReceiver, WeightSender
    from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp

    config = small_config("llama_gqa_bias")
    src, dst = hf_llama_fsdp(config, 1, torch.float32), vllm_llama_tp(config, 1, torch.float32)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    shards = {n: torch.randn(shape) for n, (shape, _) in src.local_tensor_specs(0).items()}
    receiver, sender = in_threads(
        lambda: WeightReceiver(store_client(store), dst, 0,
                               {n: torch.zeros(s, dtype=d) for n, (s, d) in dst.local_tensor_specs(0).items()},
                               name="board", transport="shm", timeout=30),
        lambda: WeightSender(store_client(store), src, 0, shards, name="board", transport="shm", timeout=30))
    waits = {"count": 0}
    for endpoint in (receiver, sender):
        wait_get = endpoint.channel.store.wait_get

        def counted(*args, _wait_get=wait_get, **kwargs):
            waits["count"] += 1
            return _wait_get(*args, **kwargs)

        endpoint.channel.store.wait_get = counted
    sender.reports.withdraw = lambda dsts: None  # as if the Store had not seen any withdrawal yet
    for version in range(1, 11):
        handle = sender.send(version, wait=False)
        assert_offered = time.monotonic() + 30
        while receiver.pending() != version:
            assert time.monotonic() < assert_offered
            time.sleep(0.001)
        assert receiver.receive() == version and handle.wait(timeout=30) > 0
        assert receiver.pending() is None  # the offer still stands in the Store, served
    assert waits["count"] == 0
    assert receiver.tensors["model.layers.0.self_attn.o_proj.weight"].equal(
        shards["model.layers.0.self_attn.o_proj.weight"])
    sender.close()
    receiver.close()
