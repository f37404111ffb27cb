"""AIPO loss (LlamaRL's truncated importance-weighted policy gradient) and the
objectives users compare it with, from logits or from last hidden states.

For token t: logp_t = log_softmax(logits_t / temperature)[y_t], behaviour log-prob
b_t (from the generator), advantage A_t, mask m_t.
    aipo     w_t = min(exp(logp_t - b_t), rho), a constant;  l_t = -w_t A_t logp_t
    ppo      r_t = exp(logp_t - old_t);  l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
    ppo_tis  l_t = min(exp(old_t - b_t), rho) * ppo l_t (token-level truncated IS of the
             trainer's old policy against the generator's behaviour policy)
    KL penalty (optional): with the frozen reference policy's log-probs ref_t,
    l_t += kl_coef * k3_t, k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1, the k3
    estimator of KL(pi || ref) on tokens sampled from (nearly) pi; dk3_t / dlogp_t =
    1 - exp(ref_t - logp_t).
    loss = sum_t weight_t l_t with weight_t = m_t / sum(m) ("token_mean"), m_t /
    (sum of m over seq_t * sequences with a token) ("sequence_mean"), m_t ("sum").
    With every m_t = 0 the loss and the gradients are 0.
Inputs are flat token lists or batched (B, T) rows: their rules (shapes,
per-row advantages, tokens that do not count, sequences) are aipo_inputs.py's.
Every objective is per token, so dl/dlogp_t is known in the forward pass: the
backward only turns it into dlogits (one vocabulary pass, kernels/logprob.py),
and the linear variant computes its gradients chunk by chunk during the forward.

File order: reference -> launchers -> torch CPU path -> autograd -> functional.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch

from ._launch import KernelLaunch, next_pow2, use_interpreter
from .aipo_inputs import (IGNORE_INDEX, TokenInputs, check_kl, flat_logits, per_token_advantages, prepare_inputs,
                          reduction_weights, sequence_index)


@dataclass(frozen=True)
class ObjectiveConfig:
    loss_type: str = "aipo"
    rho: float = 4.0
    eps_low: float = 0.2
    eps_high: float = 0.2
    temperature: float = 1.0
    kl_coef: float = 0.0


@dataclass
class AIPOStats:
    """Detached diagnostics over the tokens that count (mask not 0, target not
    IGNORE_INDEX); the means are weighted by the mask (plain means for a 0 / 1
    mask). Computed on the device, with no host sync."""

    logprobs: torch.Tensor  # learner log-probs, float32, in the targets' shape; 0 where a token does not count
    mean_ratio: torch.Tensor  # mean exp(logp - b)
    truncated_fraction: torch.Tensor  # fraction of tokens with exp(logp - b) > rho
    mismatch_kl: torch.Tensor  # k3 estimate of KL(behaviour || learner): r - 1 - log r, r = exp(logp - b)
    entropy: torch.Tensor | None = None  # mean entropy of the learner distribution, if asked for
    ref_kl: torch.Tensor | None = None  # mean k3 estimate of KL(learner || reference), with ref_logprobs
    # "ppo" and "ppo_tis": fraction of tokens where the clipped surrogate is the one
    # taken, clip(r) A < r A with r = exp(logp - old): the clip is active and the
    # token gets no gradient from the policy term (verl's pg_clipfrac). "aipo": None,
    # as it has no clip (its truncation at rho is truncated_fraction); a 0 would
    # read as "a clip that never acted".
    clip_fraction: torch.Tensor | None = None


# exp(80) = 5.5e34: clamping log-ratios there keeps ratios, k3 and their products
# with weights and advantages finite in float32 (max 3.4e38).
MAX_LOG_RATIO = 80.0


# ----------------------------------------------------------------------------- reference


def aipo_loss_ref(logits, targets, behavior_logprobs, advantages, mask=None, *, rho=4.0, temperature=1.0,
                  reduction="token_mean", sequence_ids=None, loss_type="aipo", old_logprobs=None, eps_low=0.2,
                  eps_high=0.2, ref_logprobs=None, kl_coef=0.0, compute_dtype=torch.float64):
    """Plain torch autograd (log_softmax, gather, the objective), in float64 by
    default: the reference for values and gradients. With compute_dtype=None it
    runs in the logits' own dtype: the naive version users would write. Inputs
    as aipo_loss's (flat or batched, aipo_inputs.py), unchecked but for the
    shapes of advantages and sequence_ids: a token that does not count is left
    out of the gather and of the loss by torch.where. Returns the loss;
    gradients through backward()."""
    check_kl(kl_coef, ref_logprobs)
    dtype = logits.dtype if compute_dtype is None else compute_dtype
    x = logits.to(dtype) / temperature
    logp_all = torch.log_softmax(x, dim=-1)
    m = torch.ones(targets.shape, dtype=dtype, device=logits.device) if mask is None else mask.to(dtype)
    counts = (targets != IGNORE_INDEX) & (m != 0)
    m = torch.where(counts, m, 0.0)
    picked = logp_all.gather(-1, torch.where(counts, targets, 0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(counts, picked, 0.0)
    b, a = behavior_logprobs.to(dtype), per_token_advantages(advantages, targets.shape).to(dtype)
    if loss_type == "aipo":
        w = torch.clamp(torch.exp(logp.detach() - b), max=rho)
        terms = torch.where(w == 0, 0.0, -w * a * logp)
    else:
        old = old_logprobs.to(dtype)
        r = torch.exp(logp - old)
        terms = -torch.minimum(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
        if loss_type == "ppo_tis":
            terms = torch.clamp(torch.exp(old - b), max=rho) * terms
    if ref_logprobs is not None:
        x = ref_logprobs.to(dtype) - logp
        # The value clamped, the gradient passed through the clamp (straight-through),
        # as token_objective's analytic derivative does.
        x = x + (x.clamp(max=MAX_LOG_RATIO) - x).detach()
        terms = terms + kl_coef * (torch.exp(x) - x - 1)
    sequences = sequence_index(sequence_ids, targets.shape, reduction, logits.device)
    weights = reduction_weights(m.reshape(-1), reduction, sequences)
    return torch.where(weights != 0, weights * terms.reshape(-1), 0.0).sum()


def reference_kl(logp: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token k3 = exp(ref - logp) - (ref - logp) - 1 and its derivative
    dk3 / dlogp = 1 - exp(ref - logp), with ref - logp clamped at MAX_LOG_RATIO. The
    derivative is taken at the clamped value rather than zeroed beyond it: a token
    the learner made e^80 times less likely than the reference keeps a (bounded)
    pull back towards it."""
    x = (ref - logp).clamp(max=MAX_LOG_RATIO)
    r = torch.exp(x)
    return r - x - 1, 1 - r


def ppo_surrogates(logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor,
                   cfg: ObjectiveConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's (r A, clip(r, 1 - eps_low, 1 + eps_high) A), r = exp(logp - old): the
    objective takes the smaller; where the clipped one is strictly smaller, the
    clip is active and the token gets no gradient from it."""
    r = torch.exp(logp - old)
    return r * advantages, torch.clamp(r, 1 - cfg.eps_low, 1 + cfg.eps_high) * advantages


def token_objective(logp: torch.Tensor, behavior: torch.Tensor, advantages: torch.Tensor, old: torch.Tensor | None,
                    ref: torch.Tensor | None, cfg: ObjectiveConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss l_t and its derivative dl_t / dlogp_t, in float32, analytically
    (no autograd): the truncated IS weights are constants; PPO's clipped branch has
    no gradient; with ref, kl_coef * k3 and its derivative are added."""
    if cfg.loss_type == "aipo":
        w = torch.clamp(torch.exp(logp - behavior), max=cfg.rho)
        terms, grad = torch.where(w == 0, 0.0, -w * advantages * logp), -w * advantages
    else:
        unclipped, clipped = ppo_surrogates(logp, old, advantages, cfg)
        terms = -torch.minimum(unclipped, clipped)
        grad = torch.where(clipped < unclipped, 0.0, -unclipped)
        if cfg.loss_type == "ppo_tis":
            tis = torch.clamp(torch.exp(old - behavior), max=cfg.rho)
            terms, grad = tis * terms, tis * grad
    if ref is not None:
        k3, dk3 = reference_kl(logp, ref)
        terms, grad = terms + cfg.kl_coef * k3, grad + cfg.kl_coef * dk3
    return terms, grad


# ----------------------------------------------------------------------------- launchers


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _use_triton(logits: torch.Tensor) -> bool:
    """Triton for CUDA tensors, and for CPU tensors under TRITON_INTERPRET=1."""
    return logits.device.type == "cuda" or (logits.device.type == "cpu" and use_interpreter())


@dataclass(frozen=True)
class LogprobConfig:
    """Launch shape of a log-prob kernel: a program takes `rows` token rows and
    walks the vocabulary in `block_v` blocks with `num_warps` warps. The backward
    splits each row's vocabulary over several programs (a second grid axis) until
    the grid has `min_programs` programs (0: one program per `rows` rows); the
    forward ignores min_programs."""

    block_v: int
    rows: int
    num_warps: int
    min_programs: int = 0


# On a GPU, (largest vocabulary, forward, backward) by vocabulary; each config is
# one compiled variant per dtype, so kernel_variants() compiles every row. Memory
# bound: the aim is enough bytes in flight per SM (by Little's law an H100 needs
# about 16 KiB: 23 GB/s a SM times ~0.7 us of latency) with registers left for
# 64 warps. Chosen from registers (kernel_check) and that estimate, not yet timed:
# - Forward: per-lane accumulators cost 2 registers (3 with the entropy) per value
#   a thread holds; 2048 x 8 warps: 8 bf16 values (one 16-byte load) a thread, 32
#   registers on sm_90, 8 programs = 64 warps a SM, 32 KiB of loads in flight.
# - Backward: no accumulators; 8192 x 16 warps: two 16-byte loads a thread;
#   min_programs 8192, so short batches (a linear_aipo_loss chunk) still fill the
#   GPU and the last wave is a small part.
# On an H100 (`--gpu-sweep`, 4096 x 128256 bf16): forward 2048 x 8 warps 0.97x of
# a device copy of its bytes, the best of 11 shapes; backward 8192 x 16 warps,
# >= 8192 programs, 0.96x (the 4096 x 8 warps it replaced: 0.94x).
# - Vocabularies up to 8192: 2 or 4 rows a program, 8 values a thread (4 rows of
#   1024 had ptxas spill a register on sm_80 / sm_90).
# `python -m llamarl_core.bench.bench_aipo --gpu-sweep` times the large-vocabulary
# configs beside other candidates.
GPU_CONFIGS = (
    (1024, LogprobConfig(block_v=256, rows=4, num_warps=4), LogprobConfig(block_v=256, rows=4, num_warps=4)),
    (8192, LogprobConfig(block_v=1024, rows=2, num_warps=8), LogprobConfig(block_v=1024, rows=2, num_warps=8)),
    (None, LogprobConfig(block_v=2048, rows=1, num_warps=8),
     LogprobConfig(block_v=8192, rows=1, num_warps=16, min_programs=8192)),
)


def logprob_configs(vocab: int, num_rows: int, on_gpu: bool) -> tuple[LogprobConfig, LogprobConfig]:
    """(forward, backward) configs: the GPU table's row for `vocab`. In the
    interpreter, where each program instance costs about 0.5 ms (V=32000 over 64
    rows: 0.16 s at BLOCK_V=32768, 2.8 s at 1024), few large programs: two
    vocabulary blocks a row (so the loop runs more than once) and up to 32768
    elements a program."""
    if on_gpu:
        return next((fwd, bwd) for limit, fwd, bwd in GPU_CONFIGS if limit is None or vocab <= limit)
    block = min(16384, max(16, next_pow2(vocab) // 2))
    config = LogprobConfig(block, min(next_pow2(num_rows), max(1, 32768 // block)), 4)
    return config, config


def _forward_launch(logits, targets, lse, logp, ent, temperature: float, config: LogprobConfig) -> KernelLaunch:
    from llamarl_core.kernels.logprob import logprob_fwd_kernel

    n, v = logits.shape
    return KernelLaunch(
        logprob_fwd_kernel, (_cdiv(n, config.rows),),
        dict(logits_ptr=logits, targets_ptr=targets, lse_ptr=lse, logp_ptr=logp,
             entropy_ptr=ent if ent is not None else lse, num_rows=n, vocab=v, stride_row=logits.stride(0),
             inv_temperature=1.0 / temperature),
        dict(IGNORE_INDEX=IGNORE_INDEX, BLOCK_V=config.block_v, ROWS=config.rows, COMPUTE_ENTROPY=ent is not None),
        config.num_warps)


def _backward_launch(logits, dlogits, targets, lse, coef, temperature: float, config: LogprobConfig) -> KernelLaunch:
    from llamarl_core.kernels.logprob import logprob_bwd_kernel

    n, v = logits.shape
    row_programs = _cdiv(n, config.rows)
    num_blocks = max(1, _cdiv(v, config.block_v))
    splits = min(num_blocks, max(1, _cdiv(config.min_programs, row_programs)))
    cols_per_program = _cdiv(num_blocks, splits) * config.block_v
    return KernelLaunch(
        logprob_bwd_kernel, (row_programs, max(1, _cdiv(v, cols_per_program))),
        dict(logits_ptr=logits, dlogits_ptr=dlogits, targets_ptr=targets, lse_ptr=lse, coef_ptr=coef, num_rows=n,
             vocab=v, stride_row=logits.stride(0), stride_drow=dlogits.stride(0), inv_temperature=1.0 / temperature,
             cols_per_program=cols_per_program),
        dict(BLOCK_V=config.block_v, ROWS=config.rows), config.num_warps)


def logprob_launches(logits, targets, lse, logp, ent, coef, dlogits, temperature: float, forward: LogprobConfig,
                     backward: LogprobConfig) -> tuple[KernelLaunch, KernelLaunch]:
    """The forward and backward KernelLaunch of these configs on these tensors
    (CUDA ones to time, CPU ones to compile): how kernel_variants(), the tests and
    the GPU sweep (bench_aipo --gpu-sweep) reach any config."""
    return (_forward_launch(logits, targets, lse, logp, ent, temperature, forward),
            _backward_launch(logits, dlogits, targets, lse, coef, temperature, backward))


def kernel_variants() -> list[tuple[str, KernelLaunch]]:
    """Every (kernel, constexprs, argument types) the launchers can launch on a
    GPU, on small CPU tensors standing in for CUDA ones: what a GPU must compile.
    Each GPU_CONFIGS row in every dtype, the forward with and without the entropy;
    for bf16 also a vocabulary that is not a multiple of 16 (the JIT's divisibility
    hint on the row stride, which gives 16-byte loads)."""
    variants = []
    cases = [(dtype, limit, fwd, bwd) for dtype in (torch.bfloat16, torch.float16, torch.float32)
             for limit, fwd, bwd in GPU_CONFIGS]
    cases.append((torch.bfloat16, 32001, *GPU_CONFIGS[-1][1:]))
    for dtype, limit, fwd, bwd in cases:
        vocab = limit if limit is not None else 128256
        logits = torch.empty((4, vocab), dtype=dtype)
        targets = torch.empty(4, dtype=torch.int64)
        lse, logp, ent = (torch.empty(4, dtype=torch.float32) for _ in range(3))
        tag = f"{str(dtype).removeprefix('torch.')}, vocab {vocab}"
        for entropy in (False, True):
            forward, backward = logprob_launches(logits, targets, lse, logp, ent if entropy else None, logp,
                                                 torch.empty_like(logits), 0.7, fwd, bwd)
            variants.append((f"logprob forward, {tag}{', entropy' if entropy else ''}", forward))
        variants.append((f"logprob backward, {tag}", backward))
    return variants


def _run(launch: KernelLaunch, device: torch.device) -> None:
    """launch.launch(device); in the interpreter with numpy's floating-point
    warnings off, as on a GPU: the kernels overflow to -inf and take exp2(-inf) = 0
    on purpose (kernels/logprob.py)."""
    if device.type != "cpu":
        launch.launch(device)
        return
    with numpy.errstate(over="ignore", divide="ignore", invalid="ignore"):
        launch.launch(device)


def logprob_forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool,
                    scratch: torch.Tensor | None = None):
    """(lse, logp, entropy or None), float32 (num_tokens,), for 2-D contiguous-row
    logits. scratch: an optional float32 buffer of at least one CPU chunk, reused.
    A row of -inf only has lse = -inf, log-prob NaN (0 for an ignored token) and
    entropy NaN."""
    n, v = logits.shape
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    logp = torch.empty_like(lse)
    ent = torch.empty_like(lse) if entropy else None
    if n == 0:
        return lse, logp, ent
    if _use_triton(logits):
        on_gpu = logits.device.type == "cuda"
        config = logprob_configs(v, n, on_gpu)[0]
        _run(_forward_launch(logits, targets, lse, logp, ent, temperature, config), logits.device)
        return lse, logp, ent
    _cpu_forward(logits, targets, 1.0 / temperature, lse, logp, ent, scratch)
    return lse, logp, ent


def logprob_backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor,
                     temperature: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """dlogits = coef_t * (onehot(y_t) - softmax_t) / temperature, in logits' dtype.
    out: where to write it (may be `logits` itself: every element is read before
    it is written). A row of -inf only (lse = -inf) gets coef_t at its target and 0
    elsewhere."""
    n, v = logits.shape
    dlogits = torch.empty_like(logits) if out is None else out
    if n == 0:
        return dlogits
    coef = coef.to(torch.float32).contiguous()
    if _use_triton(logits):
        on_gpu = logits.device.type == "cuda"
        config = logprob_configs(v, n, on_gpu)[1]
        _run(_backward_launch(logits, dlogits, targets, lse, coef, temperature, config), logits.device)
        return dlogits
    _cpu_backward(logits, targets, lse, coef, 1.0 / temperature, dlogits)
    return dlogits


# ----------------------------------------------------------------------------- torch CPU path

# Rows per chunk: about 16 Mi float32 values (64 MiB) of scratch, reused across
# chunks: a fresh buffer per chunk costs its page faults every time (a 128 MiB
# copy into new memory runs at about 3 GB/s here, into reused memory far faster).
_CHUNK_ELEMS = 1 << 24


def _row_chunks(n: int, v: int):
    step = max(1, _CHUNK_ELEMS // max(v, 1))
    return [slice(s, min(n, s + step)) for s in range(0, n, step)]


def _scratch(n: int, v: int, device, scratch: torch.Tensor | None) -> torch.Tensor:
    rows = min(n, max(1, _CHUNK_ELEMS // max(v, 1)))
    if scratch is not None and scratch.dtype == torch.float32 and scratch.numel() >= rows * v:
        return scratch.view(-1)[: rows * v].view(rows, v)
    return torch.empty((rows, v), dtype=torch.float32, device=device)


def _cpu_forward(logits, targets, inv_t: float, lse, logp, ent, scratch) -> None:
    """Per chunk: max, exp(x / T - max) into the scratch buffer, sum -> lse; the
    target's log-prob; optionally the entropy."""
    n, v = logits.shape
    buf_all = _scratch(n, v, logits.device, scratch)
    for rows in _row_chunks(n, v):
        x = logits[rows]
        buf = buf_all[: x.shape[0]]
        if x.dtype == torch.float32:
            torch.mul(x, inv_t, out=buf)
        else:  # upcast first: a bf16 tensor times a Python float is computed in bf16
            buf.copy_(x).mul_(inv_t)
        row_max = buf.amax(dim=-1)
        safe_max = torch.where(row_max == float("-inf"), 0.0, row_max)  # rows of -inf only
        buf.sub_(safe_max.unsqueeze(-1)).exp_()
        total = buf.sum(dim=-1)
        chunk_lse = safe_max + total.log()
        lse[rows] = chunk_lse
        valid = targets[rows] != IGNORE_INDEX
        picked = x.gather(-1, targets[rows].clamp(min=0).unsqueeze(-1)).squeeze(-1).to(torch.float32) * inv_t
        logp[rows] = torch.where(valid, picked - chunk_lse, 0.0)
        if ent is not None:  # H = lse - sum(p * x / T); p * x is 0 where p is (x = -inf)
            weighted = torch.where(buf > 0, buf * x.to(torch.float32), 0.0).sum(dim=-1) * inv_t
            ent[rows] = chunk_lse - weighted / total


def _cpu_backward(logits, targets, lse, coef, inv_t: float, dlogits) -> None:
    """Per chunk: exp(x / T - lse) * (-coef / T), plus coef / T at the target,
    written straight into float32 dlogits (through the scratch buffer otherwise)."""
    n, v = logits.shape
    direct = dlogits.dtype == torch.float32
    buf_all = None if direct else _scratch(n, v, logits.device, None)
    # A row of -inf only (lse = -inf): exp(-inf - inf) = 0 rather than exp(-inf + inf) = NaN, as the kernel.
    neg_lse = torch.where(lse == float("-inf"), float("-inf"), -lse)
    for rows in _row_chunks(n, v):
        x = logits[rows]
        out = dlogits[rows] if direct else buf_all[: x.shape[0]]
        torch.add(neg_lse[rows].unsqueeze(-1), x, alpha=inv_t, out=out)
        out.exp_().mul_((-coef[rows] * inv_t).unsqueeze(-1))
        tokens = torch.nonzero(targets[rows] != IGNORE_INDEX).squeeze(-1)
        out[tokens, targets[rows][tokens]] += coef[rows][tokens] * inv_t
        if not direct:
            dlogits[rows] = out


# ----------------------------------------------------------------------------- autograd


def _loss_and_coef(logp, behavior, advantages, old, ref, weights, cfg):
    terms, dterms = token_objective(logp, behavior, advantages, old, ref, cfg)
    active = weights != 0
    loss = torch.where(active, weights * terms, 0.0).sum()
    return loss, torch.where(active, weights * dterms, 0.0)


def token_stats(logp: torch.Tensor, inputs: TokenInputs, cfg: ObjectiveConfig, entropy) -> AIPOStats:
    """Mask-weighted means over the tokens that count, whatever the per-token
    values elsewhere (padding) are. The tokens were sampled from the behaviour
    policy mu, so with r = pi / mu = exp(logp - b), E_mu[r - 1 - log r] =
    KL(mu || pi): the k3 estimator, unbiased and never negative. Likewise
    ref_kl estimates KL(pi || ref), as far as mu is pi."""
    m = inputs.mask
    counted = m != 0
    total = m.sum()
    count = torch.where(total > 0, total, 1.0)

    def mean(per_token: torch.Tensor) -> torch.Tensor:
        return torch.where(counted, per_token * m, 0.0).sum() / count

    log_ratio = (logp - inputs.behavior).clamp(max=MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    clip_fraction = None
    if cfg.loss_type != "aipo":
        unclipped, clipped = ppo_surrogates(logp, inputs.old, inputs.advantages, cfg)
        clip_fraction = mean((clipped < unclipped).to(torch.float32))
    return AIPOStats(
        logprobs=logp.detach().view(inputs.shape),
        mean_ratio=mean(ratio),
        truncated_fraction=mean((ratio > cfg.rho).to(torch.float32)),
        mismatch_kl=mean(ratio - 1 - log_ratio),
        entropy=None if entropy is None else mean(entropy),
        ref_kl=None if inputs.ref is None else mean(reference_kl(logp, inputs.ref)[0]),
        clip_fraction=clip_fraction,
    )


def _outputs(ctx, loss, logp, entropy):
    """(loss, logp, entropy) of a loss Function: only the loss carries a gradient."""
    ctx.mark_non_differentiable(logp)
    if entropy is not None:
        ctx.mark_non_differentiable(entropy)
    return loss, logp, entropy


class AIPOLossFunction(torch.autograd.Function):
    """loss from logits; the backward writes dlogits in one vocabulary pass."""

    @staticmethod
    def forward(ctx, logits, targets, behavior, advantages, old, ref, weights, cfg: ObjectiveConfig,
                with_entropy: bool):
        lse, logp, entropy = logprob_forward(logits, targets, cfg.temperature, with_entropy)
        loss, coef = _loss_and_coef(logp, behavior, advantages, old, ref, weights, cfg)
        ctx.save_for_backward(logits, targets, lse, coef)
        ctx.temperature = cfg.temperature
        return _outputs(ctx, loss, logp, entropy)

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        logits, targets, lse, coef = ctx.saved_tensors
        dlogits = logprob_backward(logits, targets, lse, coef * grad_loss, ctx.temperature)
        return dlogits, None, None, None, None, None, None, None, None


def _accumulate_weight_grad(grad_w: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor, first: bool) -> None:
    """grad_w (float32) += dlogits^T @ h, or = for the first chunk (beta 0: grad_w
    is neither zero-filled nor read, 2 of the 4 GiB a chunk's accumulation moves at
    vocab 128256, hidden 4096). On a GPU with bf16 / fp16 inputs the GEMM runs in
    their dtype (tensor cores) and accumulates in float32 straight into grad_w
    (addmm's out_dtype): upcasting both operands first would run it in float32,
    off the tensor cores. On CPU, and for float32 inputs, in float32."""
    beta = 0.0 if first else 1.0
    if h.device.type == "cuda" and h.dtype != torch.float32:
        torch.addmm(grad_w, dlogits.t(), h, beta=beta, out_dtype=torch.float32, out=grad_w)
    else:
        grad_w.addmm_(dlogits.t().to(torch.float32), h.to(torch.float32), beta=beta)


class LinearAIPOLossFunction(torch.autograd.Function):
    """loss from last hidden states and the lm-head weight, chunked over tokens so
    the full logits never exist. Every objective is per token, so each chunk's
    gradients are computed as soon as its logits are (3 matmuls in all, as the
    naive version does); the backward only scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, behavior, advantages, old, ref, weights, cfg: ObjectiveConfig,
                chunk_size: int, with_entropy: bool):
        n = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = None
        # One chunk: the weight's gradient is that chunk's GEMM, written in the weight's
        # dtype (float32 accumulation inside the GEMM, one rounding: what autograd's
        # naive version computes). Several: accumulated over chunks in float32 whatever
        # the weight's dtype, the first chunk's GEMM overwriting it (no tokens: zeros).
        one_chunk = n <= chunk_size
        if need_w and not one_chunk:
            grad_w = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        elif need_w and n == 0:
            grad_w = torch.zeros_like(weight)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp) if with_entropy else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # Chunk buffers reused for every chunk: the logits (then dlogits, in place) and,
        # on CPU, the softmax scratch.
        logits_buf = torch.empty((min(chunk_size, n), weight.shape[0]), dtype=hidden.dtype, device=hidden.device)
        scratch = _scratch(logits_buf.shape[0], weight.shape[0], hidden.device, None) if hidden.device.type == "cpu" else None
        for start in range(0, n, chunk_size):
            rows = slice(start, min(n, start + chunk_size))
            h = hidden[rows]
            logits = torch.matmul(h, weight.t(), out=logits_buf[: h.shape[0]])
            lse, logp[rows], chunk_entropy = logprob_forward(logits, targets[rows], cfg.temperature, with_entropy,
                                                             scratch)
            if with_entropy:
                entropy[rows] = chunk_entropy
            old_rows = None if old is None else old[rows]
            ref_rows = None if ref is None else ref[rows]
            chunk_loss, coef = _loss_and_coef(logp[rows], behavior[rows], advantages[rows], old_rows, ref_rows,
                                              weights[rows], cfg)
            loss += chunk_loss
            if need_h or need_w:
                dlogits = logprob_backward(logits, targets[rows], lse, coef, cfg.temperature, out=logits)
                if need_h:
                    torch.matmul(dlogits, weight, out=grad_h[rows])
                if need_w and one_chunk:
                    grad_w = torch.matmul(dlogits.t(), h)
                elif need_w:
                    _accumulate_weight_grad(grad_w, dlogits, h, first=start == 0)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return _outputs(ctx, loss, logp, entropy)

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        grad_h, grad_w = ctx.saved_tensors
        # float32 weights: scaled in place, as a second vocab x hidden float32 buffer
        # would double the peak (2 GiB at vocab 128256, hidden 4096); the buffers are
        # this call's own. Others: scaled and cast in one pass into the weight's
        # dtype (read 4 + write 2 bytes an element; scaling in place first read and
        # wrote the float32 buffer once more).
        # In place by the float32 0-dim grad_loss: computed in float32 and rounded once
        # into a bf16 buffer (grad_loss cast to bf16 first would round 1/3 to 0.33398).
        dh = None if grad_h is None else grad_h.mul_(grad_loss)
        dw = grad_w
        if grad_w is not None and grad_w.dtype == ctx.weight_dtype:  # one chunk, or float32 weights
            dw = grad_w.mul_(grad_loss)
        elif grad_w is not None:
            dw = torch.mul(grad_w, grad_loss, out=torch.empty_like(grad_w, dtype=ctx.weight_dtype))
        return dh, dw, None, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------- functional


def aipo_loss(logits, targets, behavior_logprobs, advantages, mask=None, *, rho=4.0, temperature=1.0,
              reduction="token_mean", sequence_ids=None, loss_type="aipo", old_logprobs=None, eps_low=0.2,
              eps_high=0.2, entropy=False, ref_logprobs=None, kl_coef=0.0):
    """AIPO (or PPO-clip, PPO-clip + truncated IS) loss from logits.

    logits: (num_tokens, vocab), or batched (B, T, vocab) (any (..., T, vocab)),
    bf16 / fp16 / fp32; gradients flow to logits only. targets: int, the logits'
    leading shape; IGNORE_INDEX (-100) or mask 0 to leave a token out (its
    target then any integer, never read: log-prob 0, no loss, dlogits exactly 0
    where its logits are finite or -inf); a counted target outside [0, vocab)
    raises ValueError naming its position. behavior_logprobs, mask,
    old_logprobs, ref_logprobs, sequence_ids: per token, in the targets' shape.
    advantages: per token, or batched one per row, (B,) or (B, 1). `-inf` logits
    (masked vocabulary) are allowed. reduction="sequence_mean": flat inputs need
    sequence_ids; batched ones without sequence_ids have one sequence a row,
    with (B, T) sequence_ids (packed rows) a sequence is one row's tokens of one
    id (aipo_inputs.py has the rules). ref_logprobs, kl_coef: the reference
    policy's log-probs of the targets (at the same temperature) and the weight
    of the k3 KL penalty (module docstring); kl_coef > 0 needs ref_logprobs.
    Returns (loss, AIPOStats), stats.logprobs in the targets' shape,
    stats.clip_fraction for "ppo" / "ppo_tis" (None for "aipo").

    On a GPU, forward and backward synchronize the host once, to raise the bad
    target's ValueError (see aipo_inputs.TargetCheck), after the forward's
    kernels are queued; reduction="sequence_mean" with sequence_ids adds
    torch.unique's own (batched rows without sequence_ids need none).
    """
    cfg = ObjectiveConfig(loss_type, rho, eps_low, eps_high, temperature, kl_coef)
    flat = flat_logits(logits)
    inputs = prepare_inputs(logits.shape[:-1], logits.shape[-1], flat.device, targets, behavior_logprobs, advantages,
                            mask, old_logprobs, ref_logprobs, sequence_ids, cfg, reduction)
    loss, logp, ent = AIPOLossFunction.apply(flat, inputs.targets, inputs.behavior, inputs.advantages, inputs.old,
                                             inputs.ref, inputs.weights, cfg, entropy)
    inputs.check.wait()
    return loss, token_stats(logp, inputs, cfg, ent)


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = False,
                     eps: float = 1e-6) -> torch.Tensor:
    """A = r - mean(r over the samples of the same prompt) (AIPO); with
    normalize_std, divided by the group's std + eps (GRPO). rewards, group_ids: (num_samples,)."""
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards and group_ids must be 1-D of one shape, got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    _, index = torch.unique(group_ids, return_inverse=True)
    groups = int(index.max()) + 1 if index.numel() else 0
    r = rewards.to(torch.float32)
    counts = torch.zeros(groups, device=r.device).index_add_(0, index, torch.ones_like(r))
    means = torch.zeros(groups, device=r.device).index_add_(0, index, r) / counts
    centered = r - means[index]
    if not normalize_std:
        return centered
    var = torch.zeros(groups, device=r.device).index_add_(0, index, centered**2) / (counts - 1).clamp(min=1)
    return centered / (var.sqrt()[index] + eps)


# Tokens per chunk of linear_aipo_loss. On a GPU by bytes of logits in their
# dtype: a batch of one chunk writes the weight gradient straight from its GEMM;
# with several, a float32 accumulator is written, read and rewritten chunk after
# chunk and cast at the end (on an H100, 4096 tokens at vocab 128256, hidden 4096,
# bf16: 1.30x of the three GEMMs alone in 512 MiB chunks, 1.35x in one 1 GiB chunk
# through the accumulator), and each chunk runs about 20 small launches for the
# objective. 1 GiB is 4096 tokens at vocab 128256 in bf16, one micro-batch of a
# typical trainer. On CPU about 32 Mi logits (256 tokens at vocab 128256), beside
# the 64 MiB scratch.
_LINEAR_CHUNK_BYTES_GPU = 1 << 30
_LINEAR_CHUNK_ELEMS_CPU = 1 << 25


def _linear_chunk_tokens(vocab: int, dtype: torch.dtype, device: torch.device) -> int:
    if device.type == "cuda":
        return max(1, _LINEAR_CHUNK_BYTES_GPU // max(vocab * dtype.itemsize, 1))
    return max(1, _LINEAR_CHUNK_ELEMS_CPU // max(vocab, 1))


def linear_aipo_loss(hidden, weight, targets, behavior_logprobs, advantages, mask=None, *, rho=4.0, temperature=1.0,
                     reduction="token_mean", sequence_ids=None, loss_type="aipo", old_logprobs=None, eps_low=0.2,
                     eps_high=0.2, entropy=False, chunk_size=None, ref_logprobs=None, kl_coef=0.0):
    """`aipo_loss` of `hidden @ weight.T`, without ever holding the full logits.

    hidden: (num_tokens, hidden), or batched (B, T, hidden) (any (..., T,
    hidden)); weight: (vocab, hidden), the lm-head; gradients flow to both. The
    other inputs as aipo_loss's, in hidden's leading shape. chunk_size: tokens
    per chunk (default: about 1 GiB of logits in their dtype on a GPU, 32 Mi
    logits on CPU); one chunk's logits buffer and, when there are several
    chunks, a vocab x hidden float32 accumulator for the weight's gradient are
    the memory it holds beyond its inputs and outputs. Runs on CPU (torch per
    chunk) and on GPU (Triton log-prob kernels per chunk). Returns (loss,
    AIPOStats) as aipo_loss does. Host syncs as aipo_loss's.
    """
    if hidden.dim() < 2 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden (..., H) and weight (vocab, H) do not match: {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight dtypes differ: {hidden.dtype} and {weight.dtype}")
    vocab = weight.shape[0]
    cfg = ObjectiveConfig(loss_type, rho, eps_low, eps_high, temperature, kl_coef)
    inputs = prepare_inputs(hidden.shape[:-1], vocab, hidden.device, targets, behavior_logprobs, advantages, mask,
                            old_logprobs, ref_logprobs, sequence_ids, cfg, reduction)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if chunk_size is None:
        chunk_size = _linear_chunk_tokens(vocab, hidden.dtype, hidden.device)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    loss, logp, ent = LinearAIPOLossFunction.apply(flat, weight, inputs.targets, inputs.behavior, inputs.advantages,
                                                   inputs.old, inputs.ref, inputs.weights, cfg, chunk_size, entropy)
    inputs.check.wait()
    return loss, token_stats(logp, inputs, cfg, ent)
