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
    """Samples packed several to a row (prompt + completion each, back to back),
    position ids restarting at 0 for each; Hugging Face models then attend within
    each sample only. The per-position tensors are aligned with the logits of
    input_ids[:, :-1] (position t predicts token t + 1)."""

    input_ids: torch.Tensor  # (rows, width)
    position_ids: torch.Tensor  # (rows, width)
    targets: torch.Tensor  # (rows, width - 1), IGNORE_INDEX off the completions
    behavior_logprobs: torch.Tensor  # (rows, width - 1)
    advantages: torch.Tensor  # (rows, width - 1), the sample's advantage on each of its tokens
    rewards: torch.Tensor  # (samples,)


@dataclass
class _Packed:
    """Where _pack put things: token arrays plus, for every completion token in
    sample order, the (row, column) of the logit that predicts it."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    targets: np.ndarray
    predicted_at: tuple[np.ndarray, np.ndarray]


def _pack(prompts: list[list[int]], completions: list[list[int]], pad_token_id: int) -> _Packed:
    """Sequences prompt + completion packed first-fit-decreasing into rows of at
    most twice the longest one. Right-padding every sequence to the longest wastes
    a fifth of the tokens on the default task (rows of 12-22 tokens); packed rows
    waste about 5%, which makes the trainer step about 12% faster (the attention
    over twice-as-long rows costs little at these lengths)."""
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token (bos): its last position predicts the first completion token")
    lengths = np.array([len(p) + len(c) for p, c in zip(prompts, completions)])
    capacity = 2 * int(lengths.max())
    fills: list[int] = []
    row_of, offset_of = np.zeros(len(lengths), np.int64), np.zeros(len(lengths), np.int64)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, fill in enumerate(fills) if fill + lengths[i] <= capacity), len(fills))
        if row == len(fills):
            fills.append(0)
        row_of[i], offset_of[i] = row, fills[row]
        fills[row] += int(lengths[i])
    width = max(fills)
    # Every token of every sequence, in sample order: its row, its position in its sequence, its column.
    token_row = np.repeat(row_of, lengths)
    token_position = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    token_column = np.repeat(offset_of, lengths) + token_position
    ids = np.full((len(fills), width), pad_token_id, dtype=np.int64)
    ids[token_row, token_column] = np.fromiter((t for p, c in zip(prompts, completions) for t in (*p, *c)), np.int64,
                                               int(lengths.sum()))
    # Trailing padding gets positions too (any: it comes after every real token of its row, so none attends to it).
    positions = np.broadcast_to(np.arange(width), ids.shape).copy()
    positions[token_row, token_column] = token_position
    on_completion = token_position >= np.repeat([len(p) for p in prompts], lengths)
    predicted_at = (token_row[on_completion], token_column[on_completion] - 1)
    targets = np.full((len(fills), width - 1), IGNORE_INDEX, dtype=np.int64)
    targets[predicted_at] = ids[token_row[on_completion], token_column[on_completion]]
    return _Packed(ids, positions, targets, predicted_at)


def _logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Logits of input_ids[:, :-1] on packed rows. use_cache=False: Hugging Face
    recognises packed sequences (position ids restarting) only without a cache,
    and a training forward needs none."""
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[:, :-1]


def check_packed_rows_attend_within_samples(model) -> None:
    """Raise unless `model`'s class, with its attention implementation, keeps the
    samples of a packed row apart. Packed rows rely on transformers detecting
    packing from position ids that restart (with use_cache=False): 4.53.1 and
    later do; 4.51 to 4.53.0 let the samples attend to each other (logits off by
    0.13 on a tiny Llama), which would train on wrong log-probs without a sign.
    Checked once at trainer start on a tiny model of the same class: two samples
    packed in one row against each run alone."""
    config = model.config.__class__(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    config._attn_implementation = model.config._attn_implementation
    prompts, completions = [[1, 5, 6], [1, 7]], [[8, 9, 10], [11, 12, 13, 14]]
    packed = _pack(prompts, completions, pad_token_id=0)
    with torch.random.fork_rng(), torch.no_grad():  # the caller's random stream stays as it was
        torch.manual_seed(0)
        tiny = model.__class__(config).eval()
        logits = _logits(tiny, torch.from_numpy(packed.input_ids), torch.from_numpy(packed.position_ids))
        alone = torch.cat([tiny(input_ids=torch.tensor([p + c]), use_cache=False).logits[0, len(p) - 1: -1]
                           for p, c in zip(prompts, completions)])
    error = (logits[packed.predicted_at] - alone).abs().max().item()
    if packed.input_ids.shape[0] != 1 or error > 1e-4:
        import transformers

        raise RuntimeError(
            f"transformers {transformers.__version__} ({config._attn_implementation} attention) lets packed samples "
            f"attend to each other (logits off by {error:.3g}); the trainer packs samples into rows: install "
            "transformers>=4.53.1")


def collate(samples: list[Sample], pad_token_id: int) -> Batch:
    """Samples with rewards -> a packed Batch; advantages are rewards centred over
    the samples of the same prompt (group), as AIPO does."""
    if not samples:
        raise ValueError("collate: no samples")
    missing = [s.group for s in samples if s.reward is None]
    if missing:
        raise ValueError(f"collate: samples of prompt groups {sorted(set(missing))} have no reward")
    packed = _pack([s.prompt for s in samples], [s.tokens for s in samples], pad_token_id)
    completion_lengths = [len(s.tokens) for s in samples]
    behavior = np.zeros(packed.targets.shape, dtype=np.float32)
    behavior[packed.predicted_at] = np.fromiter((lp for s in samples for lp in s.logprobs), np.float32,
                                                sum(completion_lengths))
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    advantages = np.zeros(packed.targets.shape, dtype=np.float32)
    advantages[packed.predicted_at] = np.repeat(group_advantages(rewards, groups).numpy(), completion_lengths)
    return Batch(torch.from_numpy(packed.input_ids), torch.from_numpy(packed.position_ids),
                 torch.from_numpy(packed.targets), torch.from_numpy(behavior), torch.from_numpy(advantages), rewards)


def policy_loss(model, batch: Batch, *, rho: float, temperature: float):
    """AIPO loss (token mean over completion tokens) of `model` on `batch`, from
    the fused log-prob kernel; returns (loss, AIPOStats)."""
    return aipo_loss(_logits(model, batch.input_ids, batch.position_ids), batch.targets, batch.behavior_logprobs,
                     batch.advantages, rho=rho, temperature=temperature)


def supervised_loss(model, prompts: list[list[int]], completions: list[list[int]], pad_token_id: int):
    """Mean cross-entropy of `completions` (eos included) after `prompts`."""
    packed = _pack(prompts, completions, pad_token_id)
    logits = _logits(model, torch.from_numpy(packed.input_ids), torch.from_numpy(packed.position_ids))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), torch.from_numpy(packed.targets).reshape(-1),
                           ignore_index=IGNORE_INDEX)


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
