"""FP8 (e4m3fn) quantization of weights: per tensor, per output channel, per block.

Semantics, the same bits on every path (Triton on GPU, Triton under
TRITON_INTERPRET=1, the torch CPU path):
    amax  = max |w_fp32| over the group (tensor; a row; a block_size block, ragged
            edge blocks using only their valid elements)
    scale = amax / 448 in float32, or 1.0 where that is 0 (an all-zero group), so
            the scale of a finite group is finite and positive
    q     = round_to_nearest_even(w_fp32 / scale), the division correctly rounded
            in float32, saturated to +-448, as float8_e4m3fn
    w    ~= q * scale (dequantize_fp8); `weight_scale_inv` in DeepSeek-V3 / vLLM
            block checkpoints is this same per-block scale.

NaN and inf: with check=True (the default of quantize_fp8, fp8_amax and
quantize_fp8_with_scale) a NaN or inf anywhere in `w` raises ValueError naming
the tensor, at the cost of one host sync per call. With check=False no call
syncs with the host (on a GPU: kernels only, nothing waits), and a group
holding NaN or inf gets an inf amax and an inf scale (its codes are
unspecified), on every path. Callers that quantize many tensors pass
check=False and check their scales (or amaxes) once, e.g.
`torch.isfinite(torch.cat([s.reshape(-1) for s in scales])).all()`.

Speed (H100, see Fp8Tiling and GPU_TILINGS): per channel and per block one
pass, reading the weight once; per tensor two kernels, a global amax pass and
the cast pass, which reads the amax from device memory.

File order: reference -> launchers (Triton kernels in llamarl_core.kernels) ->
CPU path -> functional API.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ._launch import KernelLaunch, next_pow2, use_interpreter

FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
GRANULARITIES = ("tensor", "channel", "block")
DEFAULT_BLOCK = (128, 128)
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- checks


def _check_input(w: torch.Tensor, granularity: str, block_size: tuple[int, int], name: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"{name}: granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if w.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D weight, got shape {tuple(w.shape)}")
    if w.dtype not in INPUT_DTYPES:
        raise ValueError(f"{name}: dtype must be bfloat16, float16 or float32, got {w.dtype}")
    if len(block_size) != 2 or min(block_size) < 1:
        raise ValueError(f"{name}: block_size must be two positive ints, got {block_size}")


def scale_shape(shape: tuple[int, int], granularity: str, block_size: tuple[int, int] = DEFAULT_BLOCK) -> tuple:
    """() per tensor, (N, 1) per channel, (ceil(N/bn), ceil(K/bk)) per block."""
    n, k = shape
    if granularity == "tensor":
        return ()
    if granularity == "channel":
        return (n, 1)
    return (-(-n // block_size[0]), -(-k // block_size[1]))


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 in float32, correctly rounded; 1.0 where that is 0. The quotient
    is taken in float64 and rounded once (the float64 quotient of a float32 by 448 =
    7 x 64 never sits on a float32 rounding midpoint, so no double rounding): a float32 tensor divided by a Python number on CUDA is a multiplication by its
    reciprocal, one unit in the last place off for some amaxes (an H100 gave
    932.5715 for 932.5714), which the Triton kernels' div_rn would not match."""
    scale = (amax.to(torch.float64) / FP8_MAX).to(torch.float32)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def raise_if_not_finite(amax: torch.Tensor, name: str) -> None:
    """A group's amax is NaN or inf exactly when the group holds a NaN or an inf."""
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"{name}: contains NaN or inf; refusing to quantize it to FP8")


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], granularity: str, block_size=DEFAULT_BLOCK) -> torch.Tensor:
    """The per-element scale (N, K) of a per-group scale."""
    n, k = shape
    if granularity == "tensor":
        return scale.reshape(1, 1).expand(n, k)
    if granularity == "channel":
        return scale.reshape(n, 1).expand(n, k)
    bn, bk = block_size
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


# ----------------------------------------------------------------------------- reference


def fp8_amax_ref(w: torch.Tensor, granularity: str, block_size=DEFAULT_BLOCK) -> torch.Tensor:
    """max |w| per group in float32 (NaN / inf propagate)."""
    a = w.to(torch.float32).abs()
    if granularity == "tensor":
        return a.max() if a.numel() else torch.zeros((), dtype=torch.float32)
    if granularity == "channel":
        return a.amax(dim=1, keepdim=True) if a.shape[1] else torch.zeros((a.shape[0], 1))
    n, k = a.shape
    bn, bk = block_size
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros((rows * bn, cols * bk), dtype=torch.float32)  # |w| >= 0: zero padding never wins
    padded[:n, :k] = a
    return padded.view(rows, bn, cols, bk).amax(dim=(1, 3))


def quantize_fp8_ref(w: torch.Tensor, granularity: str, block_size=DEFAULT_BLOCK, *, name: str = "weight"):
    """Plain torch, whole tensor at once: the reference every path is compared with."""
    _check_input(w, granularity, block_size, name)
    amax = fp8_amax_ref(w.cpu(), granularity, block_size)
    raise_if_not_finite(amax, name)
    scale = scale_from_amax(amax)
    return cast_fp8_ref(w.cpu(), expand_scale(scale, tuple(w.shape), granularity, block_size)), scale


def cast_fp8_ref(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """sat(RNE(w / scale)) in plain torch; `scale` broadcasts against w (e.g. (N, 1) per row)."""
    return (w.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block_size=DEFAULT_BLOCK, out_dtype=torch.float32) -> torch.Tensor:
    """q * scale, the granularity read off scale's shape: () tensor, (N, 1) channel, else block."""
    if q.dtype != FP8_DTYPE or q.dim() != 2:
        raise ValueError(f"q must be a 2-D float8_e4m3fn tensor, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    if scale.dim() == 0:
        granularity = "tensor"
    elif tuple(scale.shape) == (n, 1):
        granularity = "channel"
    elif tuple(scale.shape) == scale_shape((n, k), "block", block_size):
        granularity = "block"
    else:
        raise ValueError(f"scale of shape {tuple(scale.shape)} fits no granularity of q {tuple(q.shape)}")
    full = expand_scale(scale.to(torch.float32), (n, k), granularity, block_size)
    return (q.to(torch.float32) * full).to(out_dtype)


def e4m3_nearest_even_ref64(x: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn codes of float32 values (already within +-448), found by
    comparing against every finite e4m3fn value in float64: the nearest, ties to
    the even code. Independent of torch's own fp8 conversion."""
    codes = torch.arange(256, dtype=torch.int64)
    values = codes.to(torch.uint8).view(FP8_DTYPE).to(torch.float64)
    finite = torch.isfinite(values)
    codes, values = codes[finite], values[finite]
    x64 = x.reshape(-1, 1).to(torch.float64)
    dist = (x64 - values.reshape(1, -1)).abs()
    best = dist.min(dim=1, keepdim=True).values
    # Among ties, prefer an even mantissa (lowest bit 0); then keep the sign of x for zero.
    candidates = (dist == best) & ((codes.reshape(1, -1) & 1) == 0)
    candidates |= (dist == best) & ~candidates.any(dim=1, keepdim=True)
    sign_ok = (codes.reshape(1, -1) >= 128) == (torch.signbit(x.reshape(-1, 1).to(torch.float32)))
    pick = torch.where((candidates & sign_ok).any(dim=1, keepdim=True), candidates & sign_ok, candidates)
    return codes[pick.to(torch.int64).argmax(dim=1)].to(torch.uint8).reshape(x.shape)


# ----------------------------------------------------------------------------- Triton launchers


def _triton_kernels():
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
    kernels = _triton_kernels()
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
    kernels = _triton_kernels()
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


def _launch_amax(w: torch.Tensor, granularity: str, block_size, tiling: Fp8Tiling | None = None) -> torch.Tensor:
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


def _launch_cast(w, q_bits, scale, granularity: str, block_size) -> None:
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


# ----------------------------------------------------------------------------- CPU path


# Rows per chunk of the CPU path: 64 rows of a 16384-wide fp32 temporary is 4 MiB,
# cache-friendly and small next to any weight worth quantizing.
_CPU_CHUNK_ELEMS = 1 << 20


def _cpu_amax(w: torch.Tensor, granularity: str, block_size) -> torch.Tensor:
    """fp8_amax_ref without float32 temporaries: max |w| = max(max w, -min w),
    taken in w's own dtype (exact: every bf16 / fp16 value is a float32 value).
    A group holding NaN gets inf, as on the Triton path."""
    n, k = w.shape
    bn, bk = block_size
    if w.numel() == 0 or (granularity == "block" and (n % bn or k % bk)):
        amax = fp8_amax_ref(w, granularity, block_size)  # ragged edge blocks: pad like the reference
    else:
        if granularity == "tensor":
            low, high = torch.aminmax(w)
        elif granularity == "channel":
            low, high = torch.aminmax(w, dim=1, keepdim=True)
        else:
            blocks = w.reshape(n // bn, bn, k // bk, bk)
            low, high = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
        amax = torch.maximum(high.to(torch.float32), -low.to(torch.float32))
    return amax.masked_fill_(amax.isnan(), float("inf"))


def _cpu_quantize_into(w, q, scale, granularity, block_size) -> None:
    """Quantize `w` into q (fp8) with a known per-group `scale`, a row chunk at a time
    (whole block rows for block granularity), so the float32 temporary stays small."""
    n, k = w.shape
    step = max(1, _CPU_CHUNK_ELEMS // max(k, 1))
    if granularity == "block":
        step = max(block_size[0], step // block_size[0] * block_size[0])
    for start in range(0, n, step):
        stop = min(n, start + step)
        chunk = w[start:stop].to(torch.float32, copy=True)  # a float32 w must not be divided in place
        if granularity == "tensor":
            chunk.div_(scale)
        elif granularity == "channel":
            chunk.div_(scale[start:stop])
        else:
            bn, bk = block_size
            rows = scale[start // bn : -(-stop // bn)].repeat_interleave(bn, 0)[: stop - start]
            if k % bk == 0:  # broadcast over each block's columns instead of materialising them
                chunk.view(stop - start, k // bk, bk).div_(rows.unsqueeze(-1))
            else:
                chunk.div_(rows.repeat_interleave(bk, 1)[:, :k])
        # No clamp: |w / scale| <= 448 up to one rounding, and torch's e4m3fn cast
        # saturates (>= 464 -> 448), so it gives the same bits (tests check it).
        q[start:stop] = chunk.to(FP8_DTYPE)


# ----------------------------------------------------------------------------- functional API


BACKENDS = ("auto", "triton", "torch")


def fp8_amax(w: torch.Tensor, granularity: str, block_size=DEFAULT_BLOCK, *, name: str = "weight",
             backend: str = "auto", check: bool = True) -> torch.Tensor:
    """max |w| per group (float32, the shape of the scale). check: raise
    ValueError naming `name` on NaN / inf (one host sync); check=False: no sync,
    and a group holding NaN / inf gets an inf amax."""
    _check_input(w, granularity, block_size, name)
    amax = _launch_amax(w, granularity, block_size) if _triton_path(w, backend) else _cpu_amax(w, granularity, block_size)
    if check:
        raise_if_not_finite(amax, name)
    return amax.reshape(scale_shape(tuple(w.shape), granularity, block_size))


def cast_to_fp8(w, scale, granularity: str, block_size, out: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """The cast pass into `out` with a per-group `scale`, no checks: for callers
    that already ran fp8_amax (which refuses NaN / inf) on `w`."""
    if _triton_path(w, backend):
        _launch_cast(w, out.view(torch.uint8), scale.contiguous(), granularity, block_size)
    else:
        _cpu_quantize_into(w, out, scale, granularity, block_size)
    return out


def quantize_fp8_with_scale(w, scale, granularity: str, block_size=DEFAULT_BLOCK, *, out: torch.Tensor | None = None,
                            name: str = "weight", backend: str = "auto", check: bool = True) -> torch.Tensor:
    """q = sat(RNE(w / scale)) with a given per-group scale (e.g. an amax reduced
    across tensor-parallel ranks, through scale_from_amax). check: w is checked
    for NaN / inf first (one extra read and a host sync), so `out` is never
    written with a bad input; check=False: neither, for callers that checked
    the amaxes the scale came from (NaN / inf in w then give unspecified codes)."""
    _check_input(w, granularity, block_size, name)
    expected = scale_shape(tuple(w.shape), granularity, block_size)
    if tuple(scale.shape) != expected or scale.dtype != torch.float32:
        raise ValueError(f"{name}: scale must be float32 of shape {expected}, got {scale.dtype} {tuple(scale.shape)}")
    out = _check_out(out, w, name)
    if check and not bool(torch.isfinite(w).all()):
        raise ValueError(f"{name}: contains NaN or inf; refusing to quantize it to FP8")
    return cast_to_fp8(w, scale, granularity, block_size, out, backend)


def quantize_fp8(w: torch.Tensor, granularity: str, block_size=DEFAULT_BLOCK, *, name: str = "weight",
                 backend: str = "auto", check: bool = True):
    """Quantize a 2-D weight (bf16, fp16 or fp32; any strides) to float8_e4m3fn.

    Returns (q, scale): q of w's shape; scale float32 of shape () per tensor,
    (N, 1) per channel, (ceil(N/128), ceil(K/128)) per block. See the module doc
    for the exact semantics. check: raise ValueError naming `name` on NaN or inf
    (one host sync, after the kernels); check=False: no host sync at all, and a
    group holding NaN / inf gets an inf scale (its codes are unspecified).
    backend: "auto" (Triton for CUDA tensors and, under TRITON_INTERPRET=1, for
    CPU tensors up to INTERPRETER_MAX_ELEMS; torch otherwise), "triton" or "torch".
    """
    _check_input(w, granularity, block_size, name)
    if _triton_path(w, backend):
        q, scale = launch_quantize_fp8(w, granularity, block_size)
        if check:
            raise_if_not_finite(scale, name)  # the one host sync, after the kernels
        return q, scale
    scale = scale_from_amax(_cpu_amax(w, granularity, block_size))
    if check:
        raise_if_not_finite(scale, name)  # before the cast: no work spent on a bad input
    q = torch.empty(w.shape, dtype=FP8_DTYPE)
    _cpu_quantize_into(w, q, scale, granularity, block_size)
    return q, scale


def _check_out(out: torch.Tensor | None, w: torch.Tensor, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    if out.dtype != FP8_DTYPE or out.shape != w.shape or not out.is_contiguous() or out.device != w.device:
        raise ValueError(f"{name}: out must be a contiguous float8_e4m3fn tensor of shape {tuple(w.shape)} on {w.device}")
    return out


# The interpreter runs about 0.5 ms per program instance (measured on a 2-core CPU): past
# this many elements a CPU tensor goes to the torch path even when interpreting.
INTERPRETER_MAX_ELEMS = 1 << 22
_warned_fallback = False


def _triton_path(w: torch.Tensor, backend: str) -> bool:
    """Whether `w` goes to the Triton kernels. "triton" and "torch" are obeyed or
    raise; "auto" picks Triton for CUDA tensors and, under TRITON_INTERPRET=1, for
    CPU tensors up to INTERPRETER_MAX_ELEMS, and warns once if interpreting was
    asked for but triton is missing."""
    global _warned_fallback
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        if w.device.type != "cpu":
            raise ValueError(f"the torch FP8 path runs on CPU tensors, got a {w.device.type} tensor")
        return False
    if backend == "triton" or w.device.type == "cuda":
        if w.device.type == "cpu" and not use_interpreter():
            raise RuntimeError("the Triton FP8 kernels need a CUDA tensor, or TRITON_INTERPRET=1 for CPU tensors")
        try:
            _triton_kernels()
        except ImportError as exc:
            raise RuntimeError("the Triton FP8 kernels need triton (pip install triton)") from exc
        return True
    if not use_interpreter() or w.numel() > INTERPRETER_MAX_ELEMS:
        return False
    try:
        _triton_kernels()
    except ImportError:
        if not _warned_fallback:
            warnings.warn("TRITON_INTERPRET=1 but triton is not importable: using the torch CPU path", stacklevel=3)
            _warned_fallback = True
        return False
    return True


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


def tiles_path(device: torch.device, elements: int) -> bool:
    """Whether FP8 work of `elements` on `device` goes to the grouped Triton
    kernels: always on a GPU; on CPU under TRITON_INTERPRET=1 up to
    INTERPRETER_MAX_ELEMS (the torch path otherwise, as _triton_path decides)."""
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
    "FP8_MAX", "GPU_TILINGS", "GRANULARITIES", "INPUT_DTYPES", "SWEEP_TILINGS", "Fp8Tiling", "cast_fp8_ref",
    "cast_to_fp8", "dequantize_fp8", "e4m3_nearest_even_ref64", "expand_scale", "fp8_amax", "fp8_amax_ref",
    "launch_quantize_fp8", "quantize_fp8", "quantize_fp8_ref", "quantize_fp8_with_scale", "scale_from_amax",
    "scale_shape", "Fp8Tiles", "TILE_BLOCK", "tiles_path",
]
