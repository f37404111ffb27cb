"""Partial rollouts with continuous batching over a LlamaGenerator.

Generation runs in segments of at most `segment_tokens` decode steps. Between
two decode steps (never inside one) the caller may stop the segment, e.g. to
take new weights; sequences unfinished at that point keep their prompt and
generated prefix and are re-prefilled under the new weights at the start of the
next segment, instead of being aborted. Every token records the policy version
and the behaviour log-prob (from the distribution it was sampled from) it was
sampled with. Between segments, free batch slots take waiting prompts (the
batch is re-prefilled then, left-padded, so sequences of any length share it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..control import wire
from ..models.llama_generator import KVCache, LlamaGenerator, sample_tokens


@wire.register  # travels in the executors' messages
@dataclass
class Sample:
    """One completion of one prompt. group: the prompt's index in the task (its
    data position; for an evaluation sample, its index in the held-out split); the
    samples of a group share a prompt. tokens, logprobs, versions: per completion
    token. finished: ended by a stop token (else truncated by the token budget). eval: a
    greedy completion of a held-out prompt, scored but never trained on."""

    group: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False
    reward: float | None = None
    eval: bool = False

    @property
    def oldest_version(self) -> int:
        return min(self.versions)

    def contract_problem(self, newest: int, vocab: int, budget: int) -> str | None:
        """What in this sample breaks the Generator contract (generators.py), None if
        nothing: no tokens, a token without its log-prob or the version that sampled
        it, a version past `newest` (the last one sent), a token id outside the
        vocabulary, or a length other than a finished one within `budget` tokens or
        exactly `budget`."""
        if not (len(self.tokens) == len(self.logprobs) == len(self.versions) > 0) or not all(
                isinstance(v, int) and 0 <= v <= newest for v in self.versions):
            return (f"{len(self.tokens)} tokens, {len(self.logprobs)} log-probs and versions "
                    f"{sorted(set(self.versions))}: every sample needs tokens, each with its log-prob and the "
                    f"version (0 to {newest}) that sampled it")
        if not 0 <= min(self.tokens) <= max(self.tokens) < vocab:
            return f"token ids from {min(self.tokens)} to {max(self.tokens)}, outside the vocabulary [0, {vocab})"
        if len(self.tokens) > budget or (len(self.tokens) < budget and not self.finished):
            return (f"{len(self.tokens)} tokens, finished {self.finished}: a sample is returned finished (a stop "
                    f"token) or at max_new_tokens {budget}, never past it")
        return None


@dataclass
class EngineStats:
    """Running counts; the generator puts each segment's share in its trace span
    (prefill_tokens shows what re-prefilling after a weight update costs)."""

    prefills: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    tokens: int = 0

    def since(self, earlier: EngineStats) -> dict[str, int]:
        return {name: getattr(self, name) - getattr(earlier, name) for name in self.__dataclass_fields__}


def stop_token_set(eos_token_id: int | Sequence[int]) -> frozenset[int]:
    """The ids that end a completion: one eos id, or several (a chat model's
    end-of-turn token besides its tokenizer's eos, a generation config's list)."""
    ids = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
    if not ids:
        raise ValueError("eos_token_id: expected an id or a non-empty sequence of ids, got an empty one")
    return ids


class RolloutEngine:
    """See the module docstring. Every rank of a tensor-parallel generator runs one
    with the same seed and the same calls, so they sample the same tokens.
    eos_token_id: the id, or ids, that end a completion."""

    def __init__(self, model: LlamaGenerator, *, max_batch: int, max_new_tokens: int, segment_tokens: int,
                 temperature: float, eos_token_id: int | Sequence[int], pad_token_id: int, seed: int,
                 greedy: bool = False):
        for name, value in (("max_batch", max_batch), ("max_new_tokens", max_new_tokens),
                            ("segment_tokens", segment_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.model = model
        self.max_batch, self.max_new_tokens, self.segment_tokens = max_batch, max_new_tokens, segment_tokens
        self.temperature, self.pad, self.greedy = temperature, pad_token_id, greedy
        self.stop_ids = stop_token_set(eos_token_id)
        # Token ids, masks and the sampling generator live where the model's weights do.
        self.device = model.model.embed_tokens.weight.device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.waiting: deque[Sample] = deque()
        self.active: list[Sample] = []
        self.stats = EngineStats()
        self._cache: KVCache | None = None
        self._mask: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None

    @property
    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    def submit(self, samples: list[Sample]) -> None:
        self.waiting.extend(samples)

    def invalidate(self) -> None:
        """The weights changed: the KV cache is stale; re-prefill before the next token."""
        self._cache = self._mask = self._logits = None

    @torch.no_grad()
    def _prefill(self) -> None:
        """Admit waiting samples into free slots and run the batch's prompt + generated
        prefix through the model, left-padded. Identical rows (the samples of a prompt
        before their first token) run once and are then repeated: a prompt group of 4
        costs one row (3.3 of 5.1 ms saved per fresh batch of 12 x 4 on the default task)."""
        while self.waiting and len(self.active) < self.max_batch:
            self.active.append(self.waiting.popleft())
        first_of: dict[tuple[int, ...], int] = {}
        row_of = [first_of.setdefault(tuple(s.prompt + s.tokens), len(first_of)) for s in self.active]
        rows = list(first_of)
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        self._cache = self.model.new_cache()
        logits = self.model(ids, self._cache, mask)[:, -1]
        self.stats.prefills += 1
        self.stats.prefill_tokens += int(mask.sum())
        if len(rows) < len(self.active):
            expand = torch.tensor(row_of, device=self.device)
            self._cache.select(expand)
            logits, mask = logits[expand], mask[expand]
        self._logits, self._mask = logits, mask

    @torch.no_grad()
    def run_segment(self, version: int, stop: Callable[[], bool] = lambda: False) -> list[Sample]:
        """Up to `segment_tokens` decode steps with weights `version`; returns the
        samples that finished (a stop token or the budget). `stop()` is asked between decode
        steps; True ends the segment there (the in-flight samples are kept and
        re-prefilled by the next segment)."""
        finished: list[Sample] = []
        if self.waiting and len(self.active) < self.max_batch:
            self.invalidate()  # admit new prompts: the batch is rebuilt
        if not self.busy:
            return finished
        if self._cache is None:
            self._prefill()
        for _ in range(self.segment_tokens):
            token, logprob = sample_tokens(self._logits, self.temperature, self.generator, self.greedy)
            self.stats.decode_steps += 1
            self.stats.tokens += len(self.active)
            keep = []
            for i, (sample, t, lp) in enumerate(zip(self.active, token.tolist(), logprob.tolist())):
                sample.tokens.append(t)
                sample.logprobs.append(lp)
                sample.versions.append(version)
                if t in self.stop_ids or len(sample.tokens) >= self.max_new_tokens:
                    sample.finished = t in self.stop_ids
                    finished.append(sample)
                else:
                    keep.append(i)
            if len(keep) < len(self.active):
                self.active = [self.active[i] for i in keep]
                if not keep:
                    self.invalidate()
                    break
                rows = torch.tensor(keep, device=self.device)
                self._cache.select(rows)
                self._mask, token = self._mask[rows], token[rows]
            if stop():
                self.invalidate()
                break
            self._mask = torch.cat([self._mask, torch.ones(len(keep), 1, dtype=torch.bool, device=self.device)], dim=1)
            self._logits = self.model(token[:, None], self._cache, self._mask)[:, -1]
        return finished

