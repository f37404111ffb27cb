"""Triton kernels for FP8 (e4m3fn) weight quantization.

Device code only: pointers, strides and sizes. The launchers and the choice of
tiles live in llamarl_core/ops/fp8_launch.py, the semantics in ops/fp8_format.py.

Region kernels (per channel, per block; per tensor on strided weights): a
program owns a GROUP_N x GROUP_K region of a 2-D weight (GROUP_N whole rows, a
block_size block, or one tile) and either
- ONE_TILE: loads the whole region as one BLOCK_N x BLOCK_K tile (the region
  padded to powers of two), then takes its amax, its scale and the cast from
  registers. HBM is read once, and every load of the region is issued back to
  back, before the first one is waited for. The launchers use it on weights
  whose loads vectorize (16-byte loads) and regions of up to 16K elements; or
- walks the region in BLOCK_N x BLOCK_K sub-tiles, a first pass for the amax
  when the program computes its scale and a second for the cast (re-reading
  from L2): for rows too long to hold (K > 16384), unaligned or strided weights.
Flat kernels (per tensor, contiguous weights): the weight as one 1-D run. A
grid-stride amax pass max-reduces into one int32 device scalar (the bits of a
float32 >= 0 order like the floats), then a cast pass whose programs each
derive the scale from that scalar: no host round trip between the two.

A group holding NaN or inf gets an inf amax, hence an inf scale: NaN is mapped
to inf before every max so that no max can drop it.
Offsets are int64 where a weight may pass 2**31 elements; a one-tile program
adds int32 offsets within its tile to an int64 base (the launchers check the
tile's span fits).
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
    """|w| in float32, with NaN mapped to inf so that a max can never drop it.
    Taken in float32: the interpreter compares bf16 NaN as equal to itself."""
    w = w.to(tl.float32)
    return tl.where(w != w, float("inf"), tl.abs(w))


@triton.jit
def _to_e4m3_bits(w, divisor, SOFTWARE_FP8: tl.constexpr):
    """sat(RNE(w / divisor)) as e4m3fn bits (uint8), the division correctly
    rounded in float32; divisor float32 of w's shape."""
    x = tl.div_rn(w.to(tl.float32), divisor)
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    # if / else, not an early return: Triton 3.6 also compiles what follows a
    # return under a constexpr `if`, and sm_80 has no float8e4nv.
    if SOFTWARE_FP8:
        bits = _e4m3_rne_bits(x)
    else:
        bits = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return bits


@triton.jit
def _scale_from_amax_bits(amax_ptr, scale_ptr, is_first):
    """The per-tensor scale from the int32 amax bits the amax pass left at
    amax_ptr; the first program also stores it to scale_ptr."""
    scale = _scale_of(tl.load(amax_ptr).to(tl.float32, bitcast=True))
    tl.store(scale_ptr, scale, mask=is_first)
    return scale


# ----------------------------------------------------------------------------- region kernels


@triton.jit
def _region(N, K, GROUP_N, GROUP_K):
    """[row_start, row_end) x [col_start, col_end) of this program's region, int64."""
    row_start = tl.program_id(0).to(tl.int64) * GROUP_N
    col_start = tl.program_id(1).to(tl.int64) * GROUP_K
    return row_start, tl.minimum(row_start + GROUP_N, N), col_start, tl.minimum(col_start + GROUP_K, K)


@triton.jit
def _tile_offsets(row_start, row_end, col_start, col_end, stride_n, stride_k, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """int32 offsets of the region's elements from its first one, as one tile, and the tile's mask."""
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < (row_end - row_start).to(tl.int32)) & (cols[None, :] < (col_end - col_start).to(tl.int32))
    return rows[:, None] * stride_n + cols[None, :] * stride_k, mask


@triton.jit
def _load_region(w_ptr, row_start, row_end, col_start, col_end, stride_wn, stride_wk, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The whole region as one tile in w's dtype, zero outside it; and its mask."""
    offsets, mask = _tile_offsets(row_start, row_end, col_start, col_end, stride_wn, stride_wk, BLOCK_N, BLOCK_K)
    w = tl.load(w_ptr + (row_start * stride_wn + col_start * stride_wk) + offsets, mask=mask, other=0.0)
    return w, mask


@triton.jit
def _load_subtile(w_ptr, row0, col0, row_end, col_end, stride_wn, stride_wk, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """The sub-tile at (row0, col0) of a walk, zero outside the region; with its rows, columns and mask (int64)."""
    rows = row0 + tl.arange(0, BLOCK_N)
    cols = col0 + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < row_end) & (cols[None, :] < col_end)
    w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :] * stride_wk, mask=mask, other=0.0)
    return w, rows, cols, mask


@triton.jit
def _walk_row_amax(w_ptr, row_start, row_end, col_start, col_end, stride_wn, stride_wk, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """max |w| over the region for each of the BLOCK_N row positions of its
    sub-tiles: the rows' own amaxes when the region is one sub-tile high, a max
    away from the region's amax otherwise."""
    running = tl.zeros((BLOCK_N,), tl.float32)  # |w| >= 0: the zero start and padding never win
    for row0 in range(row_start, row_end, BLOCK_N):
        for col0 in range(col_start, col_end, BLOCK_K):
            w, _rows, _cols, _mask = _load_subtile(w_ptr, row0, col0, row_end, col_end, stride_wn, stride_wk,
                                                   BLOCK_N, BLOCK_K)
            running = tl.maximum(running, tl.max(_abs_or_inf(w), axis=1))
    return running


@triton.jit
def fp8_amax_kernel(w_ptr, out_ptr, N, K, stride_wn, stride_wk, GROUP_N, GROUP_K, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr, OUT_MODE: tl.constexpr):
    """max |w| (float32) of each program's GROUP_N x GROUP_K region.

    OUT_MODE 0: of each row (channel: GROUP_N == BLOCK_N, GROUP_K >= K; out (N,)).
    1: of each region (out: the grid, row major). 2: the region's amax maxed
    atomically into the int32 scalar out_ptr[0] as float32 bits (per tensor;
    zero-initialised by the launcher).
    """
    row_start, row_end, col_start, col_end = _region(N, K, GROUP_N, GROUP_K)
    if ONE_TILE:
        w, _mask = _load_region(w_ptr, row_start, row_end, col_start, col_end, stride_wn, stride_wk, BLOCK_N, BLOCK_K)
        row_amax = tl.max(_abs_or_inf(w), axis=1)
    else:
        row_amax = _walk_row_amax(w_ptr, row_start, row_end, col_start, col_end, stride_wn, stride_wk, BLOCK_N,
                                  BLOCK_K)
    if OUT_MODE == 0:
        rows = row_start + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + rows, row_amax, mask=rows < row_end)
    elif OUT_MODE == 1:
        tl.store(out_ptr + tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1),
                 tl.max(row_amax, axis=0))
    else:
        tl.atomic_max(out_ptr, tl.max(row_amax, axis=0).to(tl.int32, bitcast=True))


@triton.jit
def fp8_quantize_kernel(w_ptr, q_ptr, scale_ptr, amax_ptr, N, K, stride_wn, stride_wk, stride_qn, stride_sn, GROUP_N,
                        GROUP_K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
                        SCALE_MODE: tl.constexpr, COMPUTE_SCALE: tl.constexpr, SOFTWARE_FP8: tl.constexpr):
    """q = sat(RNE(w / scale)) as e4m3fn bits (q_ptr: uint8, unit column stride),
    for each program's GROUP_N x GROUP_K region.

    SCALE_MODE 0: one scale for the tensor: scale_ptr[0], or with COMPUTE_SCALE
    derived from the amax bits at amax_ptr (int32, fp8_amax_kernel's OUT_MODE 2)
    and stored to scale_ptr[0] by program (0, 0). 1: one per row
    (scale_ptr[row * stride_sn]); the region is BLOCK_N rows high and spans K.
    2: one per region (scale_ptr[pid_n * stride_sn + pid_k]), a block_size block.
    COMPUTE_SCALE (modes 1 and 2): the program takes its region's amax, stores
    the scale, then casts: from registers with ONE_TILE, else by a second walk.
    """
    row_start, row_end, col_start, col_end = _region(N, K, GROUP_N, GROUP_K)
    if ONE_TILE:
        w, mask = _load_region(w_ptr, row_start, row_end, col_start, col_end, stride_wn, stride_wk, BLOCK_N, BLOCK_K)
    rows = row_start + tl.arange(0, BLOCK_N)
    zeros = tl.zeros((BLOCK_N,), tl.float32)
    if SCALE_MODE == 0:
        if COMPUTE_SCALE:
            first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
            row_scale = zeros + _scale_from_amax_bits(amax_ptr, scale_ptr, first)
        else:
            row_scale = zeros + tl.load(scale_ptr)
    elif COMPUTE_SCALE:
        if ONE_TILE:
            row_amax = tl.max(_abs_or_inf(w), axis=1)
        else:
            row_amax = _walk_row_amax(w_ptr, row_start, row_end, col_start, col_end, stride_wn, stride_wk, BLOCK_N,
                                      BLOCK_K)
        if SCALE_MODE == 1:
            row_scale = _scale_of(row_amax)
            tl.store(scale_ptr + rows * stride_sn, row_scale, mask=rows < row_end)
        else:
            block_scale = _scale_of(tl.max(row_amax, axis=0))
            tl.store(scale_ptr + tl.program_id(0).to(tl.int64) * stride_sn + tl.program_id(1), block_scale)
            row_scale = zeros + block_scale
    elif SCALE_MODE == 1:
        row_scale = tl.load(scale_ptr + rows * stride_sn, mask=rows < row_end, other=1.0)
    else:
        row_scale = zeros + tl.load(scale_ptr + tl.program_id(0).to(tl.int64) * stride_sn + tl.program_id(1))
    divisor = tl.broadcast_to(row_scale[:, None], (BLOCK_N, BLOCK_K))
    if ONE_TILE:
        offsets, _mask = _tile_offsets(row_start, row_end, col_start, col_end, stride_qn, 1, BLOCK_N, BLOCK_K)
        tl.store(q_ptr + (row_start * stride_qn + col_start) + offsets, _to_e4m3_bits(w, divisor, SOFTWARE_FP8),
                 mask=mask)
    else:
        for row0 in range(row_start, row_end, BLOCK_N):
            for col0 in range(col_start, col_end, BLOCK_K):
                w, tile_rows, cols, mask = _load_subtile(w_ptr, row0, col0, row_end, col_end, stride_wn, stride_wk,
                                                         BLOCK_N, BLOCK_K)
                tl.store(q_ptr + tile_rows[:, None] * stride_qn + cols[None, :], _to_e4m3_bits(w, divisor, SOFTWARE_FP8),
                         mask=mask)


# ----------------------------------------------------------------------------- flat kernels (per tensor, contiguous)


@triton.jit
def fp8_flat_amax_kernel(w_ptr, amax_ptr, numel, BLOCK: tl.constexpr):
    """max |w| over a contiguous weight, maxed atomically into the int32 scalar
    amax_ptr[0] as float32 bits (zero-initialised by the launcher). Grid-stride:
    the programs sweep the weight front to back together, so its tail is what
    L2 holds last (the reversed cast pass reads it first)."""
    offsets = tl.arange(0, BLOCK)
    running = tl.zeros((BLOCK,), tl.float32)  # |w| >= 0: the zero start and padding never win
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, numel, tl.num_programs(0).to(tl.int64) * BLOCK):
        w = tl.load(w_ptr + start + offsets, mask=offsets < tl.minimum(numel - start, BLOCK).to(tl.int32), other=0.0)
        running = tl.maximum(running, _abs_or_inf(w))
    tl.atomic_max(amax_ptr, tl.max(running, axis=0).to(tl.int32, bitcast=True))


@triton.jit
def fp8_flat_quantize_kernel(w_ptr, q_ptr, scale_ptr, amax_ptr, numel, BLOCK: tl.constexpr,
                             COMPUTE_SCALE: tl.constexpr, REVERSE: tl.constexpr, SOFTWARE_FP8: tl.constexpr):
    """q = sat(RNE(w / scale)) over a contiguous weight, BLOCK elements a program,
    one scale: scale_ptr[0], or with COMPUTE_SCALE derived from the amax bits at
    amax_ptr (fp8_flat_amax_kernel's) and stored to scale_ptr[0] by program 0.
    REVERSE: program i takes the i-th block from the end (what the amax pass read last)."""
    pid = tl.program_id(0)
    if REVERSE:
        block = tl.num_programs(0) - 1 - pid
    else:
        block = pid
    start = block.to(tl.int64) * BLOCK
    if COMPUTE_SCALE:
        scale = _scale_from_amax_bits(amax_ptr, scale_ptr, pid == 0)
    else:
        scale = tl.load(scale_ptr)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < tl.minimum(numel - start, BLOCK).to(tl.int32)  # int32 lanes, an int64 start
    w = tl.load(w_ptr + start + offsets, mask=mask, other=0.0)
    divisor = tl.zeros((BLOCK,), tl.float32) + scale
    tl.store(q_ptr + start + offsets, _to_e4m3_bits(w, divisor, SOFTWARE_FP8), mask=mask)
