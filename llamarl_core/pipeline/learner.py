"""The trainer's math on a batch of samples: collation, the policy loss on a
Hugging Face causal LM (the fused loss op's objectives by name: AIPO, PPO and
the off-policy corrections of ops/objectives.py; or a loss function of yours on
per-token log-probs), one optimizer step (advantages from an estimator,
micro-batches, KL penalty against a reference model, entropy bonus, gradient
clipping, autocast), the learning-rate schedule, and the supervised warm-up
loss. No processes here.

A loss function of yours (TrainConfig.loss = "module:function", or
train_step(loss=fn)): `fn(logprobs, batch) -> per-token losses`. logprobs:
(rows, width - 1) float32, differentiable, log pi(y_t) at the run's temperature
of each completion token of `batch` (a Batch: packed rows; 0 off the
completions, where batch.mask is 0); the result: a tensor of the same shape
whose gradient reaches logprobs. The trainer keeps the masked entries, adds the
KL penalty and the entropy bonus if asked, and reduces them as the built-in
losses (train_step's reduction: a token mean over the whole step by default, or
a mean over its completions of each one's token mean) so that micro-batches and
data-parallel ranks add up to one batch. It reads none of the built-in losses'
parameters (rho, eps_low, ...: refused with it), and the step's statistics of
what the loss itself does (truncated, masked, clipped fractions) are None: the
trainer cannot see them; the mismatch statistics (mismatch_kl, ess_fraction,
...) are the fused op's on the same log-probs, as for the built-in losses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ..ops.aipo import IGNORE_INDEX, aipo_loss
from ..ops.aipo_inputs import prepare_inputs
from ..ops.logprob import token_logprobs
from ..ops.objectives import (LOSS_TYPES, AIPOStats, Objective, ObjectiveTerms,
                               objective_stats, reference_kl)
from .advantages import AdvantageFn, advantage_function, compute_advantages, group_mean
from .config import LR_SCHEDULES, check_loss, natural_reduction
from .plugins import builtin_or_load, check_arity, load, name_of
from .rollout import Sample

LossFn = Callable[[torch.Tensor, "Batch"], torch.Tensor]


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
    # (rows, width - 1) int64: on each completion token the index of its sample in the batch (per-sequence losses,
    # aipo_loss's packed sequence_ids), -1 elsewhere
    sequence_ids: torch.Tensor
    rewards: torch.Tensor  # (samples,)
    truncated: int  # samples that hit the token budget (finished False), whether masked or not

    @property
    def mask(self) -> torch.Tensor:
        """(rows, width - 1) float32: 1 on the completion tokens that count in the loss."""
        return (self.targets != IGNORE_INDEX).to(torch.float32)

    def to(self, device) -> Batch:
        """The batch with its tensors on `device` (the model's)."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device)
                                            for f in dataclasses.fields(self) if f.name != "truncated"})


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
            "transformers>=4.56 (llamarl-core's floor)")


def _sample_advantages(samples: list[Sample], advantage: AdvantageFn = group_mean) -> torch.Tensor:
    """(samples,) float32: advantage(rewards, group ids) over `samples` (default:
    each reward centred over the samples of the same prompt, as AIPO does)."""
    if not samples:
        raise ValueError("collate: no samples")
    missing = [s.group for s in samples if s.reward is None]
    if missing:
        raise ValueError(f"collate: samples of prompt groups {sorted(set(missing))} have no reward")
    return compute_advantages(advantage, torch.tensor([s.reward for s in samples], dtype=torch.float32),
                              torch.tensor([s.group for s in samples], dtype=torch.long),
                              name_of(advantage))


def _collate(samples: list[Sample], advantages: torch.Tensor, pad_token_id: int, mask_truncated: bool) -> Batch:
    """collate with the per-sample advantages given: a micro-batch's samples take
    advantages computed over the whole batch's groups."""
    packed = _pack([s.prompt for s in samples], [s.tokens for s in samples], pad_token_id)
    completion_lengths = [len(s.tokens) for s in samples]
    behavior = np.zeros(packed.targets.shape, dtype=np.float32)
    behavior[packed.predicted_at] = np.fromiter((lp for s in samples for lp in s.logprobs), np.float32,
                                                sum(completion_lengths))
    per_token_advantages = np.zeros(packed.targets.shape, dtype=np.float32)
    per_token_advantages[packed.predicted_at] = np.repeat(advantages.numpy(), completion_lengths)
    truncated = np.array([not s.finished for s in samples])
    if mask_truncated:
        dropped = np.repeat(truncated, completion_lengths)
        packed.targets[packed.predicted_at[0][dropped], packed.predicted_at[1][dropped]] = IGNORE_INDEX
    sequence_ids = np.full(packed.targets.shape, -1, dtype=np.int64)
    sequence_ids[packed.predicted_at] = np.repeat(np.arange(len(samples)), completion_lengths)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    return Batch(torch.from_numpy(packed.input_ids), torch.from_numpy(packed.position_ids),
                 torch.from_numpy(packed.targets), torch.from_numpy(behavior), torch.from_numpy(per_token_advantages),
                 torch.from_numpy(sequence_ids), rewards, int(truncated.sum()))


def collate(samples: list[Sample], pad_token_id: int, mask_truncated: bool = False) -> Batch:
    """Samples with rewards -> a packed Batch; advantages are rewards centred over
    the samples of the same prompt (group), as AIPO does. mask_truncated: the
    completions of samples that hit the token budget (finished False) leave the
    loss (targets IGNORE_INDEX; DAPO's overlong filtering: a cut-off answer's
    reward says where it was cut more than how good it was), while their rewards
    still count in their groups' means."""
    return _collate(samples, _sample_advantages(samples), pad_token_id, mask_truncated)


def _autocast(model, dtype: torch.dtype | None):
    """torch.autocast to `dtype` on the model's device type; nothing for None or
    float32 (the parameters stay float32 masters either way)."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=dtype)


def policy_loss(model, batch: Batch, *, temperature: float, reduction: str = "token_mean",
                ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0,
                autocast_dtype: torch.dtype | None = None, loss: str = "aipo",
                old_logprobs: torch.Tensor | None = None, entropy_coef: float = 0.0, normalizer=None,
                nonfinite_logprobs: str = "raise", **parameters):
    """The policy loss `loss` (a name of ops.objectives.LOSS_TYPES; those of
    OLD_POLICY_TYPES read old_logprobs (rows, width - 1), None: on-policy) of `model` on `batch`
    (by default the token mean over the completion tokens that count), with the
    KL penalty against ref_logprobs (rows, width - 1) when given and the entropy
    bonus; parameters: the loss's (ops.objectives.PARAMETERS;
    None or left out: its default; one it does not read raises ValueError). Each
    completion is one sequence (batch.sequence_ids: the sequence-level losses
    need them; every loss gets the sequence statistics). reduction and
    normalizer, nonfinite_logprobs: aipo_loss's. The forward runs under autocast_dtype, the loss in
    float32. Returns (loss, AIPOStats), the entropy among them."""
    with _autocast(model, autocast_dtype):
        logits = _logits(model, batch.input_ids, batch.position_ids)
    return aipo_loss(logits, batch.targets, batch.behavior_logprobs, batch.advantages, temperature=temperature,
                     reduction=reduction, sequence_ids=batch.sequence_ids, loss_type=loss, old_logprobs=old_logprobs,
                     entropy=True, ref_logprobs=ref_logprobs, kl_coef=kl_coef, entropy_coef=entropy_coef,
                     normalizer=normalizer, nonfinite_logprobs=nonfinite_logprobs, **parameters)


def _user_loss(model, batch: Batch, loss_fn: LossFn, *, temperature: float, ref_logprobs: torch.Tensor | None,
               kl_coef: float, entropy_coef: float, autocast_dtype: torch.dtype | None, reduction: str = "token_mean"):
    """(summed loss, AIPOStats) of a loss function of yours (the module docstring
    says its contract) on `batch`, with the KL penalty and the entropy bonus,
    summed over the tokens ("token_mean") or over the completions of each one's
    token mean ("sequence_mean");
    ValueError naming it when it breaks the contract. The stats are the fused
    op's on the same log-probs (truncated_fraction 0 and no sequence statistics:
    train_step reports those as None for a loss of yours)."""
    with _autocast(model, autocast_dtype):
        logits = _logits(model, batch.input_ids, batch.position_ids)
    logp, entropy = token_logprobs(logits, batch.targets, temperature=temperature, entropy=True)
    per_token = loss_fn(logp, batch)
    name = name_of(loss_fn)
    if not isinstance(per_token, torch.Tensor) or per_token.shape != logp.shape:
        got = tuple(per_token.shape) if isinstance(per_token, torch.Tensor) else type(per_token).__name__
        raise ValueError(f"loss {name} returned {got}; per-token losses of the log-probs' shape {tuple(logp.shape)} "
                         "expected")
    if not per_token.requires_grad:
        raise ValueError(f"loss {name} returned losses with no gradient: they must be computed from the log-probs")
    if ref_logprobs is not None:
        per_token = per_token + kl_coef * reference_kl(logp, ref_logprobs)[0]
    if entropy_coef > 0:
        per_token = per_token - entropy_coef * entropy
    mask = batch.mask
    if reduction == "sequence_mean":  # each token over its completion's counted tokens (sequence_ids: -1 off them)
        slot = batch.sequence_ids.clamp(min=-1).reshape(-1) + 1
        tokens = torch.zeros(slot.numel() + 1, device=mask.device).index_add_(0, slot, mask.reshape(-1))
        mask = torch.where(mask > 0, mask / tokens[slot].reshape(mask.shape).clamp(min=1.0), 0.0)
    summed = torch.where(mask > 0, per_token.float() * mask, 0.0).sum()
    # The fused op's stats, on the same log-probs.
    cfg = Objective(temperature=temperature, kl_coef=kl_coef)
    inputs = prepare_inputs(batch.targets.shape, logp.device, batch.targets, batch.behavior_logprobs,
                            batch.advantages, None, None, ref_logprobs, None, cfg, "sum")
    inputs.check.wait()
    return summed, objective_stats(logp.reshape(-1), entropy.reshape(-1), inputs.behavior, inputs.mask, inputs.ref,
                                   None, ObjectiveTerms(per_token, None, None, None), inputs.shape)


@torch.no_grad()
def _reference_logprobs(reference_model, batch: Batch, temperature: float,
                        autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """(rows, width - 1) float32: log-probs of batch.targets under reference_model
    at the learner's temperature (0 off the targets), on the same packed rows."""
    with _autocast(reference_model, autocast_dtype):
        logits = _logits(reference_model, batch.input_ids, batch.position_ids)
    return token_logprobs(logits, batch.targets, temperature=temperature)[0]


@dataclass
class StepStats:
    """One optimizer step. The per-token figures are means over the completion
    tokens that counted in the whole batch (token-weighted across micro-batches:
    each micro-batch's mean times its tokens, over the batch's tokens), which
    makes them the whole batch's means; the per-sequence ones likewise over its
    sequences (completions with a token that counted); max_abs_log_ratio is the
    maximum over the micro-batches. r = exp(logp - b): the learner's probability
    of a token over the generator's (behaviour policy's) that sampled it.
    None: not defined for this step's loss (the clip fraction of a loss without a
    clip, the masked fraction of one without a mask; what a loss of yours
    truncates, masks or clips) or without the KL penalty (ref_kl)."""

    # the loss (policy term, plus KL penalty, minus entropy bonus) reduced as the step's reduction says; with
    # several data-parallel ranks, this rank's part times their number (its sum over the global count over the
    # ranks): the mean over the ranks, the controller's figure, is the step's loss
    loss: float
    grad_norm: float  # total gradient norm before clipping
    mismatch_kl: float  # k3 estimate of KL(behaviour || learner): mean(r - 1 - log r)
    # fraction of tokens whose importance weight was truncated at rho (aipo: r > rho; ppo_tis: exp(old - b) > rho;
    # seq_tis: their sequence's ratio; geo_mask: r > rho); 0 for the losses without a truncation, None for yours
    truncated_fraction: float | None
    mean_ratio: float  # mean r
    ref_kl: float | None  # k3 estimate of KL(learner || reference); None without the penalty
    truncated_samples: int  # samples that hit the token budget, masked or not
    lr: float
    # Completion tokens in the loss, over every trainer rank; 0 (every sample masked as truncated): no optimizer step.
    counted_tokens: int = 0
    # Tokens where the clip acted (ppo, ppo_tis, gspo: the clipped term strictly the smaller; cispo: the weight
    # clipped); None for the losses without a clip and for yours
    clip_fraction: float | None = None
    entropy: float | None = None  # mean entropy of the learner's distribution (at the temperature), in nats
    mismatch_k1: float | None = None  # k1 estimate of KL(behaviour || learner): mean(-log r)
    chi_squared: float | None = None  # chi-squared divergence estimate: mean(r^2) - 1
    # Effective sample size of the weights r as a fraction of the tokens: mean(r)^2 / mean(r^2) over the whole batch
    ess_fraction: float | None = None
    mean_abs_log_ratio: float | None = None  # mean |log r|
    max_abs_log_ratio: float | None = None  # max |log r| over the counted tokens
    masked_fraction: float | None = None  # tokens whose IS weight was masked to 0 (icepop, seq_mis, geo_mask)
    # Completions with a token truncated / masked (a sequence-level decision is all its tokens')
    sequence_truncated_fraction: float | None = None
    sequence_masked_fraction: float | None = None


# AIPOStats' figures that StepStats weighs by tokens, by sequences, and takes the maximum of (over the micro-batches,
# and the controller over the trainer ranks, whose other figures it averages).
_TOKEN_STATS = ("mismatch_kl", "truncated_fraction", "mean_ratio", "ref_kl", "clip_fraction", "entropy", "mismatch_k1",
                "chi_squared", "mean_abs_log_ratio", "masked_fraction")
_SEQUENCE_STATS = ("sequence_truncated_fraction", "sequence_masked_fraction")
MAX_STATS = ("max_abs_log_ratio",)
# What a loss of yours does itself, unknown to the trainer.
_LOSS_OWN_STATS = ("truncated_fraction", "clip_fraction", "masked_fraction", *_SEQUENCE_STATS)


class _StatSums:
    """AIPOStats of the micro-batches, combined as StepStats says: token- or
    sequence-weighted sums, maxima; None for a figure a micro-batch left None."""

    def __init__(self):
        self.values: dict[str, float | None] = {}

    def add(self, stats: AIPOStats, tokens: int, sequences: int) -> None:
        names = (*_TOKEN_STATS, *_SEQUENCE_STATS, *MAX_STATS)
        given = [name for name in names if getattr(stats, name) is not None]
        numbers = dict(zip(given, torch.stack([getattr(stats, name).float().reshape(())
                                               for name in given]).tolist()))  # one host sync
        for name in names:
            value, so_far = numbers.get(name), self.values.get(name, 0.0)
            if value is None or so_far is None:
                self.values[name] = None
            elif name in MAX_STATS:
                self.values[name] = max(so_far, value)
            else:
                self.values[name] = so_far + value * (sequences if name in _SEQUENCE_STATS else tokens)

    def means(self, tokens: int, sequences: int) -> dict[str, float | None]:
        out = {}
        for name, value in self.values.items():
            if value is not None and name not in MAX_STATS:
                value /= max(sequences if name in _SEQUENCE_STATS else tokens, 1)
            out[name] = value
        # mean(r)^2 / mean(r^2) over the whole batch: from the token-weighted means, not a mean of the
        # micro-batches' fractions; 1 without a token (as AIPOStats)
        second_moment = out["chi_squared"] + 1
        out["ess_fraction"] = out["mean_ratio"] ** 2 / second_moment if second_moment > 0 else 1.0
        return out


def train_step(model, optimizer, samples: list[Sample], *, pad_token_id: int, temperature: float, lr: float,
               micro_batch_size: int | None = None, max_grad_norm: float | None = None, mask_truncated: bool = False,
               kl_coef: float = 0.0, reference_model=None, autocast_dtype: torch.dtype | None = None,
               loss: str | LossFn = "aipo", advantage: AdvantageFn = group_mean, normalizer: float | None = None,
               rho: float | None = None, eps_low: float | None = None, eps_high: float | None = None,
               mask_low: float | None = None, mask_high: float | None = None, tau_pos: float | None = None,
               tau_neg: float | None = None, k_pos: float | None = None, lambda_pos: float | None = None,
               k_neg: float | None = None, lambda_neg: float | None = None, entropy_coef: float = 0.0,
               reduction: str | None = None, nonfinite_logprobs: str = "raise") -> StepStats:
    """One optimizer step of the policy loss on `samples` (scored), at learning rate `lr`.

    loss: a name of ops.objectives.LOSS_TYPES (default "aipo"; formulas in
    ops/objectives.py) or a loss function (the module docstring). The losses of
    OLD_POLICY_TYPES (ppo, ppo_tis, gspo, cispo, sapo) take the model's own
    log-probs, detached, as the old policy's (old_logprobs None), so their ratio
    is 1: one optimizer step per batch. rho, eps_low, eps_high, mask_low,
    mask_high, tau_pos, tau_neg, k_pos, lambda_pos, k_neg, lambda_neg: the loss's
    parameters, None for its default
    (ops.objectives.DEFAULTS); one the loss does not read (any, for a loss of
    yours) raises ValueError. entropy_coef: the entropy bonus's weight, any loss.
    advantage: the estimator (advantages.py). nonfinite_logprobs: a counted
    behaviour log-prob that is NaN or inf raises ("raise") or leaves its token
    out ("mask"), built-in losses (aipo_loss's). reduction: "token_mean" (the
    summed loss over the completion tokens that count), "sequence_mean" (each
    completion's token mean, summed, over the completions with a token that
    counts) or None, the loss's own (config.natural_reduction: sequence_mean for
    gspo, token_mean for the others and for a loss of yours). Both counts are
    the whole step's: over the micro-batches and over the data-parallel ranks of
    an FSDP2 model. normalizer: a constant the summed loss of this rank's step is
    divided by instead (Dr.GRPO's; token level: reduction "sequence_mean" is
    refused with it). It is per rank: FSDP then averages the ranks' gradients, so
    with R ranks pass this rank's samples x max tokens (as the pipeline does), not
    the whole batch's, which would make the step R times too small.

    The samples go through in micro-batches of at most micro_batch_size samples
    (None: all at once), their gradients accumulated so that the step equals one
    on the whole batch of every rank's samples: advantages are centred over this
    rank's batch's groups (whole groups lie on one rank), and each micro-batch's
    loss, summed over its tokens (reduction "sum") or over its completions of
    each one's token mean (reduction "sequence_mean" with normalizer 1; each
    completion a sequence of its own), is divided by the global count over the
    number of ranks: FSDP averages the ranks' gradients, so the step is the
    global token (or sequence) mean, as one rank holding every sample would take
    it, whatever the ranks' counts. kl_coef > 0: penalty kl_coef * k3 against
    reference_model's log-probs (computed without gradients on the same rows).
    max_grad_norm: the gradients clipped to that total norm (FSDP2 DTensor
    gradients included). autocast_dtype: the forwards run under torch.autocast
    to it. mask_truncated: see collate. Gradients are zeroed before and after.
    When no token counts on any rank, or the gradient is exactly 0 (every
    token's weight masked), the optimizer does not step: AdamW's momentum and
    weight decay would move the weights on zero gradients.
    Returns StepStats (its docstring: how micro-batches' statistics combine).
    """
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1 (or None: one micro-batch), got {micro_batch_size}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0 (or None: no clipping), got {max_grad_norm}")
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be finite and >= 0, got {lr}")
    if not (math.isfinite(kl_coef) and kl_coef >= 0):
        raise ValueError(f"kl_coef must be finite and >= 0, got {kl_coef}")
    if kl_coef > 0 and reference_model is None:
        raise ValueError(f"kl_coef={kl_coef} needs reference_model (the frozen reference policy)")
    if not callable(loss) and loss not in LOSS_TYPES:
        raise ValueError(f"loss must be one of {LOSS_TYPES} or a function, got {loss!r}")
    parameters = dict(rho=rho, eps_low=eps_low, eps_high=eps_high, mask_low=mask_low, mask_high=mask_high,
                      tau_pos=tau_pos, tau_neg=tau_neg, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg,
                      lambda_neg=lambda_neg)
    check_loss(loss, parameters, temperature=temperature, kl_coef=kl_coef, entropy_coef=entropy_coef)
    if normalizer is not None and not (math.isfinite(normalizer) and normalizer > 0):
        raise ValueError(f"normalizer must be finite and > 0 (or None: the token count), got {normalizer}")
    reduction = natural_reduction(loss, reduction, normalized=normalizer is not None)
    advantages = _sample_advantages(samples, advantage)
    size = micro_batch_size or len(samples)
    device = next(model.parameters()).device
    batches = [_collate(samples[i:i + size], advantages[i:i + size], pad_token_id, mask_truncated).to(device)
               for i in range(0, len(samples), size)]
    counts = [int((b.targets != IGNORE_INDEX).sum()) for b in batches]
    # Completions with a token that counts: a sample's tokens lie in one micro-batch.
    sequence_counts = [len(torch.unique(b.sequence_ids[b.targets != IGNORE_INDEX])) for b in batches]
    total = max(sum(counts), 1)
    counted, counted_sequences = _sum_over_ranks(model, [sum(counts), sum(sequence_counts)])
    # FSDP averages the ranks' gradients: each rank divides by the global count over the ranks.
    ranks = _data_parallel_size(model)
    if normalizer is not None:
        divisor = normalizer
    elif reduction == "token_mean":
        divisor = max(counted, 1) / ranks
    else:
        divisor = max(counted_sequences, 1) / ranks
    for group in optimizer.param_groups:
        group["lr"] = lr
    # Leftover gradients (the supervised warm-up leaves its last ones) must not join this step's.
    optimizer.zero_grad(set_to_none=True)
    loss_sum, stat_sums = 0.0, _StatSums()
    for batch, count, sequences in zip(batches, counts, sequence_counts):
        ref = None if kl_coef == 0 else _reference_logprobs(reference_model, batch, temperature, autocast_dtype)
        if callable(loss):
            summed, stats = _user_loss(model, batch, loss, temperature=temperature, ref_logprobs=ref,
                                       kl_coef=kl_coef, entropy_coef=entropy_coef, autocast_dtype=autocast_dtype,
                                       reduction=reduction)
        else:
            # One optimizer step a batch: the old policy is the model as it is (old_logprobs None: the loss's
            # own log-probs, detached; no second forward).
            # "sequence_mean" with normalizer 1: each completion's token mean, summed (aipo_inputs.reduction_weights).
            by_sequence = reduction == "sequence_mean"
            summed, stats = policy_loss(model, batch, temperature=temperature,
                                        reduction="sequence_mean" if by_sequence else "sum", ref_logprobs=ref,
                                        kl_coef=kl_coef, autocast_dtype=autocast_dtype, loss=loss, old_logprobs=None,
                                        entropy_coef=entropy_coef, normalizer=1.0 if by_sequence else None,
                                        nonfinite_logprobs=nonfinite_logprobs, **parameters)
        # The summed loss scaled here, not through mask = 1 / total: AIPOStats' means
        # divide by the mask's sum, so a fractional mask would skew them.
        (summed / divisor).backward()
        loss_sum += summed.item()
        stat_sums.add(stats, count, sequences)
    # max_norm inf: only the norm (the gradients multiplied by 1); one call either way.
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf if max_grad_norm is None else max_grad_norm)
    if isinstance(norm, DTensor):  # FSDP2: the norm of the sharded gradients, reduced over the ranks
        norm = norm.full_tensor()
    # No step on a gradient of exactly 0 either (every token's weight masked, as
    # geo_mask's window does early in a run): the norm is the global one, so every
    # rank decides alike.
    if counted and norm.item() > 0:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    means = stat_sums.means(total, sum(sequence_counts))
    if callable(loss):
        means.update(dict.fromkeys(_LOSS_OWN_STATS))
    return StepStats(loss=loss_sum / divisor, grad_norm=norm.item(),
                     truncated_samples=sum(b.truncated for b in batches), lr=lr, counted_tokens=counted, **means)


@dataclass
class StepContext:
    """What a step hook (TrainConfig.step_hook) is given, on every trainer rank."""

    step: int  # the RL step (it trains weights version `step` into version step + 1)
    model: torch.nn.Module  # the policy (FSDP2-sharded with several trainer ranks)
    optimizer: torch.optim.Optimizer
    samples: list[Sample]  # this rank's scored samples
    rank: int
    world: int
    lr: float


StepHook = Callable[[StepContext, Callable[[], StepStats]], "dict | None"]


def run_with_hook(hook: StepHook | None, context: StepContext, step: Callable[[], StepStats]) -> tuple[StepStats, dict]:
    """Run `step` (train_step with its arguments bound) through `hook(context,
    step)`: the hook may do anything before and after, must call step() exactly
    once, and may return a dict of numbers, logged with the step's metrics
    (averaged over the trainer ranks). Returns (the step's StepStats, that dict).
    ValueError naming the hook when it breaks that contract."""
    if hook is None:
        return step(), {}
    name = name_of(hook)
    done: list[StepStats] = []

    def once() -> StepStats:
        if done:
            raise RuntimeError(f"step hook {name} ran the step twice")
        done.append(step())
        return done[0]

    extra = hook(context, once)
    if not done:
        raise ValueError(f"step hook {name} returned without running the step (call the step function it is given)")
    extra = {} if extra is None else extra
    numbers_by_name = isinstance(extra, dict) and all(
        isinstance(k, str) and (isinstance(v, numbers.Real) or (isinstance(v, torch.Tensor) and v.numel() == 1))
        and math.isfinite(float(v)) for k, v in extra.items())
    if not numbers_by_name:
        raise ValueError(f"step hook {name} returned {extra!r}; None or a dict of finite numbers by name expected")
    return done[0], {k: float(v) for k, v in extra.items()}


def trainer_plugins(config) -> tuple[str | LossFn, AdvantageFn, StepHook | None]:
    """A TrainConfig's loss (a built-in name or the function), advantage estimator
    and step hook (or None), loaded; ValueError naming the one that does not load
    or cannot take the arguments it is called with. The advantage estimator is
    also tried on a probe (advantages.advantage_function)."""
    loss = builtin_or_load(config.loss.objective, {name: name for name in LOSS_TYPES}, "loss")
    if callable(loss):
        check_arity(loss, (None, None), "loss")
    hook = None
    if config.trainer.step_hook is not None:
        hook = load(config.trainer.step_hook, "step_hook", "function")
        check_arity(hook, (None, None), "step_hook")
    return loss, advantage_function(config.loss.advantage), hook


def _sum_over_ranks(model, counts: list[int]) -> list[int]:
    """`counts` summed over the data-parallel ranks of an FSDP2 model (its
    parameters are DTensors on one mesh: one all-reduce), or `counts` for a
    plain one. The ranks step on averaged gradients: what to divide by, and
    whether to step, is decided on all of them."""
    param = next(model.parameters())
    if not isinstance(param, DTensor):
        return list(counts)
    total = torch.tensor(counts, dtype=torch.int64, device=param.device)
    dist.all_reduce(total, group=param.device_mesh.get_group())
    return total.tolist()


def _data_parallel_size(model) -> int:
    """The ranks FSDP2 averages `model`'s gradients over (its mesh's size), 1 for a plain model."""
    param = next(model.parameters())
    return param.device_mesh.size() if isinstance(param, DTensor) else 1


def learning_rate(step: int, *, base_lr: float, warmup_steps: int, total_steps: int, schedule: str,
                  min_lr_ratio: float) -> float:
    """The learning rate of optimizer step `step` (from 0): a linear warm-up,
    base_lr * (step + 1) / warmup_steps for step < warmup_steps, then base_lr
    ("constant"), or ("cosine") a half cosine from base_lr at the last warm-up step
    (step 0 without warm-up) down to base_lr * min_lr_ratio at step total_steps - 1.
    Steps past total_steps - 1 keep that step's rate."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not (math.isfinite(base_lr) and base_lr > 0):
        raise ValueError(f"base_lr must be finite and > 0, got {base_lr}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps must be in [0, total_steps = {total_steps}], got {warmup_steps}")
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    step = min(step, total_steps - 1)
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    start = max(warmup_steps - 1, 0)
    span = total_steps - 1 - start
    progress = (step - start) / span if span else 0.0  # span 0: a single step (total_steps 1), at base_lr
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def supervised_loss(model, prompts: list[list[int]], completions: list[list[int]], pad_token_id: int):
    """Mean cross-entropy of `completions` (eos included) after `prompts`."""
    packed = _pack(prompts, completions, pad_token_id)
    device = next(model.parameters()).device
    ids, positions, targets = (torch.from_numpy(a).to(device) for a in (packed.input_ids, packed.position_ids,
                                                                       packed.targets))
    logits = _logits(model, ids, positions)
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
