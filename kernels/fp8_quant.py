"""Triton kernels for FP8 (e4m3fn) weight quantization.

Device code only: pointers, strides and sizes. Launchers and semantics live in
llamarl_core/ops/fp8.py. A program owns one region of a 2-D weight (a
block_size block, BLOCK_N whole rows for per-channel groups, or one tile) and
walks it in BLOCK_N x BLOCK_K sub-tiles: a first pass for the amax when the
program computes its scale, a second for the cast. The sub-tile, not the
region, sets the registers: a whole 128 x 128 tile held at once took 219
registers per thread at 8 warps (one CTA per SM), and whole rows of K = 65536
spilled 1.4 KB per thread. Offsets are int64: a weight may pass 2**31 elements.
"""

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
# Bits of 2**-6, the smallest normal e4m3 value, as a float32.
_E4M3_MIN_NORMAL_BITS = tl.constexpr(0x3C800000)


@triton.jit
def _e4m3_rne_bits(x):
    """float32 x, already clamped to [-448, 448] -> e4m3fn bits, round to nearest
    even, with integer arithmetic only. Used where `.to(tl.float8e4nv)` is not
    right or not there: in the interpreter it rounds wrongly (carry into the
    exponent lost, ties away from zero, subnormals truncated), and GPUs before
    sm_89 have no e4m3 conversion."""
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
def _region(N, K, GROUP_N, GROUP_K):
    """[row_start, row_end) x [col_start, col_end) of this program's region, int64."""
    row_start = tl.program_id(0).to(tl.int64) * GROUP_N
    col_start = tl.program_id(1).to(tl.int64) * GROUP_K
    return row_start, tl.minimum(row_start + GROUP_N, N), col_start, tl.minimum(col_start + GROUP_K, K)


@triton.jit
def _load_tile(w_ptr, row0, col0, row_end, col_end, stride_wn, stride_wk, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """The float32 sub-tile at (row0, col0), zero outside the region; with its rows, columns and mask."""
    rows = row0 + tl.arange(0, BLOCK_N)
    cols = col0 + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < row_end) & (cols[None, :] < col_end)
    w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :] * stride_wk, mask=mask, other=0.0)
    return w.to(tl.float32), rows, cols, mask


@triton.jit
def _region_row_amax(w_ptr, row_start, row_end, col_start, col_end, stride_wn, stride_wk, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """max |w| over the region for each of the BLOCK_N row positions of its
    sub-tiles: the rows' own amaxes when the region is one sub-tile high, a max
    away from the region's amax otherwise."""
    running = tl.zeros((BLOCK_N,), tl.float32)  # |w| >= 0: the zero start and padding never win
    for row0 in range(row_start, row_end, BLOCK_N):
        for col0 in range(col_start, col_end, BLOCK_K):
            w, _rows, _cols, _mask = _load_tile(w_ptr, row0, col0, row_end, col_end, stride_wn, stride_wk,
                                                BLOCK_N, BLOCK_K)
            running = tl.maximum(running, tl.max(_abs_or_inf(w), axis=1))
    return running


@triton.jit
def fp8_amax_kernel(w_ptr, out_ptr, N, K, stride_wn, stride_wk, GROUP_N, GROUP_K,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_ROW: tl.constexpr):
    """max |w| of each program's GROUP_N x GROUP_K region (out: the grid, row
    major), or with PER_ROW of each row (GROUP_N == BLOCK_N, GROUP_K >= K; out: (N,))."""
    row_start, row_end, col_start, col_end = _region(N, K, GROUP_N, GROUP_K)
    running = _region_row_amax(w_ptr, row_start, row_end, col_start, col_end, stride_wn, stride_wk, BLOCK_N, BLOCK_K)
    if PER_ROW:
        rows = row_start + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + rows, running, mask=rows < row_end)
    else:
        tl.store(out_ptr + tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1),
                 tl.max(running, axis=0))


@triton.jit
def fp8_quantize_kernel(w_ptr, q_ptr, scale_ptr, N, K, stride_wn, stride_wk, stride_qn, stride_sn, GROUP_N, GROUP_K,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_MODE: tl.constexpr,
                        COMPUTE_SCALE: tl.constexpr, SOFTWARE_FP8: tl.constexpr):
    """q = sat(RNE(w / scale)) as e4m3fn bits (q_ptr: uint8, unit column stride),
    for each program's GROUP_N x GROUP_K region.

    SCALE_MODE 0: one given scale (scale_ptr[0]). 1: one per row
    (scale_ptr[row * stride_sn]); the region is BLOCK_N rows high and spans K.
    2: one per region (scale_ptr[pid_n * stride_sn + pid_k]), a block_size block.
    COMPUTE_SCALE (modes 1 and 2): a first pass over the region computes its
    amax and stores the scale; the cast pass reads the region again (a 128 x 128
    bf16 block is 32 KiB, still in L2).
    """
    row_start, row_end, col_start, col_end = _region(N, K, GROUP_N, GROUP_K)
    if SCALE_MODE == 0:
        row_scale = tl.zeros((BLOCK_N,), tl.float32) + tl.load(scale_ptr)
    elif SCALE_MODE == 1:
        rows = row_start + tl.arange(0, BLOCK_N)
        if COMPUTE_SCALE:
            row_scale = _scale_of(_region_row_amax(w_ptr, row_start, row_end, col_start, col_end, stride_wn,
                                                   stride_wk, BLOCK_N, BLOCK_K))
            tl.store(scale_ptr + rows * stride_sn, row_scale, mask=rows < row_end)
        else:
            row_scale = tl.load(scale_ptr + rows * stride_sn, mask=rows < row_end, other=1.0)
    else:
        scale_offset = tl.program_id(0).to(tl.int64) * stride_sn + tl.program_id(1)
        if COMPUTE_SCALE:
            amax = tl.max(_region_row_amax(w_ptr, row_start, row_end, col_start, col_end, stride_wn, stride_wk,
                                           BLOCK_N, BLOCK_K), axis=0)
            block_scale = _scale_of(amax)
            tl.store(scale_ptr + scale_offset, block_scale)
        else:
            block_scale = tl.load(scale_ptr + scale_offset)
        row_scale = tl.zeros((BLOCK_N,), tl.float32) + block_scale
    divisor = tl.broadcast_to(row_scale[:, None], (BLOCK_N, BLOCK_K))
    for row0 in range(row_start, row_end, BLOCK_N):
        for col0 in range(col_start, col_end, BLOCK_K):
            w, tile_rows, cols, mask = _load_tile(w_ptr, row0, col0, row_end, col_end, stride_wn, stride_wk,
                                                  BLOCK_N, BLOCK_K)
            x = tl.div_rn(w, divisor)
            x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
            if SOFTWARE_FP8:
                bits = _e4m3_rne_bits(x)
            else:
                bits = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            tl.store(q_ptr + tile_rows[:, None] * stride_qn + cols[None, :], bits, mask=mask)
