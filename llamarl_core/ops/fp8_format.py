"""The FP8 weight format: float8_e4m3fn codes with float32 scales per tensor, per
output channel or per block, its exact semantics, the helpers every path shares,
and the plain-torch references every path is compared with.

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

The op is ops/fp8.py, its Triton launchers ops/fp8_launch.py.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
GRANULARITIES = ("tensor", "channel", "block")
DEFAULT_BLOCK = (128, 128)
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_scale_name(name: str, granularity: str) -> str:
    """vLLM's name of an FP8 weight's scale: `weight_scale_inv` per 128 x 128 block
    (DeepSeek-V3 checkpoints), `weight_scale` per tensor and per channel."""
    base = name[: -len("weight")] if name.endswith("weight") else name + "_"
    return base + ("weight_scale_inv" if granularity == "block" else "weight_scale")


# ----------------------------------------------------------------------------- checks


def check_input(w: torch.Tensor, granularity: str, block_size: tuple[int, int], name: str) -> None:
    """ValueError naming `name` for a weight, granularity or block size the FP8 ops do not take."""
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
    is taken in float64 and rounded once (the float64 quotient of a float32 by
    448 = 7 x 64 never sits on a float32 rounding midpoint, so no double
    rounding): a float32 tensor divided by a Python number on CUDA is a
    multiplication by its reciprocal, one unit in the last place off for some
    amaxes (an H100 gave 932.5715 for 932.5714), which the Triton kernels'
    div_rn would not match."""
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
    check_input(w, granularity, block_size, name)
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


__all__ = [
    "DEFAULT_BLOCK", "FP8_DTYPE", "FP8_MAX", "GRANULARITIES", "INPUT_DTYPES", "cast_fp8_ref", "check_input",
    "dequantize_fp8", "e4m3_nearest_even_ref64", "expand_scale", "fp8_amax_ref", "quantize_fp8_ref",
    "raise_if_not_finite", "scale_from_amax", "scale_shape",
]
