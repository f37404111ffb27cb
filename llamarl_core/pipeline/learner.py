"""The trainer's math on a batch of samples: collation, the AIPO policy loss on a
Hugging Face causal LM, and the supervised warm-up loss. No processes here."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..ops.aipo import IGNORE_INDEX, aipo_loss, group_advantages
from .rollout import Sample


@dataclass
class Batch:
    """Right-padded prompt + completion rows; the per-position tensors are aligned
    with the logits of input_ids[:, :-1] (position t predicts token t + 1)."""

    input_ids: torch.Tensor  # (batch, length)
    attention_mask: torch.Tensor  # (batch, length)
    targets: torch.Tensor  # (batch, length - 1), IGNORE_INDEX off the completion
    behavior_logprobs: torch.Tensor  # (batch, length - 1)
    advantages: torch.Tensor  # (batch, length - 1), the sample's advantage on each of its tokens
    rewards: torch.Tensor  # (batch,)


def _right_padded(prompts: list[list[int]], completions: list[list[int]], pad_token_id: int):
    """Rows prompt + completion, right-padded, as numpy arrays: (input_ids, filled,
    targets, on_completion). targets and on_completion are aligned with the logits
    of input_ids[:, :-1] (position t predicts token t + 1): the completion's tokens
    sit at [prompt - 1, prompt - 1 + completion), IGNORE_INDEX elsewhere."""
    prompt_lens = np.array([len(p) for p in prompts])
    lengths = prompt_lens + np.array([len(c) for c in completions])
    batch, length = len(prompts), int(lengths.max())
    # One flat copy of every row instead of a tensor per row (1.5 -> 0.3 ms at 48 samples).
    positions = np.arange(length)[None, :]
    filled = positions < lengths[:, None]
    ids = np.full((batch, length), pad_token_id, dtype=np.int64)
    ids[filled] = np.fromiter((t for p, c in zip(prompts, completions) for t in (*p, *c)), np.int64, int(lengths.sum()))
    on_completion = (positions[:, :-1] >= prompt_lens[:, None] - 1) & (positions[:, :-1] < lengths[:, None] - 1)
    targets = np.full((batch, length - 1), IGNORE_INDEX, dtype=np.int64)
    targets[on_completion] = ids[:, 1:][on_completion]
    return ids, filled, targets, on_completion


def collate(samples: list[Sample], pad_token_id: int) -> Batch:
    """Samples with rewards -> a Batch; advantages are rewards centred over the
    samples of the same prompt (group), as AIPO does."""
    if not samples:
        raise ValueError("collate: no samples")
    missing = [s.group for s in samples if s.reward is None]
    if missing:
        raise ValueError(f"collate: samples of prompt groups {sorted(set(missing))} have no reward")
    ids, filled, targets, on_completion = _right_padded([s.prompt for s in samples], [s.tokens for s in samples],
                                                        pad_token_id)
    behavior = np.zeros(targets.shape, dtype=np.float32)
    behavior[on_completion] = np.fromiter((lp for s in samples for lp in s.logprobs), np.float32,
                                          int(on_completion.sum()))
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    advantages = group_advantages(rewards, groups)[:, None].expand(targets.shape).contiguous()
    return Batch(torch.from_numpy(ids), torch.from_numpy(filled.astype(np.int64)), torch.from_numpy(targets),
                 torch.from_numpy(behavior), advantages, rewards)


def policy_loss(model, batch: Batch, *, rho: float, temperature: float):
    """AIPO loss (token mean over completion tokens) of `model` on `batch`, from
    the fused log-prob kernel; returns (loss, AIPOStats)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    return aipo_loss(logits, batch.targets, batch.behavior_logprobs, batch.advantages, rho=rho,
                     temperature=temperature)


def supervised_loss(model, prompts: list[list[int]], completions: list[list[int]], pad_token_id: int):
    """Mean cross-entropy of `completions` (eos included) after `prompts`."""
    ids, filled, targets, _ = _right_padded(prompts, completions, pad_token_id)
    input_ids, attention_mask, targets = (torch.from_numpy(a) for a in (ids, filled.astype(np.int64), targets))
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX)


# Warm-up prompts come from far beyond the RL prompts' indices, so RL never sees them.
WARMUP_PROMPT_OFFSET = 10**9


def supervised_warmup(model, optimizer, task, steps: int, batch: int, rank: int = 0, world: int = 1) -> float:
    """`steps` supervised steps on the task's reference answers (this data-parallel
    rank's share of `batch` prompts each); returns the last loss."""
    tokenizer = task.tokenizer()
    per_rank = max(batch // world, 1)
    loss = torch.zeros(())
    for i in range(steps):
        prompts = [task.prompt(WARMUP_PROMPT_OFFSET + (i * world + rank) * per_rank + j) for j in range(per_rank)]
        completions = [tokenizer.encode(task.reference(p))[1:] + [tokenizer.eos_token_id] for p in prompts]
        loss = supervised_loss(model, [tokenizer.encode(p) for p in prompts], completions, tokenizer.pad_token_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return loss.item()
