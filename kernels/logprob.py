"""Triton kernels for per-token log-probabilities over a vocabulary, forward and backward.

Device code only: pointers, strides and sizes; llamarl_core/ops/aipo.py launches
them. A program takes ROWS token rows and walks the vocabulary in BLOCK_V blocks,
so no float32 (num_tokens, vocab) buffer ever exists:
- forward: log-sum-exp (saved, float32, one per token), the target's log-prob,
  optionally the entropy, in one read of the logits with one exp2 per element;
- backward: dlogits = (coef * (onehot(target) - p) - g_H * p * (log p + H)) / temperature
  in the logits' dtype (p = softmax(logits / temperature), H its entropy, coef =
  dL/dlogp and g_H = dL/dH per token; the entropy term only in the ENTROPY_GRAD
  variant), one read and one write per element; a second grid axis splits each
  row's vocabulary over several programs when rows are few. dH/dz_j = -p_j (log
  p_j + H) for z = logits / temperature.

The forward keeps one running max m, sum s = sum exp((x - m) / T) and, for the
entropy, t = sum exp((x - m) / T) * x per lane of the block, so its loop has no
reduction across the block (two per block made the old loop latency-bound: 0.43x
of copy bandwidth for the forward and backward together). For a new value x,
with d = x - m and e = exp(-|d| / T):
    d > 0 (a new max):  s = s * e + 1,  t = t * e + x,  m = x
    otherwise:          s = s + e,      t = t + e * x
Lanes start at m = -FLT_MAX (not -inf) so that d is never -inf - -inf = NaN: an
x of -inf (a masked vocabulary entry, or a lane past the end of the row) gets
e = 0 and leaves the lane as it was; |d| / T may overflow to inf, and e = 0, on
purpose. At the end, with the row's max M and S = sum over lanes of
s * exp((m - M) / T) >= 1: lse = M / T + log(S) and the target's log-prob
(x_y - M) / T - log(S), <= 0 exactly as m holds raw logits. Whole blocks are
loaded without a mask (ptxas issued the masked loads of a block one after the
other, each waiting for the last), then the masked tail block; rows past the
end of a program's last rows read the last row again instead of being masked.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _online_update(x, m, s, t, scale, COMPUTE_ENTROPY: tl.constexpr):
    """The lane-wise update of (m, s, t) by a block of float32 logits x."""
    d = x - m
    e = tl.exp2(-tl.abs(d) * scale)
    grew = d > 0
    s = tl.where(grew, s * e + 1.0, s + e)
    if COMPUTE_ENTROPY:
        x_finite = tl.maximum(x, -FLT_MAX)  # -inf has e = 0: any finite stand-in adds 0
        t = tl.where(grew, t * e + x_finite, t + e * x_finite)
    return tl.maximum(m, x), s, t


@triton.jit
def logprob_fwd_kernel(logits_ptr, targets_ptr, lse_ptr, logp_ptr, entropy_ptr, num_rows, vocab, stride_row,
                       inv_temperature, IGNORE_INDEX: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr,
                       COMPUTE_ENTROPY: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    # Rows past the end read the last row again (their results are not stored): the
    # loop's loads need no row mask.
    row_offsets = tl.minimum(rows, num_rows - 1).to(tl.int64) * stride_row
    base = logits_ptr + row_offsets[:, None]
    scale = inv_temperature * LOG2E  # exp(z / T) = exp2(z * scale)
    m = tl.full((ROWS, BLOCK_V), -FLT_MAX, tl.float32)
    s = tl.zeros((ROWS, BLOCK_V), tl.float32)
    t = tl.zeros((ROWS, BLOCK_V), tl.float32)
    # Whole blocks unmasked (no predicate and no fill value per load), then the tail.
    full_end = vocab - vocab % BLOCK_V
    for start in range(0, full_end, BLOCK_V):
        x = tl.load(base + start + tl.arange(0, BLOCK_V)[None, :]).to(tl.float32)
        m, s, t = _online_update(x, m, s, t, scale, COMPUTE_ENTROPY)
    if full_end < vocab:
        cols = full_end + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols[None, :], mask=(cols < vocab)[None, :], other=float("-inf")).to(tl.float32)
        m, s, t = _online_update(x, m, s, t, scale, COMPUTE_ENTROPY)
    row_max = tl.max(m, axis=1)
    # Lanes that saw -inf only have s = 0 (and t = 0): they add nothing. A row of
    # -inf only has S = 0 and lse = -inf.
    rescale = tl.exp2((m - row_max[:, None]) * scale)
    total = tl.sum(s * rescale, axis=1)
    log_total = tl.log2(total) * LN2
    lse = row_max * inv_temperature + log_total
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    target = tl.load(targets_ptr + rows, mask=row_ok, other=IGNORE_INDEX)
    valid = target != IGNORE_INDEX
    # Never read outside the row, whatever the target (the launcher checks the
    # targets while this kernel may already run); a target outside the row gets
    # a NaN log-prob, so that where the launcher's check cannot wait (CUDA graph
    # capture, torch.compile) the loss says so rather than being quietly wrong.
    in_row = (target >= 0) & (target < vocab)
    x_target = tl.load(logits_ptr + row_offsets + tl.where(in_row, target, 0), mask=row_ok).to(tl.float32)
    # (x - M) <= 0 exactly, so the log-prob is <= 0 however the compiler contracts this into an FMA.
    logp = tl.where(in_row, (x_target - row_max) * inv_temperature - log_total, float("nan"))
    tl.store(logp_ptr + rows, tl.where(valid, logp, 0.0), mask=row_ok)
    if COMPUTE_ENTROPY:
        # H = lse - E_p[x / T]
        weighted = tl.sum(t * rescale, axis=1)
        tl.store(entropy_ptr + rows, lse - inv_temperature * weighted / total, mask=row_ok)


@triton.jit
def _grad_block(x, target_lane, coef, lse, lse2, grad_h, entropy, scale, inv_temperature, BLOCK_V: tl.constexpr,
                ENTROPY_GRAD: tl.constexpr):
    """coef * (onehot - p) - grad_h * p * (log p + H) of a block (coef and grad_h
    already divided by the temperature), p = exp2(x * scale - lse2); the one is
    at lane target_lane (the target's column minus the block's first)."""
    p = tl.exp2(x * scale - lse2[:, None])
    grad = tl.where(tl.arange(0, BLOCK_V)[None, :] == target_lane[:, None], coef[:, None], 0.0) - coef[:, None] * p
    if ENTROPY_GRAD:
        # p = 0 (x = -inf) adds 0, not 0 * -inf = NaN.
        log_p_plus_h = x * inv_temperature - lse[:, None] + entropy[:, None]
        grad -= tl.where(p > 0, grad_h[:, None] * p * log_p_plus_h, 0.0)
    return grad


@triton.jit
def logprob_bwd_kernel(logits_ptr, dlogits_ptr, targets_ptr, lse_ptr, coef_ptr, entropy_ptr, grad_entropy_ptr, num_rows,
                       vocab, stride_row, stride_drow, inv_temperature, cols_per_program, BLOCK_V: tl.constexpr,
                       ROWS: tl.constexpr, ENTROPY_GRAD: tl.constexpr):
    """Program (i, j) writes rows [i * ROWS, (i + 1) * ROWS) over the columns
    [j * cols_per_program, (j + 1) * cols_per_program) (a multiple of BLOCK_V).
    Every element is read before it is written, by the same program: dlogits may
    be the logits. entropy_ptr and grad_entropy_ptr are read only with ENTROPY_GRAD."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    # A row of -inf only (lse = -inf) gets p = 0 rather than exp2(-inf + inf) = NaN:
    # its gradient is 0 where its coefficient is (an ignored or masked token).
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    scale = inv_temperature * LOG2E
    coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0) * inv_temperature
    grad_h = coef
    entropy = coef
    if ENTROPY_GRAD:
        grad_h = tl.load(grad_entropy_ptr + rows, mask=row_ok, other=0.0) * inv_temperature
        entropy = tl.load(entropy_ptr + rows, mask=row_ok, other=0.0)
    # int32: the per-element compare in one instruction (an int64 compare takes
    # four). A target outside [0, vocab) other than IGNORE_INDEX may wrap: the
    # launcher raises for it.
    target = tl.load(targets_ptr + rows, mask=row_ok, other=-1).to(tl.int32)
    col_begin = tl.program_id(1) * cols_per_program
    col_end = tl.minimum(vocab, col_begin + cols_per_program)
    full_end = col_end - (col_end - col_begin) % BLOCK_V
    # Rows past the end: loads from the last row, no stores (as in the forward).
    rows_in = tl.minimum(rows, num_rows - 1).to(tl.int64)
    src = logits_ptr + rows_in[:, None] * stride_row
    dst = dlogits_ptr + rows_in[:, None] * stride_drow
    for start in range(col_begin, full_end, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(src + cols[None, :]).to(tl.float32)
        grad = _grad_block(x, target - start, coef, lse, lse2, grad_h, entropy, scale, inv_temperature, BLOCK_V,
                           ENTROPY_GRAD)
        tl.store(dst + cols[None, :], grad.to(dlogits_ptr.dtype.element_ty), mask=row_ok[:, None])
    if full_end < col_end:
        cols = full_end + tl.arange(0, BLOCK_V)
        mask = row_ok[:, None] & (cols < col_end)[None, :]
        x = tl.load(src + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        grad = _grad_block(x, target - full_end, coef, lse, lse2, grad_h, entropy, scale, inv_temperature, BLOCK_V,
                           ENTROPY_GRAD)
        tl.store(dst + cols[None, :], grad.to(dlogits_ptr.dtype.element_ty), mask=mask)
