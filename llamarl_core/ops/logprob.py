"""The fused log-prob op: per-token log-probabilities, and if asked entropies,
from logits or from last hidden states and the lm-head, forward and backward,
on one GPU or with the vocabulary sharded over a process group.

For token t with logits x_t (vocab,), temperature T and target y_t:
    z = x_t / T,  lse_t = logsumexp(z),  logp_t = z[y_t] - lse_t,
    H_t = -sum_j p_j log p_j  (p = softmax(z)).
logp_t is 0 where y_t is IGNORE_INDEX (-100). The backward takes any dL/dlogp_t
and dL/dH_t and writes dlogits in one vocabulary pass (kernels/logprob.py):
    dL/dx_tj = (dL/dlogp_t (1[j = y_t] - p_j) - dL/dH_t p_j (log p_j + H_t)) / T.
Beyond its inputs the op keeps O(tokens) floats (lse_t, and H_t with the
entropy); the linear form holds one chunk of logits at a time and recomputes it
in the backward (four GEMMs in all), never the full logits. Every objective of
ops/aipo.py runs on these per-token vectors: in one kernel on a GPU
(ops/objective_launch.py), in torch elsewhere.

No host synchronisation in forward or backward: the kernels run behind
torch.library custom ops (llamarl::logprob_fwd, llamarl::logprob_bwd), so the
logits form traces whole under torch.compile and captures into CUDA graphs.
The functional API's target check (aipo_inputs.TargetCheck) waits once, after
the kernels are queued, so that a target outside the vocabulary raises a
ValueError naming its position: in eager mode on a GPU the op's one host sync
(with process_group, the shard sizes' check is read in it too). Under
torch.compile or graph capture it is skipped, and such a target gets a NaN
log-prob instead.

Vocabulary-parallel (process_group=): rank r of the group holds the columns
[r * V, (r + 1) * V) of the logits (or rows of the lm-head), V the same on
every rank (Megatron pads the vocabulary to a multiple of the group's size);
targets are global ids. The forward reduces each token's max and three sums
over the group (two all-reduces of O(tokens) floats); the backward needs none
for the logits and one all-reduce of the hidden states' gradient for the linear
form (the lm-head's input is replicated).

File order: reference -> custom ops (launchers and the CPU path:
ops/logprob_launch.py) -> vocabulary shards -> autograd -> functional.
"""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from .aipo_inputs import IGNORE_INDEX, TargetCheck, check_shard_sizes, check_target_ids, flat_logits
from .logprob_launch import logprob_backward, logprob_forward

# ----------------------------------------------------------------------------- reference


def token_logprobs_ref(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                       compute_dtype: torch.dtype | None = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) in the targets' shape by plain torch (log_softmax, gather),
    differentiable through autograd, in float64 by default (None: the logits'
    dtype, the naive version users write). logp is 0 where the target is
    IGNORE_INDEX."""
    dtype = logits.dtype if compute_dtype is None else compute_dtype
    logp_all = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    valid = targets != IGNORE_INDEX
    picked = logp_all.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    # log p replaced by 0 where p = 0 (x = -inf), before the product: 0 * -inf would
    # make the value and, through torch.where's other branch, the gradient NaN.
    entropy = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)
    return torch.where(valid, picked, 0.0), entropy


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("llamarl::logprob_fwd", mutates_args=())
def _logprob_fwd_op(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                    entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, logp, entropy) of logprob_forward; the entropy an empty tensor when not asked for."""
    lse, logp, ent = logprob_forward(logits, targets, temperature, entropy)
    return lse, logp, ent if ent is not None else lse.new_empty(0)


@_logprob_fwd_op.register_fake
def _(logits, targets, temperature, entropy):
    n = logits.shape[0]
    out = logits.new_empty(n, dtype=torch.float32)
    return out, torch.empty_like(out), logits.new_empty(n if entropy else 0, dtype=torch.float32)


@torch.library.custom_op("llamarl::logprob_bwd", mutates_args=())
def _logprob_bwd_op(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor,
                    entropy: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                    temperature: float) -> torch.Tensor:
    """logprob_backward into a new tensor."""
    return logprob_backward(logits, targets, lse, coef, temperature, None, entropy, grad_entropy)


@_logprob_bwd_op.register_fake
def _(logits, targets, lse, coef, entropy, grad_entropy, temperature):
    return torch.empty_like(logits)


# ----------------------------------------------------------------------------- vocabulary shards


def check_equal_shards(local_vocab: int, group, device: torch.device) -> torch.Tensor | None:
    """Whether the group's ranks all hold local_vocab columns: an all-gather of
    one integer, every call (a cache could differ between ranks and leave one
    waiting in the gather). On the CPU (gloo) checked here, before any kernel:
    ValueError on every rank (each sees the same sizes: no rank is left
    waiting). On a GPU the gathered sizes, (world,) on the device, are returned
    for the target check to read in its one host sync (aipo_inputs.TargetCheck):
    no sync of its own. None without a group, and under torch.compile and CUDA
    graph capture (skipped)."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if group is None or capturing or torch.compiler.is_compiling():
        return None
    size = torch.tensor([local_vocab], dtype=torch.int64,
                        device=device if dist.get_backend(group) != "gloo" else "cpu")
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    if size.device.type == "cuda":
        return torch.cat(sizes)
    check_shard_sizes(torch.cat(sizes).tolist())
    return None


def vocab_shard(local_vocab: int, group) -> tuple[int, int]:
    """(first column of this rank's shard, the whole vocabulary) of a group whose
    ranks hold local_vocab columns each (check_equal_shards); (0, local_vocab)
    without a group."""
    if group is None:
        return 0, local_vocab
    return dist.get_rank(group) * local_vocab, dist.get_world_size(group) * local_vocab


def _local_targets(targets: torch.Tensor, start: int, local_vocab: int) -> torch.Tensor:
    """Global target ids as this shard's columns; IGNORE_INDEX for a target in
    another shard (and for an ignored one)."""
    local = targets - start
    return torch.where((targets != IGNORE_INDEX) & (local >= 0) & (local < local_vocab), local, IGNORE_INDEX)


def _target_logit(logits: torch.Tensor, local: torch.Tensor, inv_t: float) -> torch.Tensor:
    """z = x[y] / T of each row whose target is in this shard, 0 elsewhere."""
    in_shard = local != IGNORE_INDEX
    picked = logits.gather(1, torch.where(in_shard, local, 0).unsqueeze(1)).squeeze(1).to(torch.float32)
    return torch.where(in_shard, picked * inv_t, 0.0)


def _combine_shards(lse: torch.Tensor, target_logit: torch.Tensor, ent: torch.Tensor | None, targets: torch.Tensor,
                    vocab: int, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each shard's (lse_r, z[y] or 0, H_r of its own softmax) -> the whole
    vocabulary's (lse, logp, H): lse = M + log sum_r exp(lse_r - M), M the max
    of the lse_r; logp = z[y] - lse; H = lse - sum_r w_r (lse_r - H_r) with w_r
    = exp(lse_r - lse) (the shard's share of the probability; lse_r - H_r is
    E[z] under the shard's own softmax). A target outside [0, vocab) gets NaN."""
    peak = lse.clone()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    peak = torch.where(peak == float("-inf"), 0.0, peak)  # rows of -inf only: lse stays -inf
    share = torch.exp(lse - peak)
    parts = [share, target_logit]
    if ent is not None:  # a shard of -inf only has share 0 and H_r NaN: it adds 0
        parts.append(torch.where(share > 0, share * (lse - ent), 0.0))
    sums = torch.stack(parts)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    total_lse = peak + sums[0].log()
    valid = targets != IGNORE_INDEX
    bad = valid & ((targets < 0) | (targets >= vocab))
    logp = torch.where(valid, torch.where(bad, float("nan"), (sums[1] - total_lse).clamp(max=0.0)), 0.0)
    total_ent = None if ent is None else total_lse - sums[2] / sums[0]
    return total_lse, logp, total_ent


# ----------------------------------------------------------------------------- autograd


def _grads_in(valid: torch.Tensor, grad_logp, grad_ent):
    """(coef, grad_entropy or None) for the backward: dL/dlogp is 0 for ignored
    tokens (their log-prob is the constant 0); None gradients (outputs unused) as
    zeros or left out."""
    coef = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device) if grad_logp is None else \
        torch.where(valid, grad_logp.reshape(-1).to(torch.float32), 0.0)
    return coef, None if grad_ent is None or grad_ent.numel() == 0 else grad_ent.reshape(-1)


class TokenLogprobsFunction(torch.autograd.Function):
    """(logp, entropy or an empty tensor) from 2-D logits (rows, local vocab) and
    flat int64 global targets; group: the vocabulary's process group or None."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, with_entropy: bool, group):
        start, vocab = vocab_shard(logits.shape[1], group)
        local = targets if group is None else _local_targets(targets, start, logits.shape[1])
        lse, logp, ent = torch.ops.llamarl.logprob_fwd(logits, local, temperature, with_entropy)
        if group is not None:
            lse, logp, total_ent = _combine_shards(lse, _target_logit(logits, local, 1.0 / temperature),
                                                   ent if with_entropy else None, targets, vocab, group)
            ent = total_ent if with_entropy else ent
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, local, targets != IGNORE_INDEX, lse, ent)
        ctx.temperature, ctx.with_entropy = temperature, with_entropy
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        logits, local, valid, lse, ent = ctx.saved_tensors
        coef, grad_h = _grads_in(valid, grad_logp, grad_ent)
        dlogits = torch.ops.llamarl.logprob_bwd(logits, local, lse, coef, ent if grad_h is not None else None, grad_h,
                                                ctx.temperature)
        return dlogits, None, None, None, None


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


def _chunks(n: int, chunk_size: int) -> list[slice]:
    return [slice(start, min(n, start + chunk_size)) for start in range(0, n, chunk_size)]


class _LinearGrads:
    """The linear form's gradients of hidden (h) and weight (w), filled chunk by
    chunk from each chunk's dlogits. w with one chunk: that chunk's GEMM in the
    weight's dtype (float32 accumulation inside the GEMM, one rounding: what
    autograd's naive version computes); with several: accumulated in float32,
    the first chunk's GEMM overwriting it; with none (no tokens): zeros."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, need_h: bool, need_w: bool, num_chunks: int):
        self.weight, self.need_w, self.one_chunk = weight, need_w, num_chunks == 1
        self.h = torch.empty_like(hidden) if need_h else None
        self.w = None
        if need_w and num_chunks > 1:
            self.w = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        elif need_w and num_chunks == 0:
            self.w = torch.zeros_like(weight)

    def add(self, index: int, rows: slice, dlogits: torch.Tensor, h: torch.Tensor) -> None:
        """Chunk `index` (tokens `rows`, hidden states h) with its dlogits."""
        if self.h is not None:
            torch.matmul(dlogits, self.weight, out=self.h[rows])
        if self.need_w and self.one_chunk:
            self.w = torch.matmul(dlogits.t(), h)
        elif self.need_w:
            _accumulate_weight_grad(self.w, dlogits, h, first=index == 0)


class LinearTokenLogprobsFunction(torch.autograd.Function):
    """(logp, entropy or an empty tensor) of hidden @ weight.T, chunk_size tokens
    at a time: one chunk's logits exist at once, in the forward and again in the
    backward (recomputed, then turned into dlogits in place)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, with_entropy: bool, chunk_size: int, group):
        n, local_vocab = hidden.shape[0], weight.shape[0]
        start, vocab = vocab_shard(local_vocab, group)
        local = targets if group is None else _local_targets(targets, start, local_vocab)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        logp, target_logit = torch.empty_like(lse), torch.empty_like(lse)
        ent = torch.empty_like(lse) if with_entropy else lse.new_empty(0)
        logits_buf = torch.empty((min(chunk_size, n), local_vocab), dtype=hidden.dtype, device=hidden.device)
        for rows in _chunks(n, chunk_size):
            logits = torch.matmul(hidden[rows], weight.t(), out=logits_buf[: rows.stop - rows.start])
            lse[rows], logp[rows], chunk_ent = torch.ops.llamarl.logprob_fwd(logits, local[rows], temperature,
                                                                             with_entropy)
            if with_entropy:
                ent[rows] = chunk_ent
            if group is not None:
                target_logit[rows] = _target_logit(logits, local[rows], 1.0 / temperature)
        if group is not None:
            lse, logp, total_ent = _combine_shards(lse, target_logit, ent if with_entropy else None, targets, vocab,
                                                   group)
            ent = total_ent if with_entropy else ent
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, local, targets != IGNORE_INDEX, lse, ent)
        ctx.temperature, ctx.chunk_size, ctx.group = temperature, chunk_size, group
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, local, valid, lse, ent = ctx.saved_tensors
        coef, grad_entropy = _grads_in(valid, grad_logp, grad_ent)
        n = hidden.shape[0]
        chunks = _chunks(n, ctx.chunk_size)
        grads = _LinearGrads(hidden, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1], len(chunks))
        logits_buf = torch.empty((min(ctx.chunk_size, n), weight.shape[0]), dtype=hidden.dtype, device=hidden.device)
        for index, rows in enumerate(chunks):
            h = hidden[rows]
            logits = torch.matmul(h, weight.t(), out=logits_buf[: rows.stop - rows.start])
            dlogits = logprob_backward(logits, local[rows], lse[rows], coef[rows], ctx.temperature, out=logits,
                                       entropy=None if grad_entropy is None else ent[rows],
                                       grad_entropy=None if grad_entropy is None else grad_entropy[rows])
            grads.add(index, rows, dlogits, h)
        if grads.h is not None and ctx.group is not None:  # the replicated input's gradient: every shard's part
            dist.all_reduce(grads.h, op=dist.ReduceOp.SUM, group=ctx.group)
        grad_w = grads.w if grads.w is None or grads.w.dtype == weight.dtype else grads.w.to(weight.dtype)
        return grads.h, grad_w, None, None, None, None, None


class LinearChunkLossFunction(torch.autograd.Function):
    """The linear form for a loss whose gradient each chunk knows from its own
    tokens (a token-local objective with fixed per-token weights): per chunk, the
    logits, the log-probs, chunk_loss(rows, logp, entropy) and its gradient by
    autograd on those O(chunk) vectors, dlogits in place, and the gradients of
    hidden and weight, all in the forward (three GEMMs, not the generic op's
    four: the logits are never recomputed); the backward scales them by the
    incoming gradient. Returns (loss, logp, entropy or an empty tensor), the
    last two without gradient. No vocabulary group (the shards' log-sum-exps
    are known only after every chunk)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, with_entropy: bool, chunk_size: int, chunk_loss):
        n = hidden.shape[0]
        chunks = _chunks(n, chunk_size)
        grads = _LinearGrads(hidden, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1], len(chunks))
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        logits_buf = torch.empty((min(chunk_size, n), weight.shape[0]), dtype=hidden.dtype, device=hidden.device)
        for index, rows in enumerate(chunks):
            h = hidden[rows]
            logits = torch.matmul(h, weight.t(), out=logits_buf[: rows.stop - rows.start])
            lse, chunk_logp, chunk_ent = logprob_forward(logits, targets[rows], temperature, with_entropy)
            logp[rows] = chunk_logp
            if with_entropy:
                ent[rows] = chunk_ent
            with torch.enable_grad():
                leaves = [chunk_logp.requires_grad_()] + ([chunk_ent.requires_grad_()] if with_entropy else [])
                value = chunk_loss(rows, chunk_logp, chunk_ent)
                dvalue = torch.autograd.grad(value, leaves, allow_unused=True) if value.requires_grad else [None] * 2
            loss += value.detach()
            coef, grad_entropy = _grads_in(targets[rows] != IGNORE_INDEX, dvalue[0],
                                           dvalue[1] if with_entropy else None)
            if grads.h is not None or grads.need_w:
                dlogits = logprob_backward(logits, targets[rows], lse, coef, temperature, out=logits,
                                           entropy=chunk_ent.detach() if grad_entropy is not None else None,
                                           grad_entropy=grad_entropy)
                grads.add(index, rows, dlogits, h)
        ctx.save_for_backward(grads.h, grads.w)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(logp, ent)
        return loss, logp, ent

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        grad_h, grad_w = ctx.saved_tensors
        # In place by the float32 0-dim grad_loss: computed in float32 and rounded once
        # (grad_loss cast to bf16 first would round 1/3 to 0.33398). float32 weights
        # scaled in place, as a second vocab x hidden float32 buffer would double the
        # peak (2 GiB at vocab 128256, hidden 4096); others scaled and cast in one pass.
        dh = None if grad_h is None else grad_h.mul_(grad_loss)
        dw = grad_w
        if grad_w is not None and grad_w.dtype == ctx.weight_dtype:
            dw = grad_w.mul_(grad_loss)
        elif grad_w is not None:
            dw = torch.mul(grad_w, grad_loss, out=torch.empty_like(grad_w, dtype=ctx.weight_dtype))
        return dh, dw, None, None, None, None, None


# ----------------------------------------------------------------------------- functional


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")


def _check_targets(targets: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if targets.shape != shape:
        raise ValueError(f"targets must have shape {tuple(shape)} (the logits' leading dims), "
                         f"got {tuple(targets.shape)}")
    check_target_ids(targets)
    return targets.reshape(-1).to(torch.int64)


def _outputs(logp, ent, shape, with_entropy):
    return logp.view(shape), ent.view(shape) if with_entropy else None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0, entropy: bool = False,
                   process_group=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp, entropy or None): log_softmax(logits / temperature)[target] and the
    distribution's entropy, per token, float32, in the targets' shape;
    differentiable (both) with respect to the logits.

    logits: (num_tokens, vocab) or (..., vocab), bf16 / fp16 / fp32; with
    process_group, this rank's shard of the vocabulary (module docstring).
    targets: int, the logits' leading shape, global ids; IGNORE_INDEX (-100) for
    a token with no target: log-prob 0 and no gradient through it (its entropy
    is still its row's). A target outside [0, vocab) raises ValueError naming
    its position (on a GPU after the kernels are queued: one host sync; none
    under torch.compile or CUDA graph capture, where it gets a NaN log-prob).
    Memory beyond the inputs: O(tokens) (one lse, and with entropy one H, a
    token); the backward writes dlogits in one pass."""
    _check_temperature(temperature)
    flat = flat_logits(logits)
    shape = logits.shape[:-1]
    flat_targets = _check_targets(targets, shape)
    shard_sizes = check_equal_shards(logits.shape[-1], process_group, logits.device)
    check = TargetCheck(flat_targets, vocab_shard(logits.shape[-1], process_group)[1], shape, shard_sizes)
    logp, ent = TokenLogprobsFunction.apply(flat, flat_targets, temperature, entropy, process_group)
    check.wait()
    return _outputs(logp, ent, shape, entropy)


# Tokens per chunk of the linear form. On a GPU by bytes of logits in their
# dtype (on an H100, 4096 tokens at vocab 128256, hidden 4096, bf16: the eager
# three-GEMM loss ran at 1.30x of its GEMMs in 512 MiB chunks, 1.35x in one 1 GiB
# chunk); 1 GiB is 4096 tokens at vocab 128256 in bf16, one micro-batch of a
# typical trainer. On CPU about 32 Mi logits (256 tokens at vocab 128256), beside
# the 64 MiB scratch.
_LINEAR_CHUNK_BYTES_GPU = 1 << 30
_LINEAR_CHUNK_ELEMS_CPU = 1 << 25


def linear_chunk_tokens(vocab: int, dtype: torch.dtype, device: torch.device) -> int:
    """The default chunk_size of the linear form for this vocabulary, dtype and device."""
    if device.type == "cuda":
        return max(1, _LINEAR_CHUNK_BYTES_GPU // max(vocab * dtype.itemsize, 1))
    return max(1, _LINEAR_CHUNK_ELEMS_CPU // max(vocab, 1))


def check_linear(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int | None) -> int:
    """The chunk size to use; ValueError for mismatched hidden / weight or a bad chunk_size."""
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}"
                             + (" (pass the lm-head's weight: lm_head.weight)" if isinstance(t, torch.nn.Module) else ""))
    if hidden.dim() < 2 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden (..., H) and weight (vocab, H) do not match: {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight dtypes differ: {hidden.dtype} and {weight.dtype}")
    if hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"hidden dtype must be bfloat16, float16 or float32, got {hidden.dtype}")
    if chunk_size is None:
        return linear_chunk_tokens(weight.shape[0], hidden.dtype, hidden.device)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    return int(chunk_size)


def linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          temperature: float = 1.0, entropy: bool = False, chunk_size: int | None = None,
                          process_group=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_logprobs of hidden @ weight.T without ever holding the full logits.

    hidden: (num_tokens, H) or (..., H); weight: (vocab, H), the lm-head (with
    process_group, this rank's rows of it; hidden the same on every rank, and
    its gradient all-reduced over the group: with Megatron's sequence
    parallelism, gather hidden with an op whose backward does not reduce it
    again); gradients flow to both. chunk_size: tokens per chunk (default: about 1 GiB
    of logits in their dtype on a GPU, 32 Mi logits on CPU). Memory beyond
    inputs and outputs: one chunk of logits and, with several chunks, a vocab x
    H float32 accumulator of the weight's gradient in the backward. Targets and
    host syncs as token_logprobs'."""
    _check_temperature(temperature)
    chunk_size = check_linear(hidden, weight, chunk_size)
    shape = hidden.shape[:-1]
    flat_targets = _check_targets(targets, shape)
    shard_sizes = check_equal_shards(weight.shape[0], process_group, weight.device)
    check = TargetCheck(flat_targets, vocab_shard(weight.shape[0], process_group)[1], shape, shard_sizes)
    logp, ent = LinearTokenLogprobsFunction.apply(hidden.reshape(-1, hidden.shape[-1]), weight, flat_targets,
                                                  temperature, entropy, chunk_size, process_group)
    check.wait()
    return _outputs(logp, ent, shape, entropy)
