"""Triton kernels for FP8 (e4m3fn) weight quantization.

Device code only: pointers, strides and sizes. Launchers and semantics live in
llamarl_core/ops/fp8.py. A program handles one BLOCK_N x BLOCK_K tile of a 2-D
weight: a 128 x 128 block, or whole rows for per-channel groups.
"""

import triton
import triton.language as tl

FP8_MAX = 448.0
# Bits of 2**-6, the smallest normal e4m3 value, as a float32.
_E4M3_MIN_NORMAL_BITS = 0x3C800000


@triton.jit
def _e4m3_rne_bits(x):
    """float32 x, already clamped to [-448, 448] -> e4m3fn bits, round to nearest
    even, with integer arithmetic only. Used when interpreting on CPU, where
    `.to(tl.float8e4nv)` rounds wrongly (carry into the exponent lost, ties away
    from zero, subnormals truncated; shared/MACHINE.md)."""
    bits = x.to(tl.uint32, bitcast=True)
    one = tl.full(bits.shape, 1, tl.uint32)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Normal range: keep 3 mantissa bits; the carry of the rounding runs into the
    # exponent by itself. Rebias the exponent from 127 to 7: (127 - 7) << 3 = 960.
    lsb = (a >> 20) & one
    normal = ((a + 0x7FFFF + lsb) >> 20) - 960
    # Subnormal range (|x| < 2**-6): the code is |x| / 2**-9, rounded to even.
    exponent = a >> 23
    mantissa = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - exponent.to(tl.int32), 31).to(tl.uint32)
    kept = mantissa >> shift
    rest = mantissa & ((one << shift) - one)
    half = one << (shift - one)
    round_up = (rest > half) | ((rest == half) & ((kept & one) == one))
    subnormal = kept + round_up.to(tl.uint32)
    code = tl.where(a >= _E4M3_MIN_NORMAL_BITS, normal, subnormal)
    return (code | sign).to(tl.uint8)


@triton.jit
def _scale_of(amax):
    """amax / 448 correctly rounded (Triton's `/` on float32 is approximate on
    GPUs); 1.0 for an all-zero group. A NaN / inf group gives inf."""
    scale = tl.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    return tl.where(scale == 0.0, 1.0, scale)


@triton.jit
def _abs_or_inf(w):
    """|w|, with NaN mapped to inf so that a max can never drop it."""
    return tl.where(w != w, float("inf"), tl.abs(w))


@triton.jit
def fp8_amax_kernel(w_ptr, out_ptr, N, K, stride_wn, stride_wk,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_ROW: tl.constexpr):
    """max |w| per row of the tile (PER_ROW, out: (N,)) or per tile (out: grid-shaped)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :] * stride_wk, mask=mask, other=0.0)
    a = _abs_or_inf(w.to(tl.float32))
    row_max = tl.max(a, axis=1)
    if PER_ROW:
        tl.store(out_ptr + rows, row_max, mask=rows < N)
    else:
        tl.store(out_ptr + pid_n * tl.num_programs(1) + pid_k, tl.max(row_max, axis=0))


@triton.jit
def fp8_quantize_kernel(w_ptr, q_ptr, scale_ptr, N, K, stride_wn, stride_wk, stride_qn, stride_sn,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_MODE: tl.constexpr,
                        COMPUTE_SCALE: tl.constexpr, SOFTWARE_FP8: tl.constexpr):
    """q = sat(RNE(w / scale)) as e4m3fn bits (q_ptr: uint8).

    SCALE_MODE 0: one scale (scale_ptr[0]); 1: one per row (scale_ptr[row * stride_sn]);
    2: one per tile (scale_ptr[pid_n * stride_sn + pid_k]). COMPUTE_SCALE (modes 1
    and 2): the kernel computes the group's amax and scale from the tile it already
    holds and stores the scale too: one pass over the input.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < N
    mask = row_ok[:, None] & (cols[None, :] < K)
    w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :] * stride_wk, mask=mask, other=0.0).to(tl.float32)
    if SCALE_MODE == 0:
        scale = tl.load(scale_ptr + tl.zeros((BLOCK_N, 1), tl.int32))
    elif SCALE_MODE == 1:
        if COMPUTE_SCALE:
            row_scale = _scale_of(tl.max(_abs_or_inf(w), axis=1))
            tl.store(scale_ptr + rows * stride_sn, row_scale, mask=row_ok)
        else:
            row_scale = tl.load(scale_ptr + rows * stride_sn, mask=row_ok, other=1.0)
        scale = row_scale[:, None]
    else:
        if COMPUTE_SCALE:
            tile_scale = _scale_of(tl.max(tl.max(_abs_or_inf(w), axis=1), axis=0))
            tl.store(scale_ptr + pid_n * stride_sn + pid_k, tile_scale)
        else:
            tile_scale = tl.load(scale_ptr + pid_n * stride_sn + pid_k)
        scale = tl.zeros((BLOCK_N, 1), tl.float32) + tile_scale
    x = tl.div_rn(w, tl.broadcast_to(scale, (BLOCK_N, BLOCK_K)))
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    if SOFTWARE_FP8:
        bits = _e4m3_rne_bits(x)
    else:
        bits = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(q_ptr + rows[:, None] * stride_qn + cols[None, :], bits, mask=mask)
