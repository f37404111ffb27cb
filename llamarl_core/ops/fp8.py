"""FP8 (e4m3fn) quantization of weights: per tensor, per output channel, per block.

Semantics, the same bits on every path (Triton on GPU, Triton under
TRITON_INTERPRET=1, the torch CPU path):
    amax  = max |w_fp32| over the group (tensor; a row; a block_size block, ragged
            edge blocks using only their valid elements)
    scale = amax / 448 in float32, or 1.0 where that is 0 (an all-zero group), so
            a scale is always finite and positive
    q     = round_to_nearest_even(w_fp32 / scale), the division correctly rounded
            in float32, saturated to +-448, as float8_e4m3fn
    w    ~= q * scale (dequantize_fp8); `weight_scale_inv` in DeepSeek-V3 / vLLM
            block checkpoints is this same per-block scale.
A NaN or inf anywhere in `w` raises ValueError naming the tensor.

File order: reference -> launchers (Triton kernels in llamarl_core.kernels) ->
CPU path -> functional API.
"""

from __future__ import annotations

import warnings

import torch

from ._launch import KernelLaunch, use_interpreter

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


# Sub-tiles a program walks its region in. On a GPU, for sizes, strides and
# addresses that are multiples of 16 (every LLM weight: the JIT then vectorizes),
# 4096 elements, 16 per thread at 8 warps: at most 59 registers, no spills (a whole
# 128 x 128 block held at once took 92); otherwise 1024 elements (4096 took up to
# 254 registers unvectorized, 1024 at most 61). "wide" for rows longer than 512,
# "narrow" otherwise, so short rows do not leave most lanes masked. In the
# interpreter, where each operation costs the same whatever its size (about 0.5 ms
# per program instance), whole blocks and 64K-element tiles: the FP8 tests ran 3x
# longer with the GPU's.
_GPU_SUBTILES = {"block": (32, 128), "wide": (4, 1024), "narrow": (32, 128)}
_GPU_UNALIGNED_SUBTILES = {"block": (8, 128), "wide": (1, 1024), "narrow": (8, 128)}
_INTERPRETER_SUBTILES = {"block": (128, 128), "wide": (16, 4096), "narrow": (128, 128)}
_FP8_NUM_WARPS = 8


def _aligned(w: torch.Tensor) -> bool:
    """Whether the JIT gets its divisibility-by-16 hint on w's address, sizes and
    row stride, with a unit column stride (a constant to it): loads are then vectorized."""
    return w.data_ptr() % 16 == 0 and w.stride(1) == 1 and all(x % 16 == 0 for x in (*w.shape, w.stride(0)))


def _regions(w: torch.Tensor, granularity: str, block_size, on_gpu: bool) -> tuple[int, int, int, int]:
    """(GROUP_N, GROUP_K, BLOCK_N, BLOCK_K): what one program owns and the sub-tile
    it walks it in. A block: its block. A channel group: BLOCK_N whole rows (the
    row amax is complete within one program). Per tensor: one sub-tile (the scale is given)."""
    k = w.shape[1]
    subtiles = (_GPU_SUBTILES if _aligned(w) else _GPU_UNALIGNED_SUBTILES) if on_gpu else _INTERPRETER_SUBTILES
    bn, bk = subtiles["block" if granularity == "block" else "wide" if k > 512 else "narrow"]
    if granularity == "block":
        return block_size[0], block_size[1], bn, bk
    if granularity == "channel":
        return bn, max(k, 1), bn, bk
    return bn, bk, bn, bk


def _amax_shape(w: torch.Tensor, granularity: str, block_size, on_gpu: bool) -> tuple[int, int]:
    """What the amax kernel writes: one value per row (channel) or per program's region."""
    n, k = w.shape
    group_n, group_k, _, _ = _regions(w, granularity, block_size, on_gpu)
    return (n, 1) if granularity == "channel" else (-(-n // group_n), -(-k // group_k))


def _amax_launch(w: torch.Tensor, out: torch.Tensor, granularity: str, block_size, on_gpu: bool) -> KernelLaunch:
    """Per-row amax (channel; out (N, 1)) or per-region amax (out: _amax_shape)."""
    n, k = w.shape
    group_n, group_k, bn, bk = _regions(w, granularity, block_size, on_gpu)
    return KernelLaunch(
        _triton_kernels().fp8_amax_kernel, (-(-n // group_n), -(-k // group_k)),
        dict(w_ptr=w, out_ptr=out, N=n, K=k, stride_wn=w.stride(0), stride_wk=w.stride(1), GROUP_N=group_n,
             GROUP_K=group_k),
        dict(BLOCK_N=bn, BLOCK_K=bk, PER_ROW=granularity == "channel"), _FP8_NUM_WARPS)


def _quantize_launch(w, q_bits, scale, granularity: str, block_size, compute_scale: bool, software_fp8: bool,
                     on_gpu: bool) -> KernelLaunch:
    """The cast (and, with compute_scale, the fused amax and scale) of `w` into
    q_bits (uint8, contiguous); `scale` is read, or written when compute_scale."""
    n, k = w.shape
    group_n, group_k, bn, bk = _regions(w, granularity, block_size, on_gpu)
    return KernelLaunch(
        _triton_kernels().fp8_quantize_kernel, (-(-n // group_n), -(-k // group_k)),
        dict(w_ptr=w, q_ptr=q_bits, scale_ptr=scale, N=n, K=k, stride_wn=w.stride(0), stride_wk=w.stride(1),
             stride_qn=q_bits.stride(0), stride_sn=scale.stride(0) if scale.dim() >= 1 else 0, GROUP_N=group_n,
             GROUP_K=group_k),
        dict(BLOCK_N=bn, BLOCK_K=bk, SCALE_MODE={"tensor": 0, "channel": 1, "block": 2}[granularity],
             COMPUTE_SCALE=compute_scale, SOFTWARE_FP8=software_fp8), _FP8_NUM_WARPS)


# The first compute capability with an e4m3 conversion instruction (Ada, sm_89).
HARDWARE_E4M3_CAPABILITY = (8, 9)


def software_fp8_cast(device: torch.device) -> bool:
    """Whether the kernels cast to e4m3 with integer arithmetic: in the interpreter
    (its own cast rounds wrongly) and on GPUs before sm_89 (no e4m3 conversion
    instruction: A100, A10); the hardware cast (round to nearest even, saturating) otherwise."""
    if device.type != "cuda" or use_interpreter():
        return True
    return torch.cuda.get_device_capability(device) < HARDWARE_E4M3_CAPABILITY


def _launch_amax(w: torch.Tensor, granularity: str, block_size) -> torch.Tensor:
    """Per-group amax with the Triton reduction kernel (tensor: the max of per-tile amaxes)."""
    n, k = w.shape
    if w.numel() == 0:
        return torch.zeros(scale_shape((n, k), granularity, block_size), dtype=torch.float32, device=w.device)
    on_gpu = w.device.type == "cuda"
    out = torch.empty(_amax_shape(w, granularity, block_size, on_gpu), dtype=torch.float32, device=w.device)
    _amax_launch(w, out, granularity, block_size, on_gpu).launch(w.device)
    return out.amax() if granularity == "tensor" else out


def _launch_quantize(w, q_bits, scale, granularity: str, block_size, compute_scale: bool) -> None:
    """One fused pass (amax, scale, cast, both stores) for channel / block groups
    with compute_scale; the cast pass alone with a given scale (per tensor, or
    scales reduced across ranks)."""
    if w.numel() == 0:
        if compute_scale:
            scale.fill_(1.0)  # an empty group is an all-zero group
        return
    _quantize_launch(w, q_bits, scale, granularity, block_size, compute_scale, software_fp8_cast(w.device),
                     w.device.type == "cuda").launch(w.device)


def kernel_variants() -> list[tuple[str, KernelLaunch]]:
    """Every launch the launchers above can make, on small CPU tensors standing in
    for CUDA ones: what a GPU must compile. Besides dtype, granularity and the
    cast, the variant depends on the shape only through _regions (K above or
    below 512)."""
    variants = []
    # Sizes multiples of 16 (the JIT's divisibility hint on sizes and strides, every
    # LLM weight), and for bf16 also sizes that are not (vectorized loads off).
    shapes = [(dtype, n, k) for dtype in INPUT_DTYPES for n, k in ((256, 1024), (256, 256))]
    shapes += [(torch.bfloat16, 250, 1030), (torch.bfloat16, 250, 200)]
    for dtype, n, k in shapes:
        w = torch.empty((n, k), dtype=dtype)
        q = torch.empty((n, k), dtype=torch.uint8)
        for granularity in GRANULARITIES:
            tag = (f"{granularity}, {str(dtype).removeprefix('torch.')}, K {'> 512' if k > 512 else '<= 512'}"
                   f"{'' if n % 16 == 0 else ', sizes not multiples of 16'}")
            amax = torch.empty(_amax_shape(w, granularity, DEFAULT_BLOCK, True), dtype=torch.float32)
            variants.append((f"amax {tag}", _amax_launch(w, amax, granularity, DEFAULT_BLOCK, True)))
            scale = torch.empty(scale_shape((n, k), granularity), dtype=torch.float32)
            for compute in (False, True) if granularity != "tensor" else (False,):
                for software in (False, True):
                    name = f"quantize {tag}{'' if compute else ', scale given'}{', software cast' if software else ''}"
                    variants.append((name, _quantize_launch(w, q, scale, granularity, DEFAULT_BLOCK, compute,
                                                            software, on_gpu=True)))
    return variants


# ----------------------------------------------------------------------------- CPU path


# Rows per chunk of the CPU path: 64 rows of a 16384-wide fp32 temporary is 4 MiB,
# cache-friendly and small next to any weight worth quantizing.
_CPU_CHUNK_ELEMS = 1 << 20


def _cpu_amax(w: torch.Tensor, granularity: str, block_size) -> torch.Tensor:
    """fp8_amax_ref without float32 temporaries: max |w| = max(max w, -min w),
    taken in w's own dtype (exact: every bf16 / fp16 value is a float32 value)."""
    n, k = w.shape
    bn, bk = block_size
    if w.numel() == 0 or (granularity == "block" and (n % bn or k % bk)):
        return fp8_amax_ref(w, granularity, block_size)  # ragged edge blocks: pad like the reference
    if granularity == "tensor":
        low, high = torch.aminmax(w)
    elif granularity == "channel":
        low, high = torch.aminmax(w, dim=1, keepdim=True)
    else:
        blocks = w.reshape(n // bn, bn, k // bk, bk)
        low, high = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    return torch.maximum(high.to(torch.float32), -low.to(torch.float32))


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
             backend: str = "auto") -> torch.Tensor:
    """max |w| per group (float32, the shape of the scale); raises on NaN / inf."""
    _check_input(w, granularity, block_size, name)
    amax = _launch_amax(w, granularity, block_size) if _triton_path(w, backend) else _cpu_amax(w, granularity, block_size)
    raise_if_not_finite(amax, name)
    return amax.reshape(scale_shape(tuple(w.shape), granularity, block_size))


def cast_to_fp8(w, scale, granularity: str, block_size, out: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """The cast pass into `out` with a per-group `scale`, no checks: for callers
    that already ran fp8_amax (which refuses NaN / inf) on `w`."""
    if _triton_path(w, backend):
        _launch_quantize(w, out.view(torch.uint8), scale.contiguous(), granularity, block_size, compute_scale=False)
    else:
        _cpu_quantize_into(w, out, scale, granularity, block_size)
    return out


def quantize_fp8_with_scale(w, scale, granularity: str, block_size=DEFAULT_BLOCK, *, out: torch.Tensor | None = None,
                            name: str = "weight", backend: str = "auto") -> torch.Tensor:
    """q = sat(RNE(w / scale)) with a given per-group scale (e.g. an amax reduced
    across tensor-parallel ranks, through scale_from_amax). Checks w for NaN / inf
    first (one extra read), so `out` is never written with a bad input."""
    _check_input(w, granularity, block_size, name)
    expected = scale_shape(tuple(w.shape), granularity, block_size)
    if tuple(scale.shape) != expected or scale.dtype != torch.float32:
        raise ValueError(f"{name}: scale must be float32 of shape {expected}, got {scale.dtype} {tuple(scale.shape)}")
    out = _check_out(out, w, name)
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{name}: contains NaN or inf; refusing to quantize it to FP8")
    return cast_to_fp8(w, scale, granularity, block_size, out, backend)


def quantize_fp8(w: torch.Tensor, granularity: str, block_size=DEFAULT_BLOCK, *, name: str = "weight",
                 backend: str = "auto"):
    """Quantize a 2-D weight (bf16, fp16 or fp32; any strides) to float8_e4m3fn.

    Returns (q, scale): q of w's shape; scale float32 of shape () per tensor,
    (N, 1) per channel, (ceil(N/128), ceil(K/128)) per block. See the module doc
    for the exact semantics. Raises ValueError naming `name` on NaN or inf.
    backend: "auto" (Triton for CUDA tensors and, under TRITON_INTERPRET=1, for
    CPU tensors up to INTERPRETER_MAX_ELEMS; torch otherwise), "triton" or "torch".
    """
    _check_input(w, granularity, block_size, name)
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    if granularity == "tensor" or not _triton_path(w, backend):
        # Per tensor needs the global amax first: a reduction pass, then the cast pass.
        scale = scale_from_amax(fp8_amax(w, granularity, block_size, name=name, backend=backend))
        return cast_to_fp8(w, scale, granularity, block_size, q, backend), scale
    scale = torch.empty(scale_shape(tuple(w.shape), granularity, block_size), dtype=torch.float32, device=w.device)
    _launch_quantize(w, q.view(torch.uint8), scale, granularity, block_size, compute_scale=True)
    raise_if_not_finite(scale, name)  # a group holding NaN / inf gets an inf scale
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


__all__ = [
    "FP8_MAX", "GRANULARITIES", "INPUT_DTYPES", "cast_fp8_ref", "cast_to_fp8", "dequantize_fp8", "e4m3_nearest_even_ref64", "expand_scale", "fp8_amax",
    "fp8_amax_ref", "quantize_fp8", "quantize_fp8_ref", "quantize_fp8_with_scale", "scale_from_amax", "scale_shape",
]
