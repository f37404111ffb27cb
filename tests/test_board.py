"""The ticket board (sync/board.py): its words and futex across real processes, the
sender's reading of the open ticket and the receiver's reading of an answer under
thousands of random interleavings with the other side's stores, and that a sync
over shared memory runs its hand-shakes on it and nowhere else."""

import multiprocessing
import random
import time

import pytest
import torch

from llamarl_core._native import native
from llamarl_core.sync.board import (
    _CLOSED,
    _DONE_KIND,
    _DONE_SEQ,
    _DONE_TICKET,
    _DONE_VERSION,
    _DONE_WROTE,
    _EXPECT,
    _HAS_EXPECT,
    _OPENED,
    _SLOTS,
    FAILED,
    SERVED,
    STALE,
    TicketBoard,
    board_bytes,
    read_open,
    to_serve,
)
from llamarl_core.sync.errors import SyncError


def _serve_when_open(handle: dict, results) -> None:
    """A sender in another process: wait for a ticket, answer it, report what it was asked."""
    board = TicketBoard.open(handle, 2)
    asked = board.wait_until(lambda: to_serve(0, board.current()), time.monotonic() + 60)
    board.answer(1, asked[0], SERVED, 7, True, 3)
    results.put(asked)


def test_a_process_sleeping_on_the_board_wakes_when_a_ticket_opens_and_answers_on_it():
    board = TicketBoard.create(2, "the test")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_serve_when_open, args=(board.handle(), results))
    child.start()
    try:
        assert board.answers(1, [1]) == [None] and board.served_offer(1) == 0 and board.current() is None
        board.open_ticket(1, 5)
        assert board.wait_until(lambda: board.answers(1, [1])[0], time.monotonic() + 60) == (SERVED, 7, True)
        assert results.get(timeout=60) == (1, 5)
        assert board.served_offer(1) == 3 and board.answers(1, [0, 1]) == [None, (SERVED, 7, True)]
        assert board.answers(2, [1]) == [None]  # an answer to ticket 1 is no answer to ticket 2
        board.close_ticket(1)
        assert board.current() is None and board.opened() == 1
    finally:
        child.join(timeout=60)
    assert child.exitcode == 0


def test_a_board_that_cannot_be_made_or_mapped_is_a_sync_error_naming_its_owner():
    board = TicketBoard.create(1, "the test")
    gone = board.handle() | {"pid": 2**22 + 12345}  # no such process
    with pytest.raises(SyncError, match="sender rank 3: cannot map the receiver's ticket board"):
        TicketBoard.open(gone, 1, "sender rank 3")


def test_waits_time_out_rings_count_and_slots_are_checked():
    board = TicketBoard.create(1, "the test")
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
        board.answer(1, 1, SERVED, 1, True, 1)
    with pytest.raises(ValueError, match="for 2 senders"):
        TicketBoard.open(board.handle(), 2)


def test_an_answer_after_a_writer_died_mid_answer_reads_whole_and_only_served_counts_an_offer():
    """A writer killed between the two stores of a slot's sequence count leaves it
    odd: the next answer still reads whole (the count taken up from there). A STALE
    or FAILED answer leaves the count of the send that last served as it was."""
    board = TicketBoard.create(1, "the test")
    board.answer(0, 1, SERVED, 3, True, 7)
    board._store(board._slot(0, _DONE_SEQ), board._load(board._slot(0, _DONE_SEQ)) + 1)  # died mid-answer
    assert board.answers(1, [0]) == [None]  # a count left odd: no answer reads
    board.answer(0, 2, STALE, 4, False)
    assert board.answers(2, [0]) == [(STALE, 4, False)] and board.served_offer(0) == 7
    board.answer(0, 3, FAILED, 0, True)
    assert board.answers(3, [0]) == [(FAILED, 0, True)] and board.served_offer(0) == 7


def test_native_words_refuse_unaligned_addresses():
    board = TicketBoard.create(1, "the test")
    with pytest.raises(RuntimeError, match="aligned"):
        native().board_load(board.region.address + 4)
    assert board.region.nbytes == board_bytes(1) == 4 * 64  # three lines of the receiver's, one slot


def _receiver_steps(rng: random.Random, tickets: int):
    """The receiver's stores, one word at a time ((word, value); word None: time
    passing with the ticket open), and each ticket's expected version."""
    steps, expects = [], {}
    for ticket in range(1, tickets + 1):
        expect = rng.choice([None, rng.randrange(100)])
        expects[ticket] = expect
        steps += [(_EXPECT, 0 if expect is None else expect), (_HAS_EXPECT, int(expect is not None)),
                  (_OPENED, ticket), *[(None, 0)] * rng.randrange(6), (_CLOSED, ticket)]
    return steps, expects


def _interleaved(rng: random.Random, steps: list, words: dict, position: int):
    """A load function over `words` that lets the other side make 0-4 of its `steps`
    (from `position` on) before each load; and the list of `words` copies at each load."""
    seen = []

    def load(index):
        nonlocal position
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 4])):
            if position < len(steps):
                if steps[position][0] is not None:
                    words[steps[position][0]] = steps[position][1]
                position += 1
        seen.append(dict(words))
        return words[index]

    return load, seen


def test_the_open_ticket_read_while_the_receiver_stores_is_never_one_closed_or_not_asked_for():
    """read_open's loads interleaved at random with the receiver's stores (open:
    expect, has-expect, ticket; close: ticket), 20,000 reads: a ticket it returns
    was opened and not closed at its last load, with that ticket's expected
    version; None only when the ticket opened at its first load was closed by its
    last (the sender looks again at the next event); and to_serve never hands a
    sender a ticket it served."""
    rng = random.Random(0)
    outcomes = {"open": 0, "none": 0}
    for _ in range(20_000):
        steps, expects = _receiver_steps(rng, rng.randint(1, 4))
        words = {_OPENED: 0, _EXPECT: 0, _HAS_EXPECT: 0, _CLOSED: 0}
        position = rng.randrange(len(steps) + 1)  # the receiver's stores made before the read starts
        for index, value in steps[:position]:
            if index is not None:
                words[index] = value
        load, seen = _interleaved(rng, steps, words, position)
        found = read_open(load)
        last = seen[-1]
        if found is not None:
            outcomes["open"] += 1
            ticket, expect = found
            assert last[_OPENED] == ticket and last[_CLOSED] < ticket, (found, seen)
            assert expect == expects[ticket], (found, expects)
            served = rng.randrange(ticket + 2)
            assert to_serve(served, found) == (found if ticket > served else None)
        else:
            outcomes["none"] += 1
            assert last[_CLOSED] >= seen[0][_OPENED], seen
    assert min(outcomes.values()) > 1000, outcomes


def test_an_answer_read_while_its_sender_writes_is_one_it_gave_whole():
    """TicketBoard.answers' loads interleaved at random with a sender's stores of
    its answers (several to one ticket, as a failure report's and a send's), 20,000
    reads: what it returns is one answer whole, to the ticket asked about; None
    while none is, or one is being written."""
    rng = random.Random(1)
    outcomes = {"answer": 0, "none": 0}
    fields = (_DONE_TICKET, _DONE_KIND, _DONE_VERSION, _DONE_WROTE)
    for _ in range(20_000):
        answers, steps, seq = [], [], 0
        for _ in range(rng.randint(1, 4)):
            answer = (rng.randint(1, 3), rng.choice([SERVED, STALE, FAILED]), rng.randrange(50), rng.randrange(2))
            answers.append(answer)
            steps += [(_DONE_SEQ, seq + 1), *zip(fields, answer), (_DONE_SEQ, seq + 2)]
            seq += 2
        words = {_DONE_SEQ: 0, _DONE_TICKET: 0, _DONE_KIND: 0, _DONE_VERSION: 0, _DONE_WROTE: 0}
        position = rng.randrange(len(steps) + 1)
        for index, value in steps[:position]:
            words[index] = value
        load, _ = _interleaved(rng, steps, words, position)
        board = TicketBoard.__new__(TicketBoard)
        board.num_senders = 1
        board._load = lambda index: load(index - _SLOTS)
        ticket = rng.randint(1, 3)
        (found,) = board.answers(ticket, [0])
        if found is None:
            outcomes["none"] += 1
        else:
            outcomes["answer"] += 1
            kind, version, wrote = found
            assert (ticket, kind, version, int(wrote)) in answers, (found, answers)
    assert min(outcomes.values()) > 1000, outcomes


def test_a_shared_memory_sync_hands_over_on_the_board_and_nowhere_else():
    """Ten versions between a sender and a receiver (two threads) over shared memory: neither
    side makes a blocking Store wait or writes a key a version's hand-shake would need
    (the board carries both hand-shakes: the Store holds the set-up, the offers and
    the failure count alone), every version lands, and an offer whose withdrawal the
    Store has not seen yet is not taken for a new one (pending() reads the board's
    count of the send that served)."""
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
    keys = {key.split("llamarl/sync/board//", 1)[1] for key in store.list_keys() if "llamarl/sync/board//" in key}
    assert keys == {"src/layout", "dst/layout", "src/bucket_bytes", "dst/bucket_bytes", "src/0/info", "dst/0/info",
                    "src/0/relay_buckets", "src/0/incarnation", "dst/0/incarnation", "dst/0/board", "dst/0/handle",
                    "dst/reregistered", "src/0/offer/0", "src/0/error", "src/failures"}, keys
    assert receiver.tensors["model.layers.0.self_attn.o_proj.weight"].equal(
        shards["model.layers.0.self_attn.o_proj.weight"])
    sender.close()
    receiver.close()
