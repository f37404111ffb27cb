"""The policy loss: AIPO (LlamaRL's truncated importance-weighted policy
gradient) and every off-policy correction users compare it with, from logits or
from last hidden states, on the fused log-prob op.

loss = sum_t weight_t l_t: l_t the objective's per-token term (ops/objectives.py
has each formula, its parameters and their defaults with sources), plus
kl_coef * k3 against the reference policy's log-probs, minus entropy_coef * H_t;
weight_t from the reduction and the normalizer (aipo_inputs.reduction_weights):
m_t / sum(m) ("token_mean"), m_t / (sum of m over seq_t * sequences with a
token) ("sequence_mean"), m_t ("sum"); a normalizer replaces sum(m) (or the
sequence count). With every m_t = 0 the loss and the gradients are 0.
Inputs are flat token lists or batched (B, T) rows: their rules (shapes,
per-row advantages, tokens that do not count, sequences) are aipo_inputs.py's.

Every objective is a function of the per-token vectors of token_logprobs /
linear_token_logprobs (ops/logprob.py): the op keeps one log-sum-exp a token,
and its backward turns any dL/dlogp (and dL/dH) into dlogits in one vocabulary
pass. aipo_loss computes it, its gradient and its statistics in one kernel on a
GPU (ops/objective_launch.py), in torch elsewhere (ops/objectives.py);
linear_aipo_loss in torch, chunk by chunk (its sequence-level objectives as
aipo_loss). An objective of your own is a function of those
vectors on the same op.

File order: reference -> functional.
"""

from __future__ import annotations

import math
import numbers

import torch

from .aipo_inputs import (IGNORE_INDEX, TargetCheck, TokenInputs, check_kl, check_logits, check_normalizer, check_old,
                          per_token_advantages, prepare_inputs)
from .logprob import LinearChunkLossFunction, check_linear, linear_token_logprobs, token_logprobs
from .objective_launch import fused_objective_runs, fused_policy_loss
from .objectives import (LOSS_TYPE, MAX_LOG_RATIO, NO_COEF, SEQUENCE_TYPES, TEMPERATURE, AIPOStats, Objective,
                         objective_stats, objective_terms, resolve_objective)

__all__ = ["AIPOStats", "IGNORE_INDEX", "aipo_loss", "aipo_loss_ref", "group_advantages", "linear_aipo_loss"]

# ----------------------------------------------------------------------------- reference


def _sequence_keys(targets: torch.Tensor, sequence_ids: torch.Tensor | None) -> list:
    """Each token's sequence as a Python key: its id (flat), its row (batched
    without ids) or (row, id) (batched with ids); None for flat tokens without ids."""
    n = targets.numel()
    if targets.dim() < 2:
        return [None] * n if sequence_ids is None else sequence_ids.reshape(-1).tolist()
    length = targets.shape[-1]
    rows = [t // length for t in range(n)]
    if sequence_ids is None:
        return rows
    return list(zip(rows, sequence_ids.reshape(-1).tolist()))


def aipo_loss_ref(logits, targets, behavior_logprobs, advantages, mask=None, *, rho=None,
                  temperature=TEMPERATURE, reduction="token_mean", sequence_ids=None, loss_type=LOSS_TYPE,
                  old_logprobs=None, eps_low=None, eps_high=None, ref_logprobs=None, kl_coef=NO_COEF, mask_low=None,
                  mask_high=None, entropy_coef=NO_COEF, normalizer=None, compute_dtype=torch.float64, magnitude=False,
                  nonfinite_logprobs="raise", tau_pos=None, tau_neg=None, k_pos=None, lambda_pos=None, k_neg=None,
                  lambda_neg=None, objective=None):
    """The loss written from the formulas (ops/objectives.py), with plain torch
    autograd (log_softmax, gather), per-sequence sums and reductions by Python
    loops over the sequences: the reference for values and gradients, in
    float64 by default; compute_dtype=None runs in the logits' own dtype, the
    naive version users would write. Inputs as aipo_loss's, unchecked but for
    the parameters. Returns the loss; gradients through backward().
    magnitude=True: the same reduction of each token's |term| instead, the
    scale of the loss's rounding error (each term is rounded, so a loss whose
    terms cancel is accurate relative to this, not to itself)."""
    cfg = resolve_objective(objective, loss_type, rho=rho, eps_low=eps_low, eps_high=eps_high, mask_low=mask_low,
                            mask_high=mask_high, tau_pos=tau_pos, tau_neg=tau_neg, k_pos=k_pos, lambda_pos=lambda_pos,
                            k_neg=k_neg, lambda_neg=lambda_neg, temperature=temperature, kl_coef=kl_coef,
                            entropy_coef=entropy_coef)
    loss_type, temperature, kl_coef, entropy_coef = cfg.loss_type, cfg.temperature, cfg.kl_coef, cfg.entropy_coef
    check_kl(kl_coef, ref_logprobs)
    check_old(loss_type, old_logprobs)
    dtype = logits.dtype if compute_dtype is None else compute_dtype
    logp_all = torch.log_softmax(logits.to(dtype) / temperature, dim=-1).reshape(-1, logits.shape[-1])
    t = targets.reshape(-1)
    m = torch.ones(t.shape, dtype=dtype, device=t.device) if mask is None else mask.reshape(-1).to(dtype)
    on = (t != IGNORE_INDEX) & (m != 0)
    if nonfinite_logprobs == "mask":  # a token whose given log-prob is NaN or +-inf does not count
        for x in (behavior_logprobs, old_logprobs, ref_logprobs):
            on = on if x is None else on & torch.isfinite(x.reshape(-1))
    m = torch.where(on, m, 0.0)
    logp = torch.where(on, logp_all.gather(-1, torch.where(on, t, 0).unsqueeze(-1)).squeeze(-1), 0.0)

    def given(x):  # None: on-policy, the learner's own log-probs, detached
        return logp.detach() if x is None else torch.where(on, x.reshape(-1).to(dtype), 0.0)

    b, old, ref = given(behavior_logprobs), given(old_logprobs), None if ref_logprobs is None else given(ref_logprobs)
    a = given(per_token_advantages(advantages, targets.shape))
    keys = _sequence_keys(targets, sequence_ids)
    groups: dict = {}
    for index in torch.nonzero(on).reshape(-1).tolist():
        groups.setdefault(keys[index], []).append(index)
    groups = {key: torch.tensor(idx, dtype=torch.long, device=logp.device) for key, idx in groups.items()}
    kind, terms = cfg.loss_type, torch.zeros_like(logp)
    log_r = (logp - b).detach()

    def pg(w):  # -sg(w) A logp; 0 where w is
        return torch.where(w == 0, 0.0, -w.detach() * a * logp)

    def clip(x):
        return torch.clamp(x, 1 - cfg.eps_low, 1 + cfg.eps_high)

    if kind == "aipo":
        terms = pg(torch.clamp(torch.exp(log_r.clamp(max=MAX_LOG_RATIO)), max=cfg.rho))
    elif kind in ("ppo", "ppo_tis"):
        q = torch.exp((logp - old).clamp(max=MAX_LOG_RATIO))
        terms = -torch.minimum(q * a, clip(q) * a)
        if kind == "ppo_tis":
            terms = torch.clamp(torch.exp((old - b).clamp(max=MAX_LOG_RATIO)), max=cfg.rho) * terms
    elif kind == "icepop":
        r = torch.exp(log_r.clamp(max=MAX_LOG_RATIO))
        terms = pg(torch.where((r >= cfg.mask_low) & (r <= cfg.mask_high), r, 0.0))
    elif kind == "cispo":
        terms = pg(clip(torch.exp((logp - old).detach().clamp(max=MAX_LOG_RATIO))))
    elif kind == "sapo":
        q = torch.exp((logp - old).clamp(max=MAX_LOG_RATIO))
        tau = torch.where(a > 0, cfg.tau_pos, cfg.tau_neg).to(dtype)
        terms = -4 / tau * torch.sigmoid(tau * (q - 1)) * a
    else:  # the sequence-level objectives, one sequence at a time
        w = torch.zeros_like(logp)
        for idx in groups.values():
            s = log_r[idx].sum()
            if kind == "seq_tis":
                w[idx] = torch.clamp(torch.exp(s.clamp(max=MAX_LOG_RATIO)), max=cfg.rho)
            elif kind == "seq_mis":
                ratio = torch.exp(s.clamp(max=MAX_LOG_RATIO))
                w[idx] = ratio if cfg.mask_low <= ratio <= cfg.mask_high else 0.0
            elif kind == "geo_mask":
                keep = cfg.mask_low <= torch.exp(s / len(idx)) <= cfg.mask_high
                w[idx] = torch.clamp(torch.exp(log_r[idx].clamp(max=MAX_LOG_RATIO)), max=cfg.rho) * float(keep)
            elif kind == "vespo":  # the gamma weight, its shape by each token's advantage sign
                v = log_r[idx].clamp(-20.0, 20.0).sum().clamp(math.log(1e-8), 20.0)
                k = torch.where(a[idx] >= 0, cfg.k_pos, cfg.k_neg).to(dtype)
                lam = torch.where(a[idx] >= 0, cfg.lambda_pos, cfg.lambda_neg).to(dtype)
                w[idx] = torch.exp(lam + k * v - lam * torch.exp(v)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
            else:  # gspo: the gradient through g
                g = torch.exp(((logp[idx] - old[idx]).sum() / len(idx)).clamp(max=MAX_LOG_RATIO))
                terms = terms.index_put((idx,), -torch.minimum(g * a[idx], clip(g) * a[idx]))
        if kind != "gspo":
            terms = pg(w)
    if ref is not None and kl_coef > 0:
        x = ref - logp
        # The value clamped, the gradient passed through the clamp (straight-through).
        x = x + (x.clamp(max=MAX_LOG_RATIO) - x).detach()
        terms = terms + kl_coef * (torch.exp(x) - x - 1)
    if entropy_coef > 0:
        p_all = logp_all.exp()
        entropy = -torch.where(p_all > 0, p_all * logp_all, 0.0).sum(-1)
        terms = terms - entropy_coef * torch.where(on, entropy, 0.0)
    terms = torch.where(on, terms, 0.0)
    if magnitude:
        terms = terms.abs()
    norm = check_normalizer(normalizer, logits.device)
    if reduction in ("token_mean", "sum"):
        total = (terms * m).sum()
        if norm is not None:
            return total / norm
        return total if reduction == "sum" else (total / m.sum() if m.sum() > 0 else total * 0)
    if not groups:
        return (terms * m).sum()
    if None in groups:
        raise ValueError('reduction="sequence_mean" on flat inputs needs sequence_ids')
    means = [(terms[idx] * m[idx]).sum() / m[idx].sum() for idx in groups.values()]
    return torch.stack(means).sum() / (len(means) if norm is None else norm)


# ----------------------------------------------------------------------------- functional


def _objective(logp: torch.Tensor, entropy: torch.Tensor | None, inputs: TokenInputs, cfg: Objective,
               rows: slice = slice(None)):
    """(the loss over the tokens `rows`, their ObjectiveTerms) of cfg's objective
    on the fused op's flat per-token outputs for those rows; a slice of the
    tokens only for a token-local objective (no sequences)."""
    def part(t):
        return None if t is None else t[rows]

    terms = objective_terms(logp, entropy, part(inputs.behavior), inputs.advantages[rows], part(inputs.old),
                            part(inputs.ref), inputs.counted[rows], inputs.sequences, cfg)
    weights = inputs.weights[rows]
    return torch.where(weights != 0, weights * terms.terms, 0.0).sum(), terms


def _stats(logp: torch.Tensor, entropy: torch.Tensor | None, inputs: TokenInputs, terms) -> AIPOStats:
    return objective_stats(logp, entropy, inputs.behavior, inputs.mask, inputs.ref, inputs.sequences, terms,
                           inputs.shape)


def _policy_loss(logp: torch.Tensor, entropy: torch.Tensor | None, inputs: TokenInputs,
                 cfg: Objective) -> tuple[torch.Tensor, AIPOStats]:
    """(loss, stats) of cfg's objective on the fused op's per-token outputs: by the
    objective kernel on a GPU (objective_launch), else by the torch path."""
    if fused_objective_runs(logp):
        return fused_policy_loss(logp, entropy, inputs, cfg)
    return torch_policy_loss(logp, entropy, inputs, cfg)


def torch_policy_loss(logp: torch.Tensor, entropy: torch.Tensor | None, inputs: TokenInputs,
                      cfg: Objective) -> tuple[torch.Tensor, AIPOStats]:
    """_policy_loss by the torch path, op by op (objective_terms, objective_stats)."""
    flat_logp = logp.reshape(-1)
    flat_entropy = None if entropy is None else entropy.reshape(-1)
    loss, terms = _objective(flat_logp, flat_entropy, inputs, cfg)
    return loss, _stats(flat_logp, flat_entropy, inputs, terms)


def aipo_loss(logits, targets, behavior_logprobs, advantages, mask=None, *, rho=None, temperature=TEMPERATURE,
              reduction="token_mean", sequence_ids=None, loss_type=LOSS_TYPE, old_logprobs=None, eps_low=None,
              eps_high=None, entropy=False, ref_logprobs=None, kl_coef=NO_COEF, mask_low=None, mask_high=None,
              entropy_coef=NO_COEF, normalizer=None, process_group=None, nonfinite_logprobs="raise", tau_pos=None,
              tau_neg=None, k_pos=None, lambda_pos=None, k_neg=None, lambda_neg=None, objective=None):
    """The policy loss `loss_type` (aipo, ppo, ppo_tis, icepop, seq_tis, seq_mis,
    geo_mask, gspo, cispo, sapo, vespo: ops/objectives.py) from logits.

    logits: (num_tokens, vocab), or batched (B, T, vocab) (any (..., T, vocab)),
    bf16 / fp16 / fp32; gradients flow to logits only. With process_group, this
    rank's shard of the vocabulary (ops/logprob.py: ranks hold equal, ordered
    column ranges; targets are global ids). targets: int, the logits' leading
    shape; IGNORE_INDEX (-100) or mask 0 to leave a token out (its target then
    any integer, never read: log-prob 0, no loss, dlogits exactly 0 where its
    logits are finite or -inf); a counted target outside [0, vocab) raises
    ValueError naming its position. behavior_logprobs, mask, old_logprobs,
    ref_logprobs, sequence_ids: per token, in the targets' shape. advantages:
    per token, or batched one per row, (B,) or (B, 1). `-inf` logits (masked
    vocabulary) are allowed.

    objective: an ops.Objective (the kind, its parameters, temperature, kl_coef,
    entropy_coef as one checked value); or, as shorthand, loss_type and rho,
    mask_low / mask_high, eps_low / eps_high, tau_pos / tau_neg (sapo), k_pos /
    lambda_pos / k_neg / lambda_neg (vespo): the objective's parameters (None: its
    default; one it does not read raises ValueError), not both (ValueError). old_logprobs: read by ppo,
    ppo_tis, gspo, cispo, sapo (refused by the others). behavior_logprobs
    or old_logprobs None: on-policy, the learner's own detached log-probs in
    their place (ratios of 1, no extra pass). nonfinite_logprobs: "raise"
    (ValueError naming the argument and position of a counted token whose
    log-prob is NaN or +-inf) or "mask" (such tokens do not count); a counted
    log-prob above 1e-3 raises (probabilities passed as log-probs). Rules:
    aipo_inputs.py. reduction and sequences: aipo_inputs.py
    (the sequence-level objectives need sequences as sequence_mean does).
    normalizer: a number or one-element tensor replacing the reduction's
    denominator (a global token count, Dr.GRPO's constant). ref_logprobs,
    kl_coef: the reference policy's log-probs of the targets (at the same
    temperature) and the weight of the k3 KL penalty; kl_coef > 0 needs
    ref_logprobs. entropy_coef: the weight of the entropy bonus (differentiable;
    computes the entropy); entropy=True: the entropy's mean in the stats.
    Returns (loss, AIPOStats), stats.logprobs in the targets' shape.

    Host syncs: in eager mode on a GPU, the waits for the input checks
    (aipo_inputs.TargetCheck, ValueCheck: both copies queued before the
    kernels, so the second wait finds its copy done) after the kernels are
    queued, so that a counted target outside the vocabulary or a log-prob the
    rules refuse raises here naming its position (with process_group the shard
    sizes are read in the same wait); none under torch.compile or CUDA graph
    capture, where the checks are skipped (such a target gets a NaN log-prob,
    such a log-prob reaches the loss). sequence_ids are grouped on the device
    (sorts and a cumulative sum), without one.
    """
    cfg = resolve_objective(objective, loss_type, rho=rho, eps_low=eps_low, eps_high=eps_high, mask_low=mask_low,
                            mask_high=mask_high, tau_pos=tau_pos, tau_neg=tau_neg, k_pos=k_pos, lambda_pos=lambda_pos,
                            k_neg=k_neg, lambda_neg=lambda_neg, temperature=temperature, kl_coef=kl_coef,
                            entropy_coef=entropy_coef)
    loss_type, temperature, kl_coef, entropy_coef = cfg.loss_type, cfg.temperature, cfg.kl_coef, cfg.entropy_coef
    check_logits(logits)  # the logits' own checks first
    inputs = prepare_inputs(logits.shape[:-1], logits.device, targets, behavior_logprobs, advantages, mask,
                            old_logprobs, ref_logprobs, sequence_ids, cfg, reduction, normalizer, nonfinite_logprobs)
    logp, ent = token_logprobs(logits, inputs.targets.view(inputs.shape), temperature=temperature,
                               entropy=entropy or entropy_coef > 0, process_group=process_group)
    inputs.check.wait()
    return _policy_loss(logp, ent, inputs, cfg)


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = False,
                     eps: float = 1e-6) -> torch.Tensor:
    """A = r - mean(r over the samples of the same prompt) (AIPO); with
    normalize_std, divided by the group's std + eps (GRPO). rewards, group_ids: (num_samples,).
    ValueError naming the first reward that is not finite (one NaN would spread
    over its whole group), and an eps that is not a finite number >= 0. Host
    syncs: the groups are counted on the host."""
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards and group_ids must be 1-D of one shape, got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    r = rewards.to(torch.float32)
    bad = ~torch.isfinite(r)
    if bool(bad.any()):
        first = int(bad.to(torch.uint8).argmax())
        raise ValueError(f"rewards[{first}] = {float(r[first])}: rewards must be finite")
    _, index = torch.unique(group_ids, return_inverse=True)
    groups = int(index.max()) + 1 if index.numel() else 0
    counts = torch.zeros(groups, device=r.device).index_add_(0, index, torch.ones_like(r))
    means = torch.zeros(groups, device=r.device).index_add_(0, index, r) / counts
    centered = r - means[index]
    if not normalize_std:
        return centered
    var = torch.zeros(groups, device=r.device).index_add_(0, index, centered**2) / (counts - 1).clamp(min=1)
    return centered / (var.sqrt()[index] + eps)


def linear_aipo_loss(hidden, weight, targets, behavior_logprobs, advantages, mask=None, *, rho=None,
                     temperature=TEMPERATURE, reduction="token_mean", sequence_ids=None, loss_type=LOSS_TYPE,
                     old_logprobs=None, eps_low=None, eps_high=None, entropy=False, chunk_size=None,
                     ref_logprobs=None, kl_coef=NO_COEF, mask_low=None, mask_high=None, entropy_coef=NO_COEF,
                     normalizer=None, process_group=None, nonfinite_logprobs="raise", tau_pos=None, tau_neg=None,
                     k_pos=None, lambda_pos=None, k_neg=None, lambda_neg=None, objective=None):
    """`aipo_loss` of `hidden @ weight.T`, without ever holding the full logits.

    hidden: (num_tokens, hidden), or batched (B, T, hidden) (any (..., T,
    hidden)); weight: (vocab, hidden), the lm-head (with process_group, this
    rank's rows; hidden the same on every rank); gradients flow to both. The
    other inputs as aipo_loss's, in hidden's leading shape. chunk_size: tokens
    per chunk (default: about 1 GiB of logits in their dtype on a GPU, 32 Mi
    logits on CPU); one chunk's logits buffer and, when there are several
    chunks, a vocab x hidden float32 accumulator for the weight's gradient are
    the memory it holds beyond its inputs and outputs. Returns (loss,
    AIPOStats) as aipo_loss does. Host syncs as aipo_loss's.
    """
    cfg = resolve_objective(objective, loss_type, rho=rho, eps_low=eps_low, eps_high=eps_high, mask_low=mask_low,
                            mask_high=mask_high, tau_pos=tau_pos, tau_neg=tau_neg, k_pos=k_pos, lambda_pos=lambda_pos,
                            k_neg=k_neg, lambda_neg=lambda_neg, temperature=temperature, kl_coef=kl_coef,
                            entropy_coef=entropy_coef)
    loss_type, temperature, kl_coef, entropy_coef = cfg.loss_type, cfg.temperature, cfg.kl_coef, cfg.entropy_coef
    chunk_size = check_linear(hidden, weight, chunk_size)
    inputs = prepare_inputs(hidden.shape[:-1], hidden.device, targets, behavior_logprobs, advantages, mask,
                            old_logprobs, ref_logprobs, sequence_ids, cfg, reduction, normalizer, nonfinite_logprobs)
    with_entropy = entropy or entropy_coef > 0
    # The three-GEMM path only where it pays: a token-local objective, gradients
    # wanted, one rank's whole vocabulary, and eager mode (it runs autograd.grad
    # per chunk inside its forward, which torch.compile does not trace).
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if (process_group is not None or cfg.loss_type in SEQUENCE_TYPES or not wants_grad
            or torch.compiler.is_compiling()):
        logp, ent = linear_token_logprobs(hidden, weight, inputs.targets.view(inputs.shape), temperature=temperature,
                                          entropy=with_entropy, chunk_size=chunk_size, process_group=process_group)
        inputs.check.wait()
        return _policy_loss(logp, ent, inputs, cfg)
    # A token-local objective: each chunk's gradient known from its own tokens, the
    # logits computed once (LinearChunkLossFunction).
    def chunk_loss(rows, chunk_logp, chunk_entropy):
        return _objective(chunk_logp, chunk_entropy if with_entropy else None, inputs, cfg, rows)[0]

    check = TargetCheck(inputs.targets, weight.shape[0], inputs.shape)
    loss, logp, ent = LinearChunkLossFunction.apply(hidden.reshape(-1, hidden.shape[-1]), weight, inputs.targets,
                                                    temperature, with_entropy, chunk_size, chunk_loss)
    check.wait()
    inputs.check.wait()
    ent = ent if with_entropy else None
    return loss, _stats(logp, ent, inputs, _objective(logp, ent, inputs, cfg)[1])
