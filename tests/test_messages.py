"""Controller <-> executor messages over a torch.distributed Store
(llamarl_core.control): order per producer and nothing lost or repeated
under random interleavings of producers and the consumer, a producer killed
mid-put costs only its own messages, a Store that goes away is reported, and
the heartbeat tells a live process from a gone one. What a stranger pushes into a
queue (a pickle, a message under another secret, one copied from another queue,
a copy of one taken before, a forged close) is dropped and counted, never run;
the data-only encoding (wire.py) gives back exactly what was sent and refuses
anything else."""

from __future__ import annotations

import math
import pickle
import random
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from llamarl_core.control import Heartbeat, HeartbeatWatch, QueueClosed, StoreQueue, auth, wire
from llamarl_core.pipeline.rollout import Sample

ROUNDS = 200
SECRET = auth.new_secret()


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
    consumer = StoreQueue(store, "q", SECRET)
    producers = [StoreQueue(store.clone(), "q", SECRET) for _ in range(5)]
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
    assert total > 4000
    assert dist.PrefixStore("llamarl/queue/q/", store).queue_len("messages") == 0  # every message taken, once


def test_objects_round_trip(store):
    queue = StoreQueue(store, "objects", SECRET)
    sample = Sample(3, [1, 2], [5, 6, 7], [-0.5, -1.25, -2.0], [4, 4, 5], True, 0.75)
    payload = ("generator", 1, "samples", {"samples": [sample], "busy": 0.125, "blob": bytes(range(256)) * 300})
    StoreQueue(store, "objects", SECRET).put(payload)
    assert queue.get(5) == payload


def test_a_producer_killed_while_putting_costs_only_its_own_messages(store):
    """A producer process SIGKILLed in the middle of its puts: the consumer gets a
    prefix of its messages, in order, and the next producer's message at once,
    never waiting on what the dead one had begun."""
    code = ("import sys, torch.distributed as d; from llamarl_core.control import StoreQueue; "
            "q = StoreQueue(d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=False), 'killed', bytes.fromhex(sys.argv[2])); "
            "[q.put(('n', i)) or (i == 50 and print('putting', flush=True)) for i in range(10 ** 9)]")
    queue = StoreQueue(store, "killed", SECRET)
    for _ in range(2):
        producer = subprocess.Popen([sys.executable, "-c", code, str(store.port), SECRET.hex()], stdout=subprocess.PIPE,
                                    text=True)
        assert producer.stdout.readline() == "putting\n"
        producer.kill()
        producer.wait(10)
        StoreQueue(store.clone(), "killed", SECRET).put("after")
        got, start = [], time.monotonic()
        while (message := queue.get(5)) != "after":
            assert message is not None, "the consumer waited on the killed producer"
            got.append(message)
        assert time.monotonic() - start < 5 and queue.dropped == 0
        assert [i for _, i in got] == list(range(len(got))) and len(got) > 50


def test_a_store_that_goes_away_is_reported():
    """The consumer's Store served by another process, which is killed: get raises
    QueueClosed (the executors' "the controller is gone") instead of waiting on."""
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True, "
                               "wait_for_workers=False); print(s.port, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        queue = StoreQueue(dist.TCPStore("127.0.0.1", port, is_master=False), "gone", SECRET)
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
    # The watch sees a beat when it looks: one that came between its last look and stop() counts
    # from now (under load the window is wide enough to catch one).
    watch.silent_for()
    time.sleep(0.7)
    assert not watch.alive() and watch.silent_for() > 0.5
    never = HeartbeatWatch(store, "never", grace_s=0.2)
    time.sleep(0.3)
    assert not never.alive()


# ----------------------------------------------------------------------------- what a stranger writes


class _CreatesAFile:
    """Unpickling this calls open(path, "w"): the file appears if anything unpickles it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_forged_messages_are_dropped_counted_and_never_run(store, tmp_path):
    """A stranger on the Store (its own connection, the source's key names, not the
    secret) pushes into the queue, between real messages: a pickle whose unpickling
    creates a file, a message tagged under another secret, a real message's bytes
    copied from another queue, a copy of a real message of this queue taken before
    (pushed again), a well-tagged body that does not parse (the reader's parser,
    not the tag, refuses it), too short a tagged item, the old unsigned close marker
    and an unsigned empty body (a close must be signed). The consumer gets exactly
    the real messages in order; the rest are counted and the file never appears."""
    marker = tmp_path / "pwned"
    name = "inbox/trainer/0/0"
    consumer = StoreQueue(store, name, SECRET)
    producer = StoreQueue(store.clone(), name, SECRET)
    stranger = dist.PrefixStore(f"llamarl/queue/{name}/", store.clone())
    other_secret = auth.new_secret()
    header = producer._producer + (1).to_bytes(8, "big")  # what the producer's first message carries (white box)

    def signed(secret: bytes, queue_name: str, body: bytes, head: bytes = header) -> bytes:
        return auth.sign(secret, f"llamarl/queue/{queue_name}", head + body)

    forged = [
        pickle.dumps(_CreatesAFile(marker)),
        signed(other_secret, name, wire.encode(("stop", {}))),
        signed(SECRET, "events", wire.encode(("train", {"step": 666})), bytes(16) + (7).to_bytes(8, "big")),
        signed(SECRET, name, wire.encode(("train", {"step": 0}))),  # the producer's first message, again
        signed(SECRET, name, b"\x00\x00\x00\x05{\"$x\":1}", bytes(16) + (9).to_bytes(8, "big")),
        auth.sign(SECRET, f"llamarl/queue/{name}", b"short"),
        b"llamarl:close-queue",
        b"",
    ]
    for i, value in enumerate(forged):
        producer.put(("train", {"step": i}))
        if i == 0:
            assert consumer.get(5) == ("train", {"step": 0})  # taken before its copy comes
        stranger.queue_push("messages", value)
        # A push is not answered: one answered request on the same connection after it, so
        # that the server has the forged item before the next real one (another connection's).
        stranger.add("pushed", 1)
    producer.put(("train", {"step": len(forged)}))
    got = [("train", {"step": 0})]
    deadline = time.monotonic() + 20
    while len(got) < len(forged) + 1 and time.monotonic() < deadline:
        if (message := consumer.get(0.1)) is not None:
            got.append(message)
    assert got == [("train", {"step": i}) for i in range(len(forged) + 1)]
    assert consumer.dropped == len(forged) and auth.refused_count() >= len(forged)
    assert not marker.exists()
    consumer.close()


def test_a_store_without_queues_is_named():
    """The legacy TCPStore backend has no queues: the put says what StoreQueue needs."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=False)
    with pytest.raises(RuntimeError, match="this Store has no queues.*torch 2.8 or later on its libuv backend"):
        StoreQueue(server, "legacy", SECRET).put("x")


def test_a_queue_needs_a_secret(store, monkeypatch):
    """Bytes of 16 or more; None reads the environment (auth.required_secret), and
    with nothing set there either it is refused."""
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    for secret in (None, b"", b"short", "0" * 64):
        with pytest.raises(ValueError, match="secret"):
            StoreQueue(store, "nosecret", secret)


# ----------------------------------------------------------------------------- wire.py


def _random_tree(rng: random.Random, depth: int = 0):
    leaves = [None, True, False, rng.randint(-2**70, 2**70), rng.uniform(-1e6, 1e6), math.inf, -math.inf, math.nan,
              "".join(rng.choice("ab$\\\"\u00e9\u4e2d\n") for _ in range(rng.randint(0, 6))),
              bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))]
    kind = rng.randrange(10 if depth < 4 else 2)
    if kind == 0:
        return rng.choice(leaves)
    if kind == 8:  # a long list of one number type (raw bytes on the wire), at times with one odd value in it
        make = rng.choice([lambda: rng.randint(-2**63, 2**63 - 1), lambda: rng.uniform(-1e6, 1e6),
                           lambda: rng.choice([math.nan, math.inf, -0.0, 5e-324])])
        values = [make() for _ in range(rng.randint(wire.PACK_MIN - 1, 3 * wire.PACK_MIN))]
        if values and rng.random() < 0.3:
            values[rng.randrange(len(values))] = rng.choice([True, 2**64, 3, 0.5, None, "x"])
        return values
    if kind == 1:
        dtype = rng.choice(list(wire.DTYPES.values()))
        shape = [rng.randint(0, 3) for _ in range(rng.randint(0, 3))]
        t = torch.randint(0, 255, shape, dtype=torch.uint8).to(dtype) if dtype != torch.bool else torch.rand(shape) < 0.5
        return t.transpose(0, -1) if t.dim() > 1 and rng.random() < 0.5 else t  # also non-contiguous
    if kind == 2:
        return [_random_tree(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == 3:
        return tuple(_random_tree(rng, depth + 1) for _ in range(rng.randint(0, 4)))
    if kind == 4:
        return {rng.choice(["a", "$tuple", "$items", "b", "$", ""]) + str(i): _random_tree(rng, depth + 1)
                for i in range(rng.randint(0, 3))}
    if kind == 5:
        return {rng.choice([1, 2.5, ("t", 1), None, True, b"k", "$data"]): _random_tree(rng, depth + 1)}
    if kind == 6:
        return {rng.choice(["$tuple", "$bytes", "$tensor", "$data", "$items", "$other"]): _random_tree(rng, depth + 1)}
    if kind == 9:  # a list of Samples: a column per field on the wire
        return [_random_sample(rng) for _ in range(rng.randint(1, 6))]
    return _random_sample(rng)


def _random_sample(rng: random.Random) -> Sample:
    """A Sample; at times with a value in a list that no column of numbers holds (a
    bool, an int beyond int64, a float among ints) or a float that JSON would lose
    the sign of."""
    n = rng.randint(0, 5)
    sample = Sample(rng.randint(0, 9), [rng.randint(0, 99) for _ in range(3)], list(range(n)),
                    [rng.uniform(-5, 0) for _ in range(n)], [rng.randint(0, 3) for _ in range(n)],
                    rng.random() < 0.5, rng.choice([None, rng.random()]), rng.random() < 0.5)
    if n and rng.random() < 0.3:
        getattr(sample, rng.choice(["tokens", "logprobs", "versions"]))[rng.randrange(n)] = rng.choice(
            [True, 2**70, 0.5, 7, -0.0, math.nan])
    return sample


def _same(a, b) -> bool:
    """Equal as data: same types all the way down, tensors bit-equal with their dtype and shape, NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8) if a.numel()
                                                                         else a, b.reshape(-1).view(torch.uint8)
                                                                         if b.numel() else b)
    if isinstance(a, float):
        return (a == b and math.copysign(1, a) == math.copysign(1, b)) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return len(a) == len(b) and all(_same(ka, kb) and _same(va, vb)
                                        for (ka, va), (kb, vb) in zip(a.items(), b.items()))
    if isinstance(a, Sample):
        return _same(vars(a), vars(b))
    return a == b


def test_wire_gives_back_exactly_what_was_sent():
    """2,000 random trees of every type the encoding carries (tensors of every dtype,
    empty, 0-d and non-contiguous; dicts whose keys look like tags; NaN and huge
    ints; long lists of ints or floats, packed, and the same with one bool, huge
    int or other value in them, not; Samples) come back equal, type for type and
    bit for bit (-0.0 included)."""
    rng = random.Random(0)
    for _ in range(2000):
        tree = _random_tree(rng)
        assert _same(wire.decode(wire.encode(tree)), tree), tree
    packed = wire.encode([list(range(wire.PACK_MIN)), [0.5] * wire.PACK_MIN, [1] * (wire.PACK_MIN - 1) + [True]])
    assert b'{"$ints":' in packed and b'{"$floats":' in packed and b"true" in packed
    for lists in ([[1, 2], [], [3]], [[0.5], [-0.0, math.nan]], [[], []]):
        assert b'{"$ragged":' in wire.encode(lists) and _same(wire.decode(wire.encode(lists)), lists)
    for mixed in ([[1, 2], [0.5]], [[1], [True]], [[1], [2**64]], [[1], "x"]):
        assert b"$ragged" not in wire.encode(mixed) and _same(wire.decode(wire.encode(mixed)), mixed)


def test_wire_refuses_what_is_not_data(tmp_path):
    for value, culprit in [(lambda: 0, "function"), (object(), "object"), ({1, 2}, "set"),
                           ({"a": [1, _CreatesAFile(tmp_path / "x")]}, "_CreatesAFile"),
                           (torch.zeros(2, dtype=torch.complex64), "complex64")]:
        with pytest.raises(TypeError, match=culprit) as error:
            wire.encode(("x", value))
        assert "the message[1]" in str(error.value)
    assert wire.encode(("metric", __import__("numpy").float32(0.5))) == wire.encode(("metric", 0.5))


def test_wire_decode_refuses_anything_else_with_wire_error(tmp_path):
    """Malformed input of every kind is a WireError, nothing else: unknown tags,
    dataclasses and dtypes, spans outside the raw bytes, a size that is not the
    shape's, fields a Sample does not have, deep nesting, a pickle; and 3,000 random
    corruptions of real messages either decode to data or raise WireError."""
    def header(obj, raw: bytes = b"") -> bytes:
        text = __import__("json").dumps(obj).encode()
        return len(text).to_bytes(4, "big") + text + raw

    bad = [b"", b"\x00\x00", b"\x00\x00\x00\x09{}", header(None)[:-1] + b"x", pickle.dumps(_CreatesAFile(tmp_path / "y")),
           header({"$nope": 1}), header({"$tuple": 5}), header({"$bytes": [0, 5]}, b"abc"), header({"$bytes": [-1, 1]}, b"a"),
           header({"$bytes": [True, 1]}, b"a"), header({"$tensor": ["complex64", [1], 0, 8]}, bytes(8)),
           header({"$tensor": ["float32", [2], 0, 4]}, bytes(8)), header({"$tensor": ["float32", [-1], 0, 4]}, bytes(4)),
           header({"$tensor": ["float32", [1.5], 0, 4]}, bytes(4)), header({"$data": ["Popen", {}]}),
           header({"$data": ["Sample", {"group": 1}]}), header({"$items": [[1]]}), b"\x00\x00\x00\x02[" + b"[" * 5000,
           header({"$ints": [0, 12]}, bytes(12)), header({"$floats": [0, 16]}, bytes(8)), header({"$ints": 3}),
           header({"$ragged": ["$ints", [0, 8], [8, 8]]}, (5).to_bytes(8, "little") + bytes(8)),
           header({"$ragged": ["$ints", [0, 8], [8, 0]]}, (-1).to_bytes(8, "little", signed=True)),
           header({"$ragged": ["$tuple", [0, 0], [0, 0]]}), header({"$ragged": ["$ints", 1, 2]}),
           header({"$table": ["Sample", {"group": [1, 2], "prompt": [[1]]}]}), header({"$table": ["Popen", {}]}),
           header({"$table": ["Sample", {f.name: [0] for f in __import__("dataclasses").fields(Sample)} | {"x": [1]}]}),
           header({"$table": ["Sample", {"group": 3}]}),
           header({"$data": ["Sample", {f.name: 0 for f in __import__("dataclasses").fields(Sample)} | {"x": 1}]})]
    for data in bad:
        with pytest.raises(wire.WireError):
            wire.decode(data)
    rng = random.Random(1)
    corpus = [wire.encode(_random_tree(rng)) for _ in range(100)]
    for _ in range(3000):
        data = bytearray(rng.choice(corpus))
        for _ in range(rng.randint(1, 4)):
            if data and rng.random() < 0.7:
                data[rng.randrange(len(data))] = rng.randrange(256)
            else:
                del data[rng.randrange(len(data) + 1):]
        try:
            wire.decode(bytes(data))
        except wire.WireError:
            pass
    assert not (tmp_path / "y").exists()


def test_wire_carries_only_registered_dataclasses_and_a_name_is_held_by_one_class():
    """A dataclass travels once its module registered it (the pipeline's Sample);
    another, or a second class under a registered name, is refused."""
    import dataclasses

    @dataclasses.dataclass
    class Unregistered:
        x: int

    with pytest.raises(TypeError, match="Unregistered"):
        wire.encode(("x", Unregistered(1)))
    assert wire.register(Sample) is Sample  # again: the same class, accepted

    @dataclasses.dataclass
    class Sample2:
        x: int

    Sample2.__name__ = "Sample"
    with pytest.raises(ValueError, match="the name 'Sample' is llamarl_core.pipeline.rollout.Sample's"):
        wire.register(Sample2)
    with pytest.raises(ValueError, match="takes a dataclass"):
        wire.register(int)

    @dataclasses.dataclass
    class Derived:
        x: int
        y: int = dataclasses.field(init=False, default=0)

    with pytest.raises(ValueError, match=r"fields \['y'\] are not __init__ arguments"):
        wire.register(Derived)
    assert "Derived" not in wire.DATACLASSES

    @wire.register
    @dataclasses.dataclass
    class NoFields:
        pass

    try:  # a list of them keeps its length (no columns to carry it)
        assert [type(x) for x in wire.decode(wire.encode([NoFields(), NoFields()]))] == [NoFields, NoFields]
    finally:
        del wire.DATACLASSES["NoFields"]
    assert wire.DATACLASSES["Sample"] is Sample
