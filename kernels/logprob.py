"""Triton kernels for per-token log-probabilities over a vocabulary, forward and backward.

Device code only: pointers, strides and sizes; llamarl_core/ops/aipo.py launches
them. One program per token row; the vocabulary is walked in BLOCK_V blocks so no
float32 (num_tokens, vocab) buffer ever exists:
- forward: online max and sum of exp -> log-sum-exp (saved, float32, one per
  token), the target's log-prob, optionally the entropy;
- backward: recomputes softmax block by block and writes
  dlogits = coef * (onehot(target) - softmax) / temperature in the logits' dtype.
"""

import triton
import triton.language as tl


@triton.jit
def logprob_fwd_kernel(logits_ptr, targets_ptr, lse_ptr, logp_ptr, entropy_ptr, vocab, stride_row, inv_temperature,
                       IGNORE_INDEX: tl.constexpr, BLOCK_V: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    running_dot = tl.zeros((), tl.float32)  # sum of exp(x - max) * x, for the entropy
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv_temperature
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        # A block (or a row so far) of -inf only: keep exp() away from -inf - -inf.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(running_max - safe_max)
        e = tl.exp(x - safe_max)
        running_sum = running_sum * rescale + tl.sum(e, axis=0)
        if COMPUTE_ENTROPY:
            running_dot = running_dot * rescale + tl.sum(e * tl.where(x == float("-inf"), 0.0, x), axis=0)
        running_max = new_max
    safe_max = tl.where(running_max == float("-inf"), 0.0, running_max)
    lse = safe_max + tl.log(running_sum)
    tl.store(lse_ptr + row, lse)
    target = tl.load(targets_ptr + row)
    valid = target != IGNORE_INDEX
    x_target = tl.load(base + tl.where(valid, target, 0)).to(tl.float32) * inv_temperature
    tl.store(logp_ptr + row, tl.where(valid, x_target - lse, 0.0))
    if COMPUTE_ENTROPY:
        tl.store(entropy_ptr + row, lse - running_dot / running_sum)


@triton.jit
def logprob_bwd_kernel(logits_ptr, dlogits_ptr, targets_ptr, lse_ptr, coef_ptr, vocab, stride_row, stride_drow,
                       inv_temperature, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row) * inv_temperature
    target = tl.load(targets_ptr + row)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_range = cols < vocab
        x = tl.load(logits_ptr + row * stride_row + cols, mask=in_range, other=float("-inf")).to(tl.float32)
        p = tl.exp(x * inv_temperature - lse)
        grad = coef * (tl.where(cols == target, 1.0, 0.0) - p)
        tl.store(dlogits_ptr + row * stride_drow + cols, grad.to(dlogits_ptr.dtype.element_ty), mask=in_range)
