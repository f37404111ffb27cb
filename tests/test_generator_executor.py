"""The generator executor's pause for a new version: OfferWait's decision over
thousands of random orders of commands, offers and clocks, then the executor
itself (GeneratorRank, its real Link over a TCPStore, our generator and the
trainer's real WeightSender) sampling on while a version is announced but not
offered, and pausing once it is."""

import datetime
import random
import threading

import pytest
import torch.distributed as dist

from helpers import in_threads, store_client
from llamarl_core.control import StoreQueue
from llamarl_core.control.auth import new_secret
from llamarl_core.models.sharded import init_random
from llamarl_core.pipeline.config import TrainConfig
from llamarl_core.pipeline.data import RunData
from llamarl_core.pipeline.executors.generator import GeneratorRank, OfferWait
from llamarl_core.pipeline.executors.link import EVENTS, GENERATOR, Link, inbox_name, sync_name_of
from llamarl_core.pipeline.executors.trainer import trainer_model
from llamarl_core.pipeline.generators import LlamaGeneratorBackend
from llamarl_core.pipeline.messages import Prompts, Receive, Received, Samples, Stop
from llamarl_core.sync import module_sender


TOKENS = 64  # per sample: a version offered mid-way lands between two of its decode steps


def _receive(version: int, attempt: int = 1) -> Receive:
    return Receive(version=version, evaluate=None, relay_to=[], attempt=attempt)


def test_offer_wait_over_random_orders_of_commands_offers_and_clocks():
    """Pauses at once for a Stop anywhere in the queue; never without a Receive
    (and then forgets the clock); for the first Receive waiting: once offered that
    version (asked only for it), or once `patience_s` has passed since that
    Receive (version and attempt) was first seen, the clock restarting for another."""
    rng = random.Random(41)
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

            got = wait.pause(commands, now, offered)
            receives = [c for c in commands if isinstance(c, Receive)]
            if any(isinstance(c, Stop) for c in commands):
                assert got and not asked
                continue
            if not receives:
                assert not got and not asked
                first_seen.clear()
                continue
            key = (receives[0].version, receives[0].attempt)
            if key not in first_seen:
                first_seen.clear()
                first_seen[key] = now
            timed_out = now - first_seen[key] >= patience
            assert got == (timed_out or offer is not None and offer >= key[0])
            assert asked == ([] if timed_out else [key[0]])


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
    offered while it samples is taken between two decode steps."""
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
        commands.put(_receive(3))
        handle = sender.send(3, wait=False)  # offered while the replica samples with version 2
        reports = []
        while sum(len(r.samples) for r in reports if isinstance(r, Samples)) < 4 * config.run.samples_per_prompt:
            reports += _events_until(events, Samples)
        assert handle.wait(timeout=30) > 0
        assert [r.version for r in reports if isinstance(r, Received)] == [3]
        samples = [x for r in reports if isinstance(r, Samples) for x in r.samples]
        # Taken between two decode steps, the samples going on with it (partial rollouts).
        for x in samples:
            assert 3 in x.versions and x.versions == sorted(x.versions) and set(x.versions) <= {2, 3}, x.versions
    finally:
        commands.put(Stop())
        thread.join(30)
        backend.close()
        sender.close()
        for queue in (link, commands, events):
            queue.close()
    assert not thread.is_alive()
