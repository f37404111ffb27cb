"""Triton kernels for the FP8 destinations of a weight sync: every rectangle a
sender quantizes, in one launch per pass (amaxes, then the cast), driven by a
table of tiles.

Device code only: pointers, a tile table and sizes. The tables and launches live
in llamarl_core/ops/fp8_launch.py (Fp8Tiles), the groups in llamarl_core/sync/fp8.py.

One program a tile. A tile is `rows` x `cols` elements (at most BLOCK_N x
BLOCK_K) at element offset `src_off` from src_ptr, rows `src_stride` elements
apart: src_ptr is one of the sender's tensors of this dtype, and the others are
reached by their distance from it in elements (the table holds differences of
addresses, which may be negative); its FP8 codes go to element `out_off` of
out_ptr, rows `out_stride` apart. Row r of the tile belongs to group
`cell + r * cell_step` (cell_step 1: a group per row, per channel; 0: one group
for the whole tile, which lies inside one block, or in one tensor).

Table rows (int64): src_off, src_stride, out_off, out_stride, rows, cols, cell,
cell_step. Amaxes are maxed atomically into int32 cells holding float32 bits
(the bits of floats >= 0 order like the floats); NaN counts as inf.
"""

import triton
import triton.language as tl

from .fp8_quant import _abs_or_inf, _to_e4m3_bits

TILE_COLUMNS = tl.constexpr(8)


@triton.jit
def _tile(table_ptr, src_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's tile: (its elements in float32 as loaded, 0 outside it; row
    indices; the mask; its row of the table)."""
    entry = table_ptr + tl.program_id(0).to(tl.int64) * TILE_COLUMNS
    src_off, src_stride = tl.load(entry), tl.load(entry + 1)
    rows, cols = tl.load(entry + 4), tl.load(entry + 5)
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_K)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    w = tl.load(src_ptr + src_off + r[:, None].to(tl.int64) * src_stride + c[None, :], mask=mask, other=0.0)
    return w, r, mask, entry


@triton.jit
def fp8_tiles_amax_kernel(src_ptr, table_ptr, amax_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each row's max |w| (NaN as inf) of every tile, maxed atomically into its
    group's cell of amax_ptr (int32 bits of float32)."""
    w, r, mask, entry = _tile(table_ptr, src_ptr, BLOCK_N, BLOCK_K)
    rows, cell, step = tl.load(entry + 4), tl.load(entry + 6), tl.load(entry + 7)
    row_amax = tl.max(tl.where(mask, _abs_or_inf(w), 0.0), axis=1)
    if step == 0:  # one group for the tile: one atomic
        tl.atomic_max(amax_ptr + cell, tl.max(row_amax, axis=0).to(tl.int32, bitcast=True))
    else:
        tl.atomic_max(amax_ptr + cell + r * step, row_amax.to(tl.int32, bitcast=True), mask=r < rows)


@triton.jit
def fp8_tiles_cast_kernel(src_ptr, table_ptr, scale_ptr, out_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SOFTWARE_FP8: tl.constexpr):
    """Every tile's sat(RNE(w / scale)) as e4m3fn bits into out_ptr (uint8), each
    row with its group's scale (float32 at scale_ptr)."""
    w, r, mask, entry = _tile(table_ptr, src_ptr, BLOCK_N, BLOCK_K)
    out_off, out_stride = tl.load(entry + 2), tl.load(entry + 3)
    rows, cell, step = tl.load(entry + 4), tl.load(entry + 6), tl.load(entry + 7)
    scale = tl.load(scale_ptr + cell + r * step, mask=r < rows, other=1.0)
    divisor = tl.broadcast_to(scale[:, None], (BLOCK_N, BLOCK_K))
    c = tl.arange(0, BLOCK_K)
    tl.store(out_ptr + out_off + r[:, None].to(tl.int64) * out_stride + c[None, :],
             _to_e4m3_bits(w, divisor, SOFTWARE_FP8), mask=mask)
