"""Controller <-> executor messages over a torch.distributed Store
(llamarl_core.pipeline.messages): order per producer and nothing lost or repeated
under random interleavings of producers and the consumer, a slot whose producer
died is skipped (and a late one is not), a Store that goes away is reported, and
the heartbeat tells a live process from a gone one."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from llamarl_core.pipeline import messages
from llamarl_core.pipeline.messages import Heartbeat, HeartbeatWatch, QueueClosed, StoreQueue
from llamarl_core.pipeline.rollout import Sample

ROUNDS = 200


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_random_interleavings_keep_each_producers_order(store):
    """200 rounds: 1-5 producer threads (each with its queue object, so its own
    connection) put 1-40 messages each with random pauses while the consumer reads
    with random timeouts; every message arrives once, each producer's in its order,
    and the Store holds none of them after. The connections live through the rounds,
    as an executor's do through a run: a new TCPStore connection costs about 200 ms
    of the others' next request here, so a round of fresh ones would take seconds."""
    rng = random.Random(0)
    consumer = StoreQueue(store, "q")
    producers = [StoreQueue(store.clone(), "q") for _ in range(5)]
    total = 0
    for round_ in range(ROUNDS):
        counts = [rng.randint(1, 40) for _ in range(rng.randint(1, 5))]
        pauses = [[rng.choice((0, 0, 0, 1e-4, 1e-3)) for _ in range(n)] for n in counts]

        def produce(producer: int) -> None:
            for i, pause in enumerate(pauses[producer]):
                producers[producer].put((round_, producer, i))
                if pause:
                    time.sleep(pause)

        threads = [threading.Thread(target=produce, args=(p,)) for p in range(len(counts))]
        for t in threads:
            t.start()
        got = []
        deadline = time.monotonic() + 30
        while len(got) < sum(counts) and time.monotonic() < deadline:
            if rng.random() < 0.7:
                message = consumer.get(rng.choice((0.0005, 0.001, 0.01)))
            else:
                message = consumer.get_nowait()
                time.sleep(1e-4)  # a spinning consumer would hold the GIL from the producers for 5 ms at a time
            if message is not None:
                got.append(message)
        for t in threads:
            t.join()
        assert consumer.get_nowait() is None
        assert all(r == round_ for r, _, _ in got)
        for producer, n in enumerate(counts):
            assert [i for _, p, i in got if p == producer] == list(range(n)), (round_, producer)
        total += sum(counts)
    consumer.close()
    prefixed = dist.PrefixStore("llamarl/queue/q/", store)
    assert prefixed.add("tail", 0) == total + 1  # and close()'s own message to the reader
    assert not any(prefixed.check([str(i)]) for i in range(1, total + 2))  # every message deleted once read


def test_objects_round_trip(store):
    queue = StoreQueue(store, "objects")
    sample = Sample(3, [1, 2], [5, 6, 7], [-0.5, -1.25, -2.0], [4, 4, 5], True, 0.75)
    payload = ("generator", 1, "samples", {"samples": [sample], "busy": 0.125, "blob": bytes(range(256)) * 300})
    StoreQueue(store, "objects").put(payload)
    assert queue.get(5) == payload


def test_a_slot_whose_producer_died_is_skipped(store):
    """A producer that took a number and died before writing it: the consumer waits
    LOST_SLOT_S after later messages came, then goes on with them."""
    queue = StoreQueue(store, "lost")
    dist.PrefixStore("llamarl/queue/lost/", store).add("tail", 1)  # numbered, never written
    StoreQueue(store, "lost").put("after")
    start = time.monotonic()
    got = None
    while got is None and time.monotonic() - start < 10:
        got = queue.get(0.1)
    assert got == "after"
    assert 0.5 <= time.monotonic() - start < 3


def test_a_stalled_producer_writes_again_after_the_tombstone(store, monkeypatch):
    """A producer stalled between numbering and writing for longer than LOST_SLOT_S:
    its slot has been given up (tombstone), so its message goes under a new number
    and arrives after the others; nothing is lost."""
    monkeypatch.setattr(messages, "LOST_SLOT_S", 0.3)
    queue = StoreQueue(store, "stalled")
    stalled = StoreQueue(store, "stalled")
    raw = stalled._store  # the queue's namespace, on the stalled producer's connection
    taken = raw.add("tail", 1)  # the stalled producer's number
    StoreQueue(store, "stalled").put("other")
    got = None
    while got is None:
        got = queue.get(0.1)
    assert got == "other"
    # The stalled producer wakes and writes its slot as put() does: the tombstone answers.
    assert raw.compare_set(str(taken), "", b"late") == messages._TOMBSTONE
    stalled.put("late")  # the protocol's retry: a new number
    assert queue.get(5) == "late"


def test_a_late_message_is_not_skipped(store, monkeypatch):
    """A slot written late (its producer slow, not dead) is read, never replaced by
    the tombstone: compare_set writes only into an empty slot."""
    monkeypatch.setattr(messages, "LOST_SLOT_S", 0.3)
    queue = StoreQueue(store, "late")
    raw = dist.PrefixStore("llamarl/queue/late/", store)
    number = raw.add("tail", 1)
    StoreQueue(store, "late").put("second")
    assert queue.get(0.1) is None
    raw.set(str(number), __import__("pickle").dumps("first"))
    assert [queue.get(5), queue.get(5)] == ["first", "second"]


def test_a_store_that_goes_away_is_reported():
    """The consumer's Store served by another process, which is killed: get raises
    QueueClosed (the executors' "the controller is gone") instead of waiting on."""
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True, "
                               "wait_for_workers=False); print(s.port, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        queue = StoreQueue(dist.TCPStore("127.0.0.1", port, is_master=False), "gone")
        assert queue.get(0.05) is None
        server.kill()
        server.wait(10)
        with pytest.raises(QueueClosed, match="the Store is gone"):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                queue.get(0.1)
    finally:
        server.kill()
        server.wait(10)


def test_heartbeat_watch(store):
    watch = HeartbeatWatch(store, "beat", grace_s=0.5)
    assert watch.alive()  # grace from the watch's creation
    beat = Heartbeat(store, "beat", every_s=0.05)
    time.sleep(0.7)
    assert watch.alive() and watch.silent_for() < 0.3
    beat.stop()
    time.sleep(0.7)
    assert not watch.alive() and watch.silent_for() > 0.5
    never = HeartbeatWatch(store, "never", grace_s=0.2)
    time.sleep(0.3)
    assert not never.alive()
