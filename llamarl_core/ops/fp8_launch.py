"""Launchers of the FP8 kernels (kernels/fp8_quant.py; kernels/fp8_sync.py for
the grouped tiles): how a weight is cut (Fp8Tiling: GPU_TILINGS on a GPU, the
candidates SWEEP_TILINGS), the launches, which cast a device needs, every
variant a GPU must compile (kernel_variants, tile_variants), and the grouped
tiles of a sync's FP8 destinations (Fp8Tiles). The op built on them is
ops/fp8.py; the semantics they implement, ops/fp8_format.py.

Speed (H100, see Fp8Tiling and GPU_TILINGS): per channel and per block one
pass, reading the weight once; per tensor two kernels, a global amax pass and
the cast pass, which reads the amax from device memory. No launch syncs with
the host (Fp8Tiles uploads its table once, when it is built).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._launch import KernelLaunch, next_pow2, use_interpreter
from .fp8_format import DEFAULT_BLOCK, FP8_DTYPE, GRANULARITIES, INPUT_DTYPES, scale_shape


# ----------------------------------------------------------------------------- launchers


def quant_kernels():
    from llamarl_core.kernels import fp8_quant

    return fp8_quant


@dataclass(frozen=True)
class Fp8Tiling:
    """How the Triton launchers cut one granularity's work (sizes in elements).

    tile: what a program holds at once. Channel: whole rows as one tile,
        tile // next_pow2(K) of them (at least one), when next_pow2(K) <=
        max_tile; block: the whole block as one tile when its padded size is <=
        max_tile; per tensor (contiguous weights): the flat passes' elements per
        program and amax step. 0: never one tile (every region walked twice).
    per_thread: elements per thread of a tile, which sets num_warps (1 to 16).
    max_tile: the largest region held as one tile.
    walk: elements of a sub-tile where a region is walked instead (a row longer
        than max_tile; per tensor on a strided weight), at 8 warps.
    unaligned: the same where loads cannot vectorize (address, row stride or K
        not a multiple of 16 elements, or a column stride other than 1): such
        weights always walk (per tensor: flat passes of this many elements).
    aligned_only: one tile only where loads vectorize (on a GPU: an unvectorized
        4096-element sub-tile took up to 254 registers a thread).
    amax_programs_per_sm: programs of the per-tensor flat amax pass per SM.
    reverse: the per-tensor flat cast takes blocks from the end, so it first
        reads what the amax pass left in L2.
    """

    tile: int
    per_thread: int = 32
    max_tile: int = 16384
    walk: int = 4096
    unaligned: int = 1024
    aligned_only: bool = True
    amax_programs_per_sm: int = 8
    reverse: bool = True

    def holds(self, elements: int) -> bool:
        """Whether a region of this many elements (padded) is held as one tile."""
        return self.tile > 0 and elements <= max(self.tile, self.max_tile)

    def describe(self, granularity: str) -> str:
        """The fields that matter to `granularity`, for tables."""
        if granularity == "tensor":
            return (f"flat {self.tile}/program, {self.per_thread}/thread, amax {self.amax_programs_per_sm}/SM"
                    f"{', reversed cast' if self.reverse else ''}")
        if self.tile == 0:
            return f"walk {self.walk} twice"
        return f"tile {self.tile} (max {self.max_tile}), {self.per_thread}/thread, else walk {self.walk}"


# The defaults on a GPU, per granularity; candidates for them in SWEEP_TILINGS.
# H100 targets (14336 x 4096 bf16): channel and block >= 0.8x of the device copy
# bandwidth, per tensor >= 0.5x (its two passes read the weight twice). Chosen by
# `bench_fp8 --gpu-sweep` on an H100 (bench/RESULTS.md), x device copy:
# Channel: one row of K = 4096 a program (0.95x; 2 rows: 0.92x); rows past 8192
# walked (K = 14336: 0.71x, one padded 16384-wide tile: 0.65x). Block: the 128 x 128
# block at 16 warps (0.84x; walked twice: 0.76x). Per tensor: 8192 elements a
# program at 8 warps (0.56x). No spills (python -m llamarl_core.ops.kernel_check).
GPU_TILINGS = {
    "tensor": Fp8Tiling(tile=8192),
    "channel": Fp8Tiling(tile=4096, max_tile=8192),
    "block": Fp8Tiling(tile=16384),
}
# What the GPU session times (bench_fp8 --gpu-sweep) to settle the defaults; each
# one is in kernel_variants(), so it is known to compile.
SWEEP_TILINGS = {
    "tensor": [GPU_TILINGS["tensor"], Fp8Tiling(tile=4096), Fp8Tiling(tile=16384), Fp8Tiling(tile=8192, per_thread=16),
               Fp8Tiling(tile=8192, reverse=False), Fp8Tiling(tile=8192, amax_programs_per_sm=4),
               Fp8Tiling(tile=8192, amax_programs_per_sm=16)],
    "channel": [GPU_TILINGS["channel"], Fp8Tiling(tile=4096), Fp8Tiling(tile=16384),
                Fp8Tiling(tile=8192, per_thread=16), Fp8Tiling(tile=16384, per_thread=64),
                Fp8Tiling(tile=8192, max_tile=8192), Fp8Tiling(tile=0)],
    "block": [GPU_TILINGS["block"], Fp8Tiling(tile=16384, per_thread=64), Fp8Tiling(tile=0)],
}
# In the interpreter every operation costs about the same whatever its size (about
# 0.5 ms per program instance): one tile of up to 64K elements whatever the strides.
_INTERPRETER_TILING = Fp8Tiling(tile=1 << 16, max_tile=1 << 16, walk=1 << 16, unaligned=1 << 16, aligned_only=False,
                                amax_programs_per_sm=1)
_INTERPRETER_TILINGS = {granularity: _INTERPRETER_TILING for granularity in GRANULARITIES}
# Walked sub-tiles at 8 warps: 4096 elements took at most 43 registers, 1024 unvectorized at most 64 (sm_90).
_WALK_NUM_WARPS = 8


def _tiling(w: torch.Tensor, granularity: str, tiling: Fp8Tiling | None) -> Fp8Tiling:
    if tiling is not None:
        return tiling
    return (GPU_TILINGS if w.device.type == "cuda" else _INTERPRETER_TILINGS)[granularity]


def _num_warps(elements: int, per_thread: int) -> int:
    return min(16, next_pow2(max(1, elements // (32 * per_thread))))


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (1 off a GPU); torch caches the properties: no sync."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _vectorizes(w: torch.Tensor) -> bool:
    """Whether the JIT vectorizes w's row loads: its address, row stride and K
    divisible by 16 (the JIT's hint) and a unit column stride (a constant to it)."""
    return w.data_ptr() % 16 == 0 and w.stride(1) == 1 and w.shape[1] % 16 == 0 and w.stride(0) % 16 == 0


def _flat(w: torch.Tensor) -> bool:
    """Per tensor, w is read as one contiguous 1-D run."""
    return w.is_contiguous()


def _flat_vectorizes(w: torch.Tensor) -> bool:
    return w.data_ptr() % 16 == 0 and w.numel() % 16 == 0


def _fits_int32(w: torch.Tensor, rows: int, cols: int) -> bool:
    """Whether the int32 offsets of a rows x cols tile from its first element
    cannot overflow, in w and in q (contiguous, row stride K)."""
    row_stride = max(abs(w.stride(0)), w.shape[1])
    return (rows - 1) * row_stride + (cols - 1) * abs(w.stride(1)) < 2**31


def _subtile(max_rows: int, max_cols: int, elements: int) -> tuple[int, int]:
    """(rows, cols) of a walk's sub-tile: as wide as the region (up to `elements`), then as high as fits."""
    cols = min(max_cols, elements)
    return min(max_rows, max(1, elements // cols)), cols


@dataclass(frozen=True)
class _Plan:
    """A region kernel's launch: programs own GROUP_N x GROUP_K regions (grid),
    held as one BLOCK_N x BLOCK_K tile (one_tile) or walked in such sub-tiles."""

    grid: tuple[int, int]
    group_n: int
    group_k: int
    block_n: int
    block_k: int
    one_tile: bool
    num_warps: int


def _region_plan(w: torch.Tensor, granularity: str, block_size, tiling: Fp8Tiling, amax_only: bool = False) -> _Plan:
    """How the region kernels cut w. Channel: whole rows a program; block: a
    block a program; per tensor (strided weights): a sub-tile a program for the
    cast, and rows enough for amax_programs_per_sm programs per SM for the amax."""
    n, k = w.shape
    vectorizes = _vectorizes(w) or not tiling.aligned_only
    walk = tiling.walk if vectorizes else tiling.unaligned
    if granularity == "block":
        group_n, group_k = block_size
        grid = (-(-n // group_n), -(-k // group_k))
        bn, bk = next_pow2(group_n), next_pow2(group_k)
        if vectorizes and tiling.holds(bn * bk) and _fits_int32(w, bn, bk):
            return _Plan(grid, group_n, group_k, bn, bk, True, _num_warps(bn * bk, tiling.per_thread))
        bn, bk = _subtile(bn, bk, walk)
        return _Plan(grid, group_n, group_k, bn, bk, False, _WALK_NUM_WARPS)
    if granularity == "channel":
        bk = next_pow2(k)
        rows = min(max(1, tiling.tile // bk), next_pow2(n))
        if vectorizes and tiling.holds(bk) and _fits_int32(w, rows, bk):
            return _Plan((-(-n // rows), 1), rows, k, rows, bk, True, _num_warps(rows * bk, tiling.per_thread))
        bn, bk = _subtile(next_pow2(n), bk, walk)
        return _Plan((-(-n // bn), 1), bn, k, bn, bk, False, _WALK_NUM_WARPS)
    bn, bk = _subtile(next_pow2(n), next_pow2(k), walk)
    if not amax_only:
        return _Plan((-(-n // bn), -(-k // bk)), bn, bk, bn, bk, False, _WALK_NUM_WARPS)
    # One atomic a program: a few programs per SM, each walking whole rows.
    row_tiles = -(-n // bn)
    group_n = bn * -(-row_tiles // (tiling.amax_programs_per_sm * _sm_count(w.device)))
    return _Plan((-(-n // group_n), 1), group_n, k, bn, bk, False, _WALK_NUM_WARPS)


def _flat_block(w: torch.Tensor, tiling: Fp8Tiling) -> tuple[int, int]:
    """(elements, num_warps) of a per-tensor flat program; unvectorized, the
    walks' size and warps (1024 elements at 1 warp took 87 registers, at 8 warps 30)."""
    if tiling.tile and (_flat_vectorizes(w) or not tiling.aligned_only):
        return tiling.tile, _num_warps(tiling.tile, tiling.per_thread)
    return tiling.unaligned, _WALK_NUM_WARPS


def _amax_launch(w: torch.Tensor, out: torch.Tensor, granularity: str, block_size, tiling: Fp8Tiling) -> KernelLaunch:
    """max |w| per row (channel; out (N, 1)), per block (out: the scale's shape),
    or per tensor into out, an int32 scalar holding 0 (float32 bits)."""
    kernels = quant_kernels()
    if granularity == "tensor" and _flat(w):
        block, num_warps = _flat_block(w, tiling)
        grid = (min(-(-w.numel() // block), tiling.amax_programs_per_sm * _sm_count(w.device)),)
        return KernelLaunch(kernels.fp8_flat_amax_kernel, grid, dict(w_ptr=w, amax_ptr=out, numel=w.numel()),
                            dict(BLOCK=block), num_warps)
    n, k = w.shape
    plan = _region_plan(w, granularity, block_size, tiling, amax_only=True)
    return KernelLaunch(
        kernels.fp8_amax_kernel, plan.grid,
        dict(w_ptr=w, out_ptr=out, N=n, K=k, stride_wn=w.stride(0), stride_wk=w.stride(1), GROUP_N=plan.group_n,
             GROUP_K=plan.group_k),
        dict(BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, ONE_TILE=plan.one_tile,
             OUT_MODE={"channel": 0, "block": 1, "tensor": 2}[granularity]), plan.num_warps)


def _quantize_launch(w, q_bits, scale, granularity: str, block_size, compute_scale: bool, software_fp8: bool,
                     tiling: Fp8Tiling, amax_bits: torch.Tensor | None = None) -> KernelLaunch:
    """The cast of `w` into q_bits (uint8, contiguous); `scale` is read, or with
    compute_scale written: per tensor derived from amax_bits (the int32 scalar
    an amax launch filled), per channel / block from each program's own region."""
    kernels = quant_kernels()
    amax_bits = scale if amax_bits is None else amax_bits  # a placeholder where no per-tensor amax is read
    if granularity == "tensor" and _flat(w):
        block, num_warps = _flat_block(w, tiling)
        return KernelLaunch(kernels.fp8_flat_quantize_kernel, (-(-w.numel() // block),),
                            dict(w_ptr=w, q_ptr=q_bits, scale_ptr=scale, amax_ptr=amax_bits, numel=w.numel()),
                            dict(BLOCK=block, COMPUTE_SCALE=compute_scale, REVERSE=tiling.reverse,
                                 SOFTWARE_FP8=software_fp8), num_warps)
    n, k = w.shape
    plan = _region_plan(w, granularity, block_size, tiling)
    return KernelLaunch(
        kernels.fp8_quantize_kernel, plan.grid,
        dict(w_ptr=w, q_ptr=q_bits, scale_ptr=scale, amax_ptr=amax_bits, N=n, K=k, stride_wn=w.stride(0),
             stride_wk=w.stride(1), stride_qn=q_bits.stride(0), stride_sn=scale.stride(0) if scale.dim() >= 1 else 0,
             GROUP_N=plan.group_n, GROUP_K=plan.group_k),
        dict(BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, ONE_TILE=plan.one_tile,
             SCALE_MODE={"tensor": 0, "channel": 1, "block": 2}[granularity], COMPUTE_SCALE=compute_scale,
             SOFTWARE_FP8=software_fp8), plan.num_warps)


# The first compute capability with an e4m3 conversion instruction (Ada, sm_89).
HARDWARE_E4M3_CAPABILITY = (8, 9)


def software_fp8_cast(device: torch.device) -> bool:
    """Whether the kernels cast to e4m3 with integer arithmetic: in the interpreter
    (its own cast rounds wrongly) and on GPUs before sm_89 (no e4m3 conversion
    instruction: A100, A10); the hardware cast (round to nearest even, saturating) otherwise."""
    if device.type != "cuda" or use_interpreter():
        return True
    return torch.cuda.get_device_capability(device) < HARDWARE_E4M3_CAPABILITY


def launch_amax(w: torch.Tensor, granularity: str, block_size, tiling: Fp8Tiling | None = None) -> torch.Tensor:
    """Per-group amax (float32, the scale's shape) with the Triton kernels; no host sync."""
    if w.numel() == 0:
        return torch.zeros(scale_shape(tuple(w.shape), granularity, block_size), dtype=torch.float32, device=w.device)
    tiling = _tiling(w, granularity, tiling)
    if granularity == "tensor":
        bits = torch.zeros((), dtype=torch.int32, device=w.device)
        _amax_launch(w, bits, granularity, block_size, tiling).launch(w.device)
        return bits.view(torch.float32)
    out = torch.empty(scale_shape(tuple(w.shape), granularity, block_size), dtype=torch.float32, device=w.device)
    _amax_launch(w, out, granularity, block_size, tiling).launch(w.device)
    return out


def launch_quantize_fp8(w: torch.Tensor, granularity: str, block_size=DEFAULT_BLOCK,
                        tiling: Fp8Tiling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of quantize_fp8 with the Triton kernels, unchecked and with no
    host sync, cut by `tiling` (default: GPU_TILINGS on a GPU): one pass per
    channel / block, two per tensor (the amax, then the cast, which derives the
    scale on the device). A group holding NaN / inf gets an inf scale."""
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty(scale_shape(tuple(w.shape), granularity, block_size), dtype=torch.float32, device=w.device)
    if w.numel() == 0:
        return q, scale.fill_(1.0)  # an empty group is an all-zero group
    tiling = _tiling(w, granularity, tiling)
    amax_bits = None
    if granularity == "tensor":
        amax_bits = torch.zeros((), dtype=torch.int32, device=w.device)
        _amax_launch(w, amax_bits, granularity, block_size, tiling).launch(w.device)
    _quantize_launch(w, q.view(torch.uint8), scale, granularity, block_size, True, software_fp8_cast(w.device), tiling,
                     amax_bits).launch(w.device)
    return q, scale


def launch_cast(w, q_bits, scale, granularity: str, block_size) -> None:
    """The cast pass alone with a given per-group scale (scales reduced across ranks)."""
    if w.numel():
        _quantize_launch(w, q_bits, scale, granularity, block_size, False, software_fp8_cast(w.device),
                         _tiling(w, granularity, None)).launch(w.device)


def kernel_variants() -> list[tuple[str, KernelLaunch]]:
    """Every launch the launchers above can make, on small CPU tensors standing in
    for CUDA ones: what a GPU must compile. Besides dtype, granularity and the
    cast, a launch depends on the shape only through its plan: one tile or a
    walk, rows per program (K), aligned or not, flat or strided. Then every
    candidate of SWEEP_TILINGS on the sweep's shapes (bf16 and float32, the
    hardware cast an H100 runs)."""
    variants = []
    # K 1024 and 256: several rows a program; 14336: one 16384-wide row; 32784 (past
    # max_tile): walked. Sizes multiples of 16 (the JIT's divisibility hint on sizes
    # and strides, every LLM weight), and for bf16 also sizes that are not
    # (unvectorized walks) and a transposed view (strided walks).
    shapes = [(dtype, n, k, False) for dtype in INPUT_DTYPES for n, k in ((256, 1024), (256, 256), (64, 14336))]
    shapes += [(torch.bfloat16, n, k, transposed) for n, k, transposed in
               ((16, 32784, False), (250, 1030, False), (250, 200, False), (256, 1024, True))]
    for dtype, n, k, transposed in shapes:
        w = torch.empty((k, n), dtype=dtype).t() if transposed else torch.empty((n, k), dtype=dtype)
        for granularity in GRANULARITIES:
            tiling = GPU_TILINGS[granularity]
            tag = (f"{granularity}, {str(dtype).removeprefix('torch.')}, {n}x{k}"
                   f"{', transposed' if transposed else ''}{'' if n % 16 == 0 and k % 16 == 0 else ', unaligned'}")
            variants += _variants_of(w, granularity, tiling, tag, softwares=(False, True), given=(False, True))
    for dtype in (torch.bfloat16, torch.float32):
        for n, k in ((64, 4096), (64, 14336)):
            w = torch.empty((n, k), dtype=dtype)
            for granularity, candidates in SWEEP_TILINGS.items():
                for tiling in candidates:
                    tag = (f"{granularity}, {str(dtype).removeprefix('torch.')}, {n}x{k}, "
                           f"sweep {tiling.describe(granularity)}")
                    variants += _variants_of(w, granularity, tiling, tag, softwares=(False,), given=(False,))
    return variants


def _variants_of(w, granularity, tiling, tag, softwares, given) -> list[tuple[str, KernelLaunch]]:
    """The amax launch and the quantize launches (scale computed, or given) of one weight."""
    n, k = w.shape
    bits = torch.empty((), dtype=torch.int32)
    amax_out = bits if granularity == "tensor" else torch.empty(scale_shape((n, k), granularity), dtype=torch.float32)
    scale = torch.empty(scale_shape((n, k), granularity), dtype=torch.float32)
    q = torch.empty((n, k), dtype=torch.uint8)
    variants = [(f"amax {tag}", _amax_launch(w, amax_out, granularity, DEFAULT_BLOCK, tiling))]
    for scale_given in given:
        amax_bits = bits if granularity == "tensor" and not scale_given else None  # as launch_quantize_fp8 passes it
        for software in softwares:
            name = f"quantize {tag}{', scale given' if scale_given else ''}{', software cast' if software else ''}"
            variants.append((name, _quantize_launch(w, q, scale, granularity, DEFAULT_BLOCK, not scale_given, software,
                                                    tiling, amax_bits)))
    return variants


# The interpreter runs about 0.5 ms per program instance (measured on a 2-core CPU): past
# this many elements a CPU tensor goes to the torch path even when interpreting.
INTERPRETER_MAX_ELEMS = 1 << 22


# ----------------------------------------------------------------------------- grouped tiles (a sync's FP8 destinations)

# Rows x columns a program of the grouped kernels (kernels/fp8_sync.py) holds: a
# 128 x 128 block is four tiles. The tiles' addresses come from the table, so the
# compiler cannot assume their alignment (no 16-byte loads guaranteed): not timed
# on a GPU yet. 8 warps (16 elements a thread): the cast took 175-182 registers a
# thread at 4 warps (ptxas, sm_90), 102-108 at 8.
TILE_BLOCK = (32, 128)
_TILE_WARPS = 8


def _tile_kernels():
    from llamarl_core.kernels import fp8_sync

    return fp8_sync


def triton_takes(device: torch.device, elements: int) -> bool:
    """Whether FP8 work of `elements` on `device` goes to the Triton kernels by
    default (ops.fp8's backend="auto", a sync's grouped kernels): always on a
    GPU; on CPU under TRITON_INTERPRET=1 up to INTERPRETER_MAX_ELEMS; the torch
    path otherwise."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and use_interpreter() and elements <= INTERPRETER_MAX_ELEMS


class Fp8Tiles:
    """Tiles over tensors of one dtype for the grouped FP8 kernels, uploaded once.
    rows: (n, 8) int64 as kernels/fp8_sync.py reads them, except column 0, the
    tile's first element as an absolute byte address; `base` is one of the
    tensors (its dtype the tensors'), from which the kernels reach the others:
    every address must lie a whole number of elements from it. Launches read and
    write through the addresses given: the tensors must not move (rebuild)."""

    def __init__(self, base: torch.Tensor, rows, device: torch.device):
        import numpy as np

        # A copy (column 0 is rewritten), as wide as the kernels read a row.
        table = np.array(rows, dtype=np.int64).reshape(-1, _tile_kernels().TILE_COLUMNS.value)
        itemsize = base.element_size()
        distance = table[:, 0] - base.data_ptr()
        if (distance % itemsize).any():
            raise ValueError(f"FP8 tiles: a tensor lies {int(distance[(distance % itemsize) != 0][0])} bytes from the "
                             f"first, not a whole number of {base.dtype} elements")
        table[:, 0] = distance // itemsize
        self.base, self.num_tiles = base, len(table)
        self.table = torch.from_numpy(table).to(device)

    def amax_launch(self, amax_bits: torch.Tensor) -> KernelLaunch:
        """Every tile's row amaxes maxed into `amax_bits` (int32 view of the float32 cells)."""
        return KernelLaunch(_tile_kernels().fp8_tiles_amax_kernel, (self.num_tiles,),
                            dict(src_ptr=self.base, table_ptr=self.table, amax_ptr=amax_bits),
                            dict(BLOCK_N=TILE_BLOCK[0], BLOCK_K=TILE_BLOCK[1]), _TILE_WARPS)

    def cast_launch(self, scales: torch.Tensor, out_bits: torch.Tensor, software: bool | None = None) -> KernelLaunch:
        """Every tile cast with its groups' `scales` (float32 cells) into `out_bits`
        (uint8); `software`: the integer cast (default: what the device needs)."""
        software = software_fp8_cast(self.base.device) if software is None else software
        return KernelLaunch(_tile_kernels().fp8_tiles_cast_kernel, (self.num_tiles,),
                            dict(src_ptr=self.base, table_ptr=self.table, scale_ptr=scales, out_ptr=out_bits),
                            dict(BLOCK_N=TILE_BLOCK[0], BLOCK_K=TILE_BLOCK[1],
                                 SOFTWARE_FP8=software), _TILE_WARPS)


def tile_variants() -> list[tuple[str, KernelLaunch]]:
    """The grouped kernels' launches, per input dtype (and both casts), for kernel_check."""
    variants = []
    for dtype in INPUT_DTYPES:
        base = torch.empty((64, 256), dtype=dtype)
        rows = [[base.data_ptr(), 256, 0, 256, 32, 128, 0, 1], [base.data_ptr() + 128 * base.element_size(), 256,
                                                                128, 256, 32, 128, 2, 0]]
        tiles = Fp8Tiles(base, rows, torch.device("cpu"))
        cells, out = torch.empty(8, dtype=torch.float32), torch.empty(64 * 256, dtype=torch.uint8)
        name = str(dtype).removeprefix("torch.")
        variants.append((f"tiles amax {name}", tiles.amax_launch(cells.view(torch.int32))))
        for software in (False, True):
            variants.append((f"tiles cast {name}{', software cast' if software else ''}",
                             tiles.cast_launch(cells, out, software)))
    return variants


__all__ = [
    "GPU_TILINGS", "HARDWARE_E4M3_CAPABILITY", "INTERPRETER_MAX_ELEMS", "SWEEP_TILINGS", "TILE_BLOCK", "Fp8Tiles",
    "Fp8Tiling", "kernel_variants", "launch_amax", "launch_cast", "launch_quantize_fp8", "quant_kernels",
    "software_fp8_cast", "tile_variants", "triton_takes",
]
