"""FP8 (e4m3fn) quantization of weights, per tensor, per output channel or per
block: quantize_fp8, fp8_amax, quantize_fp8_with_scale and cast_to_fp8, on the
Triton kernels (ops/fp8_launch.py: CUDA tensors, and CPU tensors under
TRITON_INTERPRET=1) or the torch CPU path below, the same bits on every path.
The semantics and the references: ops/fp8_format.py (its constants, scale
helpers and references are importable from here too).

NaN and inf: with check=True (the default of quantize_fp8, fp8_amax and
quantize_fp8_with_scale) a NaN or inf anywhere in `w` raises ValueError naming
the tensor, at the cost of one host sync per call. With check=False no call
syncs with the host (on a GPU: kernels only, nothing waits), and a group
holding NaN or inf gets an inf amax and an inf scale (its codes are
unspecified), on every path. Callers that quantize many tensors pass
check=False and check their scales (or amaxes) once, e.g.
`torch.isfinite(torch.cat([s.reshape(-1) for s in scales])).all()`.

File order: CPU path -> functional API.
"""

from __future__ import annotations

import warnings

import torch

from ._launch import use_interpreter
from .fp8_format import (DEFAULT_BLOCK, FP8_DTYPE, FP8_MAX, GRANULARITIES, INPUT_DTYPES, cast_fp8_ref, check_input,
                         dequantize_fp8, e4m3_nearest_even_ref64, expand_scale, fp8_amax_ref, quantize_fp8_ref,
                         raise_if_not_finite, scale_from_amax, scale_shape)
from .fp8_launch import launch_amax, launch_cast, launch_quantize_fp8, quant_kernels, triton_takes


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
    check_input(w, granularity, block_size, name)
    amax = launch_amax(w, granularity, block_size) if _triton_path(w, backend) else _cpu_amax(w, granularity, block_size)
    if check:
        raise_if_not_finite(amax, name)
    return amax.reshape(scale_shape(tuple(w.shape), granularity, block_size))


def cast_to_fp8(w, scale, granularity: str, block_size, out: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """The cast pass into `out` with a per-group `scale`, no checks: for callers
    that already ran fp8_amax (which refuses NaN / inf) on `w`."""
    if _triton_path(w, backend):
        launch_cast(w, out.view(torch.uint8), scale.contiguous(), granularity, block_size)
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
    check_input(w, granularity, block_size, name)
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
    check_input(w, granularity, block_size, name)
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
            quant_kernels()
        except ImportError as exc:
            raise RuntimeError("the Triton FP8 kernels need triton (pip install triton)") from exc
        return True
    if not triton_takes(w.device, w.numel()):
        return False
    try:
        quant_kernels()
    except ImportError:
        if not _warned_fallback:
            warnings.warn("TRITON_INTERPRET=1 but triton is not importable: using the torch CPU path", stacklevel=3)
            _warned_fallback = True
        return False
    return True


__all__ = [
    "BACKENDS", "DEFAULT_BLOCK", "FP8_DTYPE", "FP8_MAX", "GRANULARITIES", "INPUT_DTYPES", "cast_fp8_ref", "cast_to_fp8",
    "dequantize_fp8", "e4m3_nearest_even_ref64", "expand_scale", "fp8_amax", "fp8_amax_ref", "quantize_fp8",
    "quantize_fp8_ref", "quantize_fp8_with_scale", "scale_from_amax", "scale_shape",
]
