"""The generator behind one small interface, served by our LlamaGenerator (the
default), by vLLM (`--generator vllm`, llamarl_core.integrations.vllm), and by
any Generator of yours (`--generator module:Class`, TrainConfig(generator=Class)).

The generator executor only ever calls these: submit samples, run a segment
(generation with the current weights until a segment's budget, a finished
sample, or `stop()` between decode steps), ask whether an announced version is
offered yet, update the weights (generation paused meanwhile), and read the
version and per-segment counts. Every token a
generator produces records the version of the weights that sampled it and its
behaviour log-prob (from the distribution it was sampled from: after
temperature).

A Generator of yours is built in the generator executor's process as
`Class(context)`, context a GeneratorContext (the model's config, the sampling
settings, and `context.weight_receiver(model)`, through which the trainer's
versions land in its model's parameters). The controller around it is the same
as around ours: the staleness bound on the versions its tokens carry, partial
rollouts (a sample unfinished when `stop()` says a version waits goes on under
the new weights: append to its tokens / logprobs / versions). It runs as one
replica of one executor process (an engine with tensor parallelism of its own
reads context.tp).
"""

from __future__ import annotations

import dataclasses
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..models.llama_generator import LlamaGenerator
from ..sync import RelayError, StaleReceiveError, SyncError, WeightReceiver, module_layout
from .plugins import load
from .rollout import RolloutEngine, Sample


class Generator(ABC):
    """version: the weights' version (None until the first one lands); relay_failures:
    the replicas the last update did not reach, each with why (ours relays).

    Contract of every method, for a Generator of yours too: submit() takes
    samples (prompt ids, no tokens yet) without generating; run_segment() samples
    at most a segment's worth of tokens for what was submitted, appending to each
    Sample's tokens, logprobs (log-prob of the token under the distribution it was
    sampled from, after temperature) and versions (self.version), setting
    `finished` when a stop token (context.eos_token_ids) ends it, and returns the
    samples done (finished, or at max_new_tokens tokens) once each; busy says
    whether any submitted sample is not returned yet; update_weights() lands a
    version (context.weight_receiver(...).receive(timeout=timeout_s,
    expect=version)) and sets self.version."""

    version: int | None = None
    relay_failures: dict[int, str] = {}  # never mutated: an update assigns a new dict

    @property
    @abstractmethod
    def busy(self) -> bool:
        """Samples submitted and not yet returned finished."""

    @abstractmethod
    def submit(self, samples: list[Sample]) -> None: ...

    @abstractmethod
    def run_segment(self, stop: Callable[[], bool]) -> list[Sample]:
        """Generate with the current weights; returns the samples that finished.
        `stop()` is asked between decode steps: True ends the segment (unfinished
        samples are kept for the next one)."""

    @abstractmethod
    def update_weights(self, version: int, timeout_s: float, relay_to: Sequence[int] | None = None) -> int:
        """Take `version` from the trainer (generation paused meanwhile); returns
        it once complete. Unfinished samples go on under the new weights, their KV
        cache recomputed (vLLM: unless told to keep it). relay_to: the replicas this
        one relays the version to (None: all it feeds). Raises SyncError when it did
        not land (version None: no weights to sample with until one does)."""

    def weights_offered(self, version: int) -> bool:
        """Asked between decode steps while `version` is announced and samples are
        in flight (or a stop waits behind it): True once the trainer offers it,
        when the executor pauses and calls update_weights(); until then generation
        goes on (the trainer's work before its offer, such as a delta's scans, runs
        beside it). A few Store requests at most; a failure the receiver would
        report (SyncError from `pending()`) returns True, not raised: the update
        reports it. The default, True: pause as soon as it is announced
        (a receiver's `pending()` tells the offer: ours asks it). The executor
        pauses anyway after half the sync's timeout without an offer, and stops
        without the version where the run stops before it is offered."""
        return True

    def evaluate(self, samples: list[Sample]) -> list[Sample]:
        """Complete `samples` greedily with the current weights, to their end (eos or
        budget), before anything else runs; returns them. Needed for eval_every
        (the controller refuses eval_every with a generator that lacks it)."""
        raise NotImplementedError(f"{type(self).__name__} does not evaluate (greedy completions)")

    def segment_stats(self) -> dict:
        """Counts since the last call (numbers by name), for the trace."""
        return {}

    def close(self) -> None:
        pass


def plugin_generator(spec: str) -> type[Generator]:
    """The Generator class `spec` ("module:Class") names; ValueError naming it
    unless it is a Generator subclass that implements every abstract method."""
    cls = load(spec, "generator", "class")
    if not issubclass(cls, Generator):
        raise ValueError(f"generator {spec!r}: {cls.__qualname__} is not a subclass of llamarl_core.pipeline.Generator")
    if inspect.isabstract(cls):
        raise ValueError(f"generator {spec!r}: {cls.__qualname__} does not implement "
                         f"{', '.join(sorted(cls.__abstractmethods__))}")
    return cls


def evaluates(generator_class: type) -> bool:
    """Whether `generator_class` implements Generator.evaluate."""
    return generator_class.evaluate is not Generator.evaluate


@dataclass
class GeneratorContext:
    """What a Generator of yours is built with (`Class(context)`), in the
    generator executor's process. Its model starts with any weights (the first
    sync brings the trainer's, before anything is sampled)."""

    model_config: Any  # the model's transformers config: the built-in toy Llama's, or --model's
    model_path: str | None  # --model (a folder or .gguf file); None for the built-in model
    dtype: Any  # torch.dtype of the generator's weights (the trainer's float32 weights are cast on the way)
    device: str  # "cpu" or "cuda"
    tp: int  # generator_tp: tensor parallelism, for an engine that runs its own workers
    max_batch: int  # samples submitted and not yet returned, at most
    max_new_tokens: int  # a completion's budget: a sample with this many tokens is done, finished False
    segment_tokens: int  # decode steps per run_segment at most (partial rollouts)
    temperature: float
    eos_token_ids: tuple[int, ...]  # tokens that end a completion (finished True; the token is kept)
    pad_token_id: int
    seed: int
    store: Any  # the run's torch.distributed Store (the weight sync's handshake)
    # The run's secret (auth.py): the sync's values in the Store are authenticated with it; pass it to
    # anything of yours that reads the run's Store (kept out of the context's repr: logs stay secret-free).
    secret: bytes = dataclasses.field(repr=False)
    sync_name: str  # the sync's name in it
    timeout_s: float  # how long the sync's set-up may wait for the trainer

    def weight_receiver(self, model: torch.nn.Module) -> WeightReceiver:
        """A WeightReceiver over `model`'s parameters, in place (module_layout:
        checkpoint names read off the live model, e.g. a transformers model of the
        trainer's class); the trainer's versions land there through
        `.receive(timeout=timeout_s, expect=version)`. Register before anything
        caches the parameters' data pointers (CPU tensors move into shared memory)."""
        # The parameters themselves: shared memory is swapped in under their `.data`.
        return WeightReceiver(self.store, module_layout(model, 1), 0, dict(model.named_parameters()),
                              name=self.sync_name, timeout=self.timeout_s, secret=self.secret)


class LlamaGeneratorBackend(Generator):
    """Our LlamaGenerator (one instance per tensor-parallel rank) with partial
    rollouts (RolloutEngine), its parameters registered with a WeightReceiver."""

    def __init__(self, model_config, *, tp: int, rank: int, store: dist.Store, secret: bytes, sync_name: str,
                 timeout_s: float,
                 replica: int = 0, num_replicas: int = 1, relay_names: dict[int, str] | None = None, max_batch: int,
                 max_new_tokens: int, segment_tokens: int, temperature: float,
                 eos_token_id: int | Sequence[int], pad_token_id: int, seed: int, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", fp8: str | None = None, fp8_gemm: str = "auto"):
        self.model = LlamaGenerator(model_config, tp, rank, group=dist.group.WORLD if tp > 1 else None, dtype=dtype,
                                    device=device, fp8=fp8, fp8_gemm=fp8_gemm)
        # The trainer's float32 weights are cast to `dtype` on the way in (quantized to FP8 by the senders, with fp8).
        self.receiver = WeightReceiver(store, self.model.layout, rank,
                                       dict(self.model.named_parameters()), name=sync_name, timeout=timeout_s,
                                       num_threads=1, replica=replica, num_replicas=num_replicas,
                                       relay_names=relay_names, secret=secret)
        self._engine_args = dict(max_batch=max_batch, max_new_tokens=max_new_tokens, temperature=temperature,
                                 eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        self.engine = RolloutEngine(self.model, segment_tokens=segment_tokens, seed=seed, **self._engine_args)
        self._reported = dataclasses.replace(self.engine.stats)

    @property
    def busy(self) -> bool:
        return self.engine.busy

    def submit(self, samples: list[Sample]) -> None:
        self.engine.submit(samples)

    def run_segment(self, stop: Callable[[], bool]) -> list[Sample]:
        return self.engine.run_segment(self.version, stop=stop)

    def weights_offered(self, version: int) -> bool:
        try:
            offered = self.receiver.pending()
        except SyncError:
            return True  # a sender's failure: receive() raises it
        return offered is not None and offered >= version

    def update_weights(self, version: int, timeout_s: float, relay_to: Sequence[int] | None = None) -> int:
        self.relay_failures = {}
        try:
            landed = self.receiver.receive(timeout=timeout_s, relay_to=relay_to, expect=version)
        except RelayError as exc:  # landed here; a replica this one feeds missed it (the controller sees to it)
            landed, self.relay_failures = exc.version, exc.failed
        except StaleReceiveError:
            raise  # nothing was written: the weights and their version stay
        except SyncError:
            self.version = None  # torn: nothing is sampled until a version lands
            raise
        if landed != version:
            self.version = None  # the tensors hold `landed`: no sample may carry another version
            raise SyncError(f"the trainer sent version {landed}, the controller announced {version}")
        self.engine.invalidate()  # unfinished sequences are re-prefilled under the new weights (always)
        self.version = landed
        return landed

    def replace_relay(self, child: int, name: str) -> None:
        """Relay to replica `child`, restarted, through its new sync `name` (set up meanwhile)."""
        self.receiver.replace_relay(child, name)

    def evaluate(self, samples: list[Sample]) -> list[Sample]:
        # An engine of its own: the training batch's KV cache stays as it is.
        engine = RolloutEngine(self.model, segment_tokens=self._engine_args["max_new_tokens"], seed=0, greedy=True,
                               **self._engine_args)
        engine.submit(samples)
        done: list[Sample] = []
        while engine.busy:
            done += engine.run_segment(self.version)
        return done

    def segment_stats(self) -> dict:
        stats = self.engine.stats.since(self._reported)
        self._reported = dataclasses.replace(self.engine.stats)
        return stats
