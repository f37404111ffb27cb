"""The generator behind one small interface, served by our LlamaGenerator (the
default) and by vLLM (`--generator vllm`, llamarl_core.integrations.vllm).

The generator executor only ever calls these: submit samples, run a segment
(generation with the current weights until a segment's budget, a finished
sample, or `stop()` between decode steps), update the weights (generation paused
meanwhile), and read the version and per-segment counts. Every token a
generator produces records the version of the weights that sampled it and its
behaviour log-prob (from the distribution it was sampled from: after
temperature).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..models.llama_generator import LlamaGenerator
from ..sync import RelayError, StaleReceiveError, SyncError, WeightReceiver, vllm_llama_tp
from .rollout import RolloutEngine, Sample


class Generator(ABC):
    """version: the weights' version (None until the first one lands); relay_failures:
    the replicas the last update did not reach, each with why (ours relays)."""

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

    @abstractmethod
    def evaluate(self, samples: list[Sample]) -> list[Sample]:
        """Complete `samples` greedily with the current weights, to their end (eos or
        budget), before anything else runs; returns them."""

    @abstractmethod
    def segment_stats(self) -> dict:
        """Counts since the last call, for the trace."""

    def close(self) -> None:
        pass


class LlamaGeneratorBackend(Generator):
    """Our LlamaGenerator (one instance per tensor-parallel rank) with partial
    rollouts (RolloutEngine), its parameters registered with a WeightReceiver."""

    def __init__(self, model_config, *, tp: int, rank: int, store: dist.Store, sync_name: str, timeout_s: float,
                 replica: int = 0, num_replicas: int = 1, relay_names: dict[int, str] | None = None, max_batch: int,
                 max_new_tokens: int, segment_tokens: int, temperature: float,
                 eos_token_id: int | Sequence[int], pad_token_id: int, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.model = LlamaGenerator(model_config, tp, rank, group=dist.group.WORLD if tp > 1 else None, dtype=dtype,
                                    device=device)
        # The trainer's float32 weights are cast to `dtype` on the way in.
        self.receiver = WeightReceiver(store, vllm_llama_tp(model_config, tp, dtype), rank,
                                       dict(self.model.named_parameters()), name=sync_name, timeout=timeout_s,
                                       num_threads=1, replica=replica, num_replicas=num_replicas,
                                       relay_names=relay_names)
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
