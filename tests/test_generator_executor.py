"""The generator executor's pause for a new version: OfferWait's decision over
thousands of random orders of commands, offers and clocks, then the executor
itself (GeneratorRank, its real Link over a TCPStore, our generator and the
trainer's real WeightSender) sampling on while a version is announced but not
offered, and pausing once it is."""

import datetime
import random
import threading
import time

import pytest
import torch.distributed as dist

from helpers import in_threads, store_client
from llamarl_core.control import StoreQueue
from llamarl_core.control.auth import new_secret
from llamarl_core.models.sharded import init_random
from llamarl_core.pipeline.config import TrainConfig
from llamarl_core.pipeline.data import RunData
from llamarl_core.pipeline.executors.generator import SAMPLE, STOP, TAKE, GeneratorRank, OfferWait
from llamarl_core.pipeline.executors.link import EVENTS, GENERATOR, Link, inbox_name, sync_name_of
from llamarl_core.pipeline.executors.trainer import trainer_model
from llamarl_core.pipeline.generators import LlamaGeneratorBackend
from llamarl_core.pipeline.messages import Prompts, Receive, Received, Samples, Stop
from llamarl_core.sync import module_sender


TOKENS = 64  # per sample: a version offered mid-way lands between two of its decode steps


def _receive(version: int, attempt: int = 1) -> Receive:
    return Receive(version=version, evaluate=None, relay_to=[], attempt=attempt)


def test_offer_wait_over_random_orders_of_commands_offers_and_clocks():
    """Without a Receive: take the commands if a Stop waits, else sample on (and
    forget the clock). With one, for the first Receive waiting (asked of its offer
    alone): take it once offered; else stop if a Stop waits; else take it once
    `patience_s` has passed since that Receive (version and attempt) was first
    seen, the clock restarting for another; else sample on."""
    rng = random.Random(41)
    verdicts = set()
    for _ in range(300):
        patience = rng.choice([0.5, 1.0, 3.0])
        wait = OfferWait(patience)
        now, first_seen = 0.0, {}
        for _ in range(30):
            now += rng.choice([0.0, 0.1, 0.4, 1.2])
            commands = [rng.choice([_receive(rng.randint(1, 3), rng.randint(1, 2)), Prompts(groups=[]), Stop()])
                        for _ in range(rng.randint(0, 3))]
            offer = rng.choice([None, 1, 2, 3])
            asked = []

            def offered(version, asked=asked, offer=offer):
                asked.append(version)
                return offer is not None and offer >= version

            got = wait.decide(commands, now, offered)
            verdicts.add(got)
            receives = [c for c in commands if isinstance(c, Receive)]
            stop = any(isinstance(c, Stop) for c in commands)
            if not receives:
                assert got == (TAKE if stop else SAMPLE) and not asked
                first_seen.clear()
                continue
            key = (receives[0].version, receives[0].attempt)
            if key not in first_seen:
                first_seen.clear()
                first_seen[key] = now
            assert asked == [key[0]]
            if offer is not None and offer >= key[0]:
                assert got == TAKE
            elif stop:
                assert got == STOP
            else:
                assert got == (TAKE if now - first_seen[key] >= patience else SAMPLE)
    assert verdicts == {SAMPLE, TAKE, STOP}


def test_offer_wait_refuses_a_patience_that_is_not_positive():
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="patience_s"):
            OfferWait(bad)


def _events_until(events: StoreQueue, kind: type, seconds: float = 60.0) -> list:
    """The reports up to and including the first of `kind` (AssertionError after `seconds`)."""
    got = []
    while not got or not isinstance(got[-1], kind):
        event = events.get(seconds)
        assert event is not None, f"no {kind.__name__} within {seconds} s; reports so far: {got}"
        got.append(event.body)
    return got


def test_the_executor_samples_on_until_an_announced_version_is_offered_then_takes_it():
    """Prompts with a Receive right behind them: while the trainer has not offered
    that version the replica samples every prompt to its end with the weights it
    holds, and takes the version once it has nothing to sample (before, it paused
    at once and sampled nothing until the trainer sent). A version announced and
    offered while it samples is taken between two decode steps. A Stop behind a
    version never offered stops it at once."""
    config = TrainConfig()
    data = RunData(config)
    secret, name = new_secret(), sync_name_of(1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    trainer = trainer_model(data, config, None)
    init_random(trainer, 3)

    def generator():
        return LlamaGeneratorBackend(
            data.model_config, tp=1, rank=0, store=store_client(store), secret=secret, sync_name=name, timeout_s=30,
            max_batch=64, max_new_tokens=TOKENS, segment_tokens=config.generator.segment_tokens, temperature=1.0,
            eos_token_id=data.model_config.vocab_size, pad_token_id=data.tokenizer.pad_token_id, seed=0)

    made = in_threads(generator, lambda: module_sender(store_client(store), trainer, 0, 1, name=name, timeout=30,
                                                       num_threads=1, secret=secret))
    assert not any(isinstance(m, Exception) for m in made), made
    backend, sender = made
    # Version 3 is sent once the replica has asked for it a few times (each decode step
    # asks), and the replica held in that ask until the offer shows: so the version lands
    # mid-way through the samples, however slow this machine runs.
    offered, asks = backend.weights_offered, []

    def offered_after_a_few_steps(version: int) -> bool:
        asks.append(version)
        if version == 3 and asks.count(3) == 5:
            asks.append(sender.send(3, wait=False))
            deadline = time.monotonic() + 30
            while not offered(3):
                assert time.monotonic() < deadline, "version 3 was not offered within 30 s"
                time.sleep(0.01)
        return offered(version)

    backend.weights_offered = offered_after_a_few_steps
    inbox = inbox_name(GENERATOR, 0, 1)
    link = Link(store_client(store), GENERATOR, 0, 1, inbox, timeout_s=60, secret=secret)
    commands, events = StoreQueue(store_client(store), inbox, secret), StoreQueue(store_client(store), EVENTS, secret)
    executor = GeneratorRank(link, config, backend, tp_rank=0)
    thread = threading.Thread(target=executor.run)
    thread.start()
    try:
        events.get(10)  # Ready
        prompts = Prompts(groups=[(g, [1, 5 + g, 9]) for g in range(4)])
        commands.put(_receive(1))
        sender.send(1)
        assert _events_until(events, Received)[-1].version == 1

        commands.put(prompts)
        commands.put(_receive(2))  # announced; the trainer does not send it yet
        samples = []
        while len(samples) < 4 * config.run.samples_per_prompt:
            reports = _events_until(events, Samples)
            assert not any(isinstance(r, Received) for r in reports), reports
            samples += reports[-1].samples
        assert all(x.versions == [1] * TOKENS for x in samples)
        sender.send(2)  # the replica, idle, waits in its receive
        assert _events_until(events, Received)[-1].version == 2

        commands.put(prompts)
        commands.put(_receive(3))  # offered while the replica samples with version 2
        reports = []
        while sum(len(r.samples) for r in reports if isinstance(r, Samples)) < 4 * config.run.samples_per_prompt:
            reports += _events_until(events, Samples)
        handle = asks[asks.index(3) + 5]
        assert handle.wait(timeout=30) > 0
        assert [r.version for r in reports if isinstance(r, Received)] == [3]
        samples = [x for r in reports if isinstance(r, Samples) for x in r.samples]
        # Taken between two decode steps, the samples going on with it (partial rollouts).
        for x in samples:
            assert x.versions[0] == 2 and x.versions[-1] == 3 and x.versions == sorted(x.versions), x.versions

        # The run stops (on an error) with a version announced that the trainer never
        # offers: the replica stops at once, not after a receive's timeout (20 s).
        commands.put(prompts)
        commands.put(_receive(4))
        commands.put(Stop())
        start = time.monotonic()
        thread.join(30)
        assert not thread.is_alive() and time.monotonic() - start < 5
        assert 4 in asks
    finally:
        commands.put(Stop())
        thread.join(30)
        backend.close()
        sender.close()
        for queue in (link, commands, events):
            queue.close()
    assert not thread.is_alive()
