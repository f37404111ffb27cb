"""The policy loss's objective in one kernel (kernels/objective.py) on the fused
log-prob op's outputs: the loss, its gradient in the log-probs and entropies,
and every AIPOStats figure from one pass over the tokens, where the torch path
(ops/objectives.py: objective_terms, objective_stats) issues some ninety small
ops, each a kernel launch on a GPU that idles while the host issues them (an
H200 ran aipo_loss at 0.18x of its bytes' copy time, host-bound). Same
functions, same conventions (ops/objectives.py's docstring); aipo.py picks the
kernel for CUDA tensors, the torch path elsewhere (fused_objective_runs).

Launches on a GPU: the kernel, a sum and a max over its programs' partial rows,
a few element-wise ops for the statistics; before it, for the sequence-level
objectives, each sequence's sums (index_add) gathered per token; after it, for
gspo, the gradient spread over each sequence's tokens. No host sync.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ._launch import KernelLaunch
from .aipo_inputs import TokenInputs
from .objectives import (CLIP_TYPES, LOSS_TYPES, MASKING_TYPES, MAX_LOG_RATIO, SEQUENCE_TYPES, TRUNCATING_TYPES,
                         VESPO_LOG_W, VESPO_TOKEN_LOG_RATIO, AIPOStats, Objective)

BLOCK, NUM_WARPS = 512, 4  # 4 tokens a thread: at most 64 registers (sm_80-100; 1024 tokens took up to 128)
PARTIAL = 16  # floats a program writes (kernels/objective.py)
# The partial row's slots: the loss, then what AIPOStats reads.
LOSS, COUNT, R, R2, K3, K1, ABS_LOG_R, MAX_ABS_LOG_R, TRUNCATED, CLIPPED, MASKED, ENTROPY, REF_K3 = range(13)


def _programs(n: int) -> int:
    """The kernel's programs (partial rows) for n tokens: one at least, so that the sums exist."""
    return max(1, -(-n // BLOCK))


def _flags_tokens(kind: str) -> bool:
    """Whether the objective truncates or masks tokens (the per-sequence fractions count them)."""
    return kind in TRUNCATING_TYPES or kind in MASKING_TYPES


def _kernel():
    from llamarl_core.kernels.objective import objective_kernel

    return objective_kernel


def fused_objective_runs(logp: torch.Tensor) -> bool:
    """Whether aipo_loss takes the kernel: on a GPU. On CPU the torch path is the
    faster (in Triton's interpreter the kernel adds some 20 ms a call), and
    tests/test_objective_kernel.py runs the kernel there beside it."""
    return logp.device.type == "cuda"


def _sequence_values(logp: torch.Tensor, inputs: TokenInputs, cfg: Objective, on: torch.Tensor,
                     counts: torch.Tensor | None) -> torch.Tensor | None:
    """Each token's per-sequence input of the kernel for the sequence-level
    objectives (None for the others), from the counted tokens `on` (float) and
    each sequence's count of them. Detached."""
    kind, seqs = cfg.loss_type, inputs.sequences
    if kind not in SEQUENCE_TYPES:
        return None
    logp = logp.detach()
    if kind == "gspo":
        old = logp if inputs.old is None else inputs.old
        return (seqs.sum((logp - old) * on) / counts.clamp(min=1.0))[seqs.index]
    log_r = logp - (logp if inputs.behavior is None else inputs.behavior)
    if kind == "vespo":
        return seqs.sum(log_r.clamp(-VESPO_TOKEN_LOG_RATIO, VESPO_TOKEN_LOG_RATIO) * on)[seqs.index]
    s = seqs.sum(log_r * on)
    return (s / counts.clamp(min=1.0) if kind == "geo_mask" else s)[seqs.index]


# The objective's scalars, in the kernel's order (a parameter it does not read is 0).
PARAMETERS = ("rho", "eps_low", "eps_high", "mask_low", "mask_high", "tau_pos", "tau_neg", "k_pos", "lambda_pos",
              "k_neg", "lambda_neg", "kl_coef", "entropy_coef")


def kernel_parameters(cfg: Objective) -> list[float]:
    """cfg's scalars in PARAMETERS' order, 0.0 for one its objective does not read."""
    return [0.0 if getattr(cfg, name) is None else float(getattr(cfg, name)) for name in PARAMETERS]


def objective_launch(logp, entropy, behavior, old, ref, advantages, weights, mask, seq, dlogp, dentropy, dseq,
                     flags, partial, kind: int, parameters: list[float]) -> KernelLaunch:
    """The kernel's launch over flat float32 (n,) tensors, objective LOSS_TYPES[kind]
    with `parameters` (kernel_parameters); entropy, behavior, old, ref, seq,
    dentropy, dseq (gspo's) and flags may be None (logp stands in, never read or
    written); partial: (programs, PARTIAL) float32."""
    n = logp.numel()
    spare = logp  # a valid pointer for an input that is not there
    args = dict(logp_ptr=logp, entropy_ptr=spare if entropy is None else entropy,
                behavior_ptr=spare if behavior is None else behavior, old_ptr=spare if old is None else old,
                ref_ptr=spare if ref is None else ref, adv_ptr=advantages, weight_ptr=weights, mask_ptr=mask,
                seq_ptr=spare if seq is None else seq, dlogp_ptr=dlogp,
                dentropy_ptr=dlogp if dentropy is None else dentropy, dseq_ptr=dlogp if dseq is None else dseq,
                flags_ptr=spare if flags is None else flags, partial_ptr=partial, n=n,
                has_entropy=int(entropy is not None), has_behavior=int(behavior is not None),
                has_old=int(old is not None), has_ref=int(ref is not None), **dict(zip(PARAMETERS, parameters)),
                max_log_ratio=MAX_LOG_RATIO, vespo_low=VESPO_LOG_W[0], vespo_high=VESPO_LOG_W[1])
    constexprs = dict(KIND=kind, WRITE_FLAGS=flags is not None, BLOCK=BLOCK)
    return KernelLaunch(_kernel(), (partial.shape[0],), args, constexprs, NUM_WARPS)


@torch.library.custom_op("llamarl::objective", mutates_args=())
def _objective_op(logp: torch.Tensor, entropy: torch.Tensor | None, behavior: torch.Tensor | None,
                  old: torch.Tensor | None, ref: torch.Tensor | None, advantages: torch.Tensor, weights: torch.Tensor,
                  mask: torch.Tensor, seq: torch.Tensor | None, kind: int, parameters: list[float],
                  sequence_flags: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dlogp, dentropy, dseq, flags, partial) of the kernel (module docstring);
    dentropy empty without an entropy, dseq without gspo, flags without
    sequence_flags. Every tensor float32 of logp's shape and device (ValueError
    naming the one that is not). A custom op: torch.compile keeps it whole; it
    makes no host sync."""
    from .logprob_launch import _run

    named = dict(logp=logp, entropy=entropy, behavior=behavior, old=old, ref=ref, advantages=advantages,
                 weights=weights, mask=mask, seq=seq)
    for name, t in named.items():  # the kernel reads float32 at unit stride, on logp's device
        if t is not None and (t.dtype != torch.float32 or t.device != logp.device or t.shape != logp.shape):
            raise ValueError(f"llamarl::objective: {name} must be float32 of shape {tuple(logp.shape)} on "
                             f"{logp.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    logp, entropy, behavior, old, ref, advantages, weights, mask, seq = (
        None if t is None else t.contiguous() for t in named.values())
    n, device, gspo = logp.numel(), logp.device, kind == LOSS_TYPES.index("gspo")
    dlogp = torch.empty(n, dtype=torch.float32, device=device)
    dentropy = torch.empty(n if entropy is not None else 0, dtype=torch.float32, device=device)
    dseq = torch.empty(n if gspo else 0, dtype=torch.float32, device=device)
    flags = torch.empty(n if sequence_flags else 0, dtype=torch.int8, device=device)
    partial = torch.empty((_programs(n), PARTIAL), dtype=torch.float32, device=device)
    _run(objective_launch(logp, entropy, behavior, old, ref, advantages, weights, mask, seq, dlogp,
                          dentropy if entropy is not None else None, dseq if gspo else None,
                          flags if sequence_flags else None, partial, kind, parameters), device)
    return dlogp, dentropy, dseq, flags, partial


@_objective_op.register_fake
def _(logp, entropy, behavior, old, ref, advantages, weights, mask, seq, kind, parameters, sequence_flags):
    n = logp.numel()

    def new(*shape, dtype=torch.float32):
        return logp.new_empty(shape, dtype=dtype)

    return (new(n), new(n if entropy is not None else 0), new(n if kind == LOSS_TYPES.index("gspo") else 0),
            new(n if sequence_flags else 0, dtype=torch.int8), new(_programs(n), PARTIAL))


def kernel_variants() -> list[tuple[str, KernelLaunch]]:
    """Every variant a GPU compiles: one per objective (the optional inputs are
    run-time flags) with the per-sequence flags (whenever the tokens have
    sequences) and, for the token-level objectives, one without."""
    from .objectives import SEQUENCE_TYPES

    n = 4
    flat = [torch.empty(n, dtype=torch.float32) for _ in range(12)]
    partial = torch.empty((1, PARTIAL), dtype=torch.float32)
    variants = []
    for loss_type in LOSS_TYPES:
        for with_flags in (True,) if loss_type in SEQUENCE_TYPES else (False, True):
            flags = torch.empty(n, dtype=torch.int8) if with_flags else None
            dseq = flat[11] if loss_type == "gspo" else None
            launch = objective_launch(*flat[:11], dseq, flags, partial, LOSS_TYPES.index(loss_type),
                                      kernel_parameters(Objective(loss_type)))
            variants.append((f"objective {loss_type}{', sequence flags' if with_flags else ''}", launch))
    return variants


class _Linearized(torch.autograd.Function):
    """The loss's value, with its gradient in the log-probs and entropies given
    (the kernel's): backward is grad * dlogp, grad * dentropy, once (a second
    derivative through it raises: the kernel gives none)."""

    @staticmethod
    def forward(ctx, value, logp, entropy, dlogp, dentropy):
        ctx.save_for_backward(dlogp, dentropy)
        ctx.has_entropy = entropy.numel() > 0
        return value.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        dlogp, dentropy = ctx.saved_tensors
        return None, grad * dlogp, grad * dentropy if ctx.has_entropy else None, None, None


def fused_policy_loss(logp: torch.Tensor, entropy: torch.Tensor | None, inputs: TokenInputs,
                      cfg: Objective) -> tuple[torch.Tensor, AIPOStats]:
    """(loss, stats) of cfg's objective on the fused op's per-token outputs (in
    the targets' shape), differentiable in both, by the objective kernel."""
    flat = logp.reshape(-1)
    flat_entropy = None if entropy is None else entropy.reshape(-1)
    sequences = inputs.sequences
    kind = cfg.loss_type
    on = inputs.counted.to(torch.float32)
    # each sequence's counted tokens, where read: gspo's and geo_mask's means, the per-sequence fractions
    # (geo_mask truncates and masks)
    counts = sequences.sum(on) if sequences is not None and (kind == "gspo" or _flags_tokens(kind)) else None
    seq = _sequence_values(flat, inputs, cfg, on, counts)
    dlogp, dentropy, dseq, flags, partial = _objective_op(
        flat.detach(), None if flat_entropy is None else flat_entropy.detach(), inputs.behavior, inputs.old,
        inputs.ref, inputs.advantages, inputs.weights, inputs.mask, seq, LOSS_TYPES.index(kind),
        kernel_parameters(cfg), sequences is not None)
    if kind == "gspo":  # each sequence's d(loss)/d(its mean log-ratio), spread over its counted tokens
        dlogp = dlogp + (sequences.sum(dseq) / counts.clamp(min=1.0))[sequences.index] * on
    sums = partial.sum(0)
    bonus = flat_entropy is not None and cfg.entropy_coef > 0  # the loss depends on the entropy
    loss = _Linearized.apply(sums[LOSS], flat, flat_entropy if bonus else flat.new_empty(0), dlogp,
                             dentropy if bonus else flat.new_empty(0))
    return loss, _stats(flat, entropy, inputs, cfg, sums, partial[:, MAX_ABS_LOG_R].amax(),
                        flags if sequences is not None else None, counts)


def _stats(flat: torch.Tensor, entropy, inputs: TokenInputs, cfg: Objective, sums: torch.Tensor,
           max_abs_log_r: torch.Tensor, flags: torch.Tensor | None, counts: torch.Tensor | None) -> AIPOStats:
    """AIPOStats from the kernel's sums, as objective_stats defines them; counts:
    each sequence's counted tokens (None: no sequences, or an objective that
    flags no token)."""
    total = sums[COUNT]
    count = torch.where(total > 0, total, 1.0)
    means = sums / count
    zero = torch.zeros((), device=flat.device)
    kind = cfg.loss_type

    # the sequences with a counted token
    with_tokens = (counts > 0).sum().clamp(min=1) if counts is not None and _flags_tokens(kind) else None

    def sequence_fraction(bit: int, present: bool) -> torch.Tensor | None:
        if inputs.sequences is None:
            return None
        if not present:
            return zero
        hit = inputs.sequences.sum(((flags & bit) != 0).to(torch.float32)) > 0
        return hit.sum() / with_tokens

    return AIPOStats(
        logprobs=flat.detach().view(inputs.shape),
        mean_ratio=means[R],
        truncated_fraction=means[TRUNCATED] if kind in TRUNCATING_TYPES else zero,
        mismatch_kl=means[K3],
        entropy=None if entropy is None else means[ENTROPY],
        ref_kl=None if inputs.ref is None else means[REF_K3],
        clip_fraction=means[CLIPPED] if kind in CLIP_TYPES else None,
        mismatch_k1=means[K1],
        chi_squared=torch.where(total > 0, means[R2] - 1, 0.0),
        ess_fraction=torch.where(sums[R2] > 0, sums[R] ** 2 / (count * sums[R2]), 0.0),
        mean_abs_log_ratio=means[ABS_LOG_R],
        max_abs_log_ratio=max_abs_log_r,
        masked_fraction=means[MASKED] if kind in MASKING_TYPES else None,
        sequence_truncated_fraction=sequence_fraction(1, kind in TRUNCATING_TYPES),
        sequence_masked_fraction=sequence_fraction(2, kind in MASKING_TYPES),
    )
