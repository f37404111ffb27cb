"""The generator executor: one process per rank of each replica, sampling in
segments of decode steps and taking each new version of the weights between two of
them (partial rollouts)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from ...sync import StaleReceiveError, SyncError
from ..config import TrainConfig
from ..data import RunData
from ..generators import GeneratorContext, LlamaGeneratorBackend, plugin_generator
from ..messages import Prompts, Receive, ReceiveFailed, Received, Relay, Samples, Stop
from ..rollout import Sample
from .link import GENERATOR, INBOX_POLL_S, Link, dispatch, sync_name_of
from .resources import ALL_CORES, process_group


# OfferWait's verdicts.
SAMPLE = "sample"  # sample on: no version (or stop) is to be acted on yet
TAKE = "take"  # take the commands waiting, in order (a Receive: pause and receive it)
STOP = "stop"  # stop now: a Stop waits behind a version the trainer has not offered


class OfferWait:
    """When a generator replica pauses for a version the controller announced (a
    Receive): once the trainer's senders offer it (`offered(version)`: the
    receiver's pending(), asked by the replica's leader), not as soon as it is
    announced, so that a sender's work before its offer (the scans of a delta,
    stream.prescan) runs beside generation and the pause holds the transfer alone;
    and after `patience_s` without an offer of that version (its receive then
    waits, and times out, as any receive does: the executor's patience is half the
    sync's timeout, so that a receive it starts then still meets the senders'
    deadline). A Stop is taken at once, and stops the replica at once where a
    version not offered is waiting before it (the run is ending on an error: the
    controller stops only once every sync has landed). A pure decision: the caller
    asks it with the commands waiting, in order, and the time; the clock starts
    when a Receive (version and attempt) is first seen."""

    def __init__(self, patience_s: float):
        if not patience_s > 0:
            raise ValueError(f"patience_s must be > 0, got {patience_s!r}")
        self.patience_s = patience_s
        self._seen: tuple[tuple[int, int], float] | None = None  # ((version, attempt), first seen)

    def decide(self, commands, now: float, offered: Callable[[int], bool]) -> str:
        """SAMPLE, TAKE or STOP (above). `offered` is called for the first Receive
        waiting alone."""
        stop = any(isinstance(command, Stop) for command in commands)
        receive = next((command for command in commands if isinstance(command, Receive)), None)
        if receive is None:
            self._seen = None
            return TAKE if stop else SAMPLE
        key = (receive.version, receive.attempt)
        if self._seen is None or self._seen[0] != key:
            self._seen = (key, now)
        if offered(receive.version):
            return TAKE
        if stop:
            return STOP
        return TAKE if now - self._seen[1] >= self.patience_s else SAMPLE


class CommandFeed:
    """A replica's generator ranks' shared view of the controller's commands: its
    rank 0 (the leader) reads the inbox and broadcasts what it read over the
    replica's tensor-parallel group, with its OfferWait verdict where asked for one
    (on its own receiver's offers, standing for the replica's: a version's senders
    offer each of its ranks as soon as they have prepared it), so every rank takes
    the same decisions at the same decode step."""

    def __init__(self, link: Link, tp_size: int, leader: bool, offered: Callable[[int], bool], patience_s: float):
        self.link, self.tp_size, self.leader, self.offered = link, tp_size, leader, offered
        self.pending: deque = deque()
        self.wait = OfferWait(patience_s)

    def poll(self, block_s: float = 0.0, decide: bool = False) -> str | None:
        """Read what the inbox holds (waiting up to block_s for a first command);
        with decide, return the leader's OfferWait verdict on the commands then
        waiting, the same on every rank (None without decide)."""
        new, verdict = [], None
        if self.leader:
            first = self.link.get(block_s) if block_s > 0 else self.link.get_nowait()
            while first is not None:
                new.append(first)
                first = self.link.get_nowait()
            if decide:
                verdict = self.wait.decide([*self.pending, *new], time.monotonic(), self.offered)
        if self.tp_size > 1:
            box = [(new, verdict)]
            dist.broadcast_object_list(box, src=0)
            new, verdict = box[0]
        self.pending.extend(new)
        return verdict

    def weights_waiting(self) -> bool:
        """Asked between decode steps: is an offered version, or a stop, waiting?"""
        return self.poll(decide=True) != SAMPLE


def make_generator(config: TrainConfig, data: RunData, store, secret: bytes, rank: int, incarnation: int, out_dir: str,
                   replica: int = 0, children: dict[int, int] | None = None):
    """This rank's generator (generators.py): ours, one process per tensor-parallel
    rank, each replica's ranks in a process group of their own, the weights relayed
    from replica to replica; or a vLLM engine, whose tensor-parallel workers vLLM
    starts itself (this executor is its only rank). It starts with no weights
    (zeros, or vLLM's dummy ones): the first sync brings the trainer's. Set-up waits
    for the trainer as long as any executor may take to start (its supervised
    warm-up or checkpoint loading comes first). children: the incarnation of each replica this
    one relays to (their syncs' names)."""
    run, gen = config.run, config.generator
    tp, sync_name, seed = gen.tp, sync_name_of(incarnation), run.seed * 1000 + incarnation
    tokenizer = data.tokenizer
    max_batch = config.groups_in_flight * run.samples_per_prompt
    if gen.plugin:
        return plugin_generator(gen.backend)(GeneratorContext(
            model_config=data.model_config, model_path=run.model, dtype=run.torch_dtype, device=run.device, tp=tp,
            max_batch=max_batch, max_new_tokens=data.max_new_tokens, segment_tokens=gen.segment_tokens,
            temperature=gen.temperature, eos_token_ids=tuple(tokenizer.stop_token_ids),
            pad_token_id=tokenizer.pad_token_id, seed=seed, store=store, secret=secret, sync_name=sync_name,
            timeout_s=run.timeout_s))
    if gen.backend == "vllm":
        from ...integrations.vllm.generator import VllmGenerator

        pinned = run.mode == "async" and tp + config.trainer.world <= len(ALL_CORES)
        return VllmGenerator(data.model_config, tp=tp, store_port=store.port, secret=secret, sync_name=sync_name,
                             trainer_world=config.trainer.world, timeout_s=run.timeout_s,
                             max_new_tokens=data.max_new_tokens, temperature=gen.temperature,
                             eos_token_id=tokenizer.stop_token_ids, seed=seed, recompute_kv=gen.recompute_kv,
                             model_dir=Path(out_dir) / f"vllm-model-{incarnation}",
                             # vLLM's workers bind their threads: to the generator's cores, as ours are pinned.
                             cpus="|".join(str(c) for c in sorted(ALL_CORES)[:tp]) if pinned else None)
    process_group(store, f"{GENERATOR}/{incarnation}/{replica}", rank, tp, config, secret)
    return LlamaGeneratorBackend(
        data.model_config, tp=tp, rank=rank, store=store, secret=secret, sync_name=sync_name, timeout_s=run.timeout_s,
        replica=replica, num_replicas=gen.replicas,
        relay_names={child: sync_name_of(k, child) for child, k in (children or {}).items()},
        max_batch=max_batch, max_new_tokens=data.max_new_tokens, segment_tokens=gen.segment_tokens,
        temperature=gen.temperature, eos_token_id=tokenizer.stop_token_ids, pad_token_id=tokenizer.pad_token_id,
        seed=seed, dtype=run.torch_dtype, device=run.device, fp8=gen.fp8, fp8_gemm=gen.fp8_gemm)


def update_weights(generator, command: Receive, timeout_s: float, tp: int) -> tuple[int | None, str, bool]:
    """Take the version `command` announces; returns (version, "", False) or, when it
    did not land on every rank of the replica, (None, why, stale) on all of them
    (stale: no rank's weights were touched, the version asked for will not come): a
    replica whose ranks disagree would sample with torn weights or split its
    collectives."""
    try:
        outcome = (generator.update_weights(command.version, timeout_s, relay_to=command.relay_to), "", False)
    except SyncError as exc:
        outcome = (None, f"{type(exc).__name__}: {exc}", isinstance(exc, StaleReceiveError))
    if tp > 1:
        outcomes = [None] * tp
        dist.all_gather_object(outcomes, outcome)
        failed = [(rank, why) for rank, (_, why, _) in enumerate(outcomes) if why]
        if failed:
            stale = all(was_stale for _, why, was_stale in outcomes if why)
            if not stale:
                generator.version = None
            outcome = (None, "; ".join(f"rank {rank}: {why}" for rank, why in failed), stale)
    return outcome


class GeneratorRank:
    """Rank `tp_rank` of a generator replica, serving `generator` (make_generator's)
    with the controller's commands. The replica's rank 0, the leader, reads the
    commands and reports for it."""

    def __init__(self, link: Link, config: TrainConfig, generator, tp_rank: int):
        self.link, self.config, self.generator = link, config, generator
        self.tp = config.generator.processes
        self.leader = tp_rank == 0
        self.feed = CommandFeed(link, self.tp, self.leader, generator.weights_offered, config.sync.timeout_s / 2)
        self.busy = 0.0  # generating seconds not reported yet
        self.handlers = {Prompts: self.prompts, Relay: self.relay, Receive: self.receive}

    def run(self) -> None:
        generator = self.generator
        self.link.ready()
        while True:
            while self.feed.pending:
                if self._offer_matters():
                    verdict = self.feed.poll(decide=True)
                    if verdict == STOP:
                        return
                    if verdict == SAMPLE:
                        break  # the version is announced, not offered yet: sample on
                command = self.feed.pending.popleft()
                if isinstance(command, Stop):
                    return
                dispatch(self.handlers, command, GENERATOR)
            if generator.version is None or not generator.busy:
                self.feed.poll(block_s=INBOX_POLL_S)
                continue
            start = time.monotonic()
            done = generator.run_segment(stop=self.feed.weights_waiting)
            end = time.monotonic()
            self.busy += end - start
            self.link.span("generate", start, end, version=generator.version, **generator.segment_stats())
            if done and self.leader:
                self.link.send(Samples(samples=done, busy=self.busy))
                self.busy = 0.0

    def _offer_matters(self) -> bool:
        """Whether the Receive heading the commands waits for its offer (OfferWait):
        while this replica has samples to go on with (and weights to sample them
        with), or a Stop waits behind it. An idle replica waits in the receive."""
        pending = self.feed.pending
        return isinstance(pending[0], Receive) and (
            self.generator.version is not None and self.generator.busy
            or any(isinstance(command, Stop) for command in pending))

    def prompts(self, command: Prompts) -> None:
        self.generator.submit([Sample(group, ids) for group, ids in command.groups
                               for _ in range(self.config.run.samples_per_prompt)])

    def relay(self, command: Relay) -> None:
        """The child replica was restarted: feed its new incarnation."""
        self.generator.replace_relay(command.child, sync_name_of(command.incarnation, command.child))

    def receive(self, command: Receive) -> None:
        link, generator = self.link, self.generator
        start = time.monotonic()
        version, why, stale = update_weights(generator, command, self.config.sync.timeout_s, self.tp)
        if version is None:  # the replica feeding this one died: torn, or (stale) untouched
            link.span("receive weights failed", start, time.monotonic(), version=command.version)
            if self.leader:
                link.send(ReceiveFailed(version=command.version, attempt=command.attempt, message=why, stale=stale))
            return
        end = time.monotonic()
        link.span("receive weights", start, end, version=version)
        if self.leader:
            link.send(Received(version=version, busy=self.busy, seconds=end - start,
                               relay_failed=generator.relay_failures))
            self.busy = 0.0
        if command.evaluate:  # greedy, to the end, on these weights alone, before anything else
            start = time.monotonic()
            done = generator.evaluate([Sample(i, ids, eval=True) for i, ids in command.evaluate])
            link.span("evaluate", start, time.monotonic(), version=version, prompts=len(done))
            if self.leader:
                link.send(Samples(samples=done, busy=0.0))


def run_generator(link: Link, config: TrainConfig, store, rank: int, incarnation: int, out_dir: str,
                  children: dict[int, int]) -> None:
    """Run generator rank `rank` of all replicas' (rank `rank % tp` of replica
    `rank // tp`) until the controller says stop."""
    replica, tp_rank = divmod(rank, config.generator.processes)
    generator = make_generator(config, RunData(config), store, link.secret, tp_rank, incarnation, out_dir, replica,
                               children)
    try:
        GeneratorRank(link, config, generator, tp_rank).run()
    finally:
        generator.close()
