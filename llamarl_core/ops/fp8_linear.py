"""FP8 linear layer as one FP8 GEMM: y = x W^T with W in float8_e4m3fn and a
float32 scale per output channel, x quantized to FP8 per token (row) as it comes
("dynamic per-token activations", as inference engines run FP8 checkpoints).

    y[m, n] = sum_k (xq[m, k] x sx[m]) x (wq[n, k] x sw[n]),  accumulated in float32

xq, sx: `quantize_fp8(x, "channel")` of the rows of x (the Triton kernels on a GPU:
no host sync); the GEMM is `torch._scaled_mm` with row-wise scales (cuBLAS /
CUTLASS FP8 tensor cores from sm_89 on), which reads W's one byte per weight
where a dequantize-then-GEMM reads it, writes a float copy and reads that again.

The activations' scales are vLLM's dynamic per-token scheme for FP8 checkpoints
(amax / 448 per row; vLLM also floors the scale at 1 / (448 x 512), which moves
only rows whose amax is under about 2e-3). A per-tensor scale (or one per fused
part) is a per-channel one repeated; a per-128 x 128-block scale is not a
row-wise one, and is refused here (a layer with block scales dequantizes:
Fp8Linear).
"""

from __future__ import annotations

import functools

import torch

from .fp8 import FP8_DTYPE, quantize_fp8

# torch._scaled_mm with row-wise scales: FP8 tensor cores from sm_89 (Ada) on, a
# bf16 output, and K and N multiples of 16 (the FP8 operands' 16-byte alignment).
MIN_CAPABILITY = (8, 9)
ALIGNMENT = 16
GEMMS = ("auto", "fp8", "dequantize")  # how an FP8 layer multiplies (Fp8Linear's `gemm`)


@functools.lru_cache(maxsize=None)
def _device_refusal(index: int) -> str | None:
    """Why CUDA device `index` runs no row-wise FP8 GEMM, or None: its capability,
    then one 16 x 16 x 16 GEMM tried there (what a torch build, a platform or a
    GPU lacks, e.g. row-wise kernels not built for it, is its error). Once per
    device and process."""
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < MIN_CAPABILITY:
        return f"cuda:{index} is sm_{major}{minor}; FP8 tensor cores start at sm_89"
    device = torch.device("cuda", index)
    a = torch.zeros(ALIGNMENT, ALIGNMENT, dtype=FP8_DTYPE, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(ALIGNMENT, 1, device=device),
                         scale_b=torch.ones(1, ALIGNMENT, device=device),
                         bias=torch.zeros(ALIGNMENT, dtype=torch.bfloat16, device=device), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as error:
        return f"torch {torch.__version__} runs no row-wise FP8 GEMM on cuda:{index}: {str(error).splitlines()[0]}"
    return None


def fp8_gemm_refusal(x_dtype: torch.dtype, device: torch.device, out_features: int, in_features: int) -> str | None:
    """Why an FP8 GEMM of (out_features, in_features) weights with `x_dtype`
    activations on `device` cannot run, or None when it can. On CPU it runs
    (torch's reference kernel, for checking): slower than a bf16 GEMM there."""
    if x_dtype != torch.bfloat16:
        return f"activations are {x_dtype}, and the row-wise FP8 GEMM writes bfloat16 only"
    if out_features % ALIGNMENT or in_features % ALIGNMENT:
        return f"weight ({out_features}, {in_features}) is not a multiple of {ALIGNMENT} in both dims"
    if device.type == "cuda":
        if torch.version.hip is not None:
            return "ROCm's FP8 GEMM takes float8_e4m3fnuz, not the float8_e4m3fn weights held here"
        return _device_refusal(device.index if device.index is not None else torch.cuda.current_device())
    if device.type != "cpu":
        return f"no FP8 GEMM on {device.type}"
    return None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + bias for x (..., K) bfloat16, `weight` (N, K) float8_e4m3fn,
    contiguous, `weight_scale` float32 with one value per output channel (N or
    N x 1 of them), `bias` (N,) bfloat16 or None (added in the GEMM's float32
    epilogue). Returns (..., N) bfloat16. No host sync. A row of x holding NaN or
    inf gets an inf scale, so its outputs are not finite either.
    ValueError (naming what) when fp8_gemm_refusal gives a reason."""
    n, k = weight.shape
    if weight.dtype != FP8_DTYPE or not weight.is_contiguous() or weight.data_ptr() % ALIGNMENT:
        raise ValueError(f"fp8_linear: weight must be a contiguous {FP8_DTYPE} tensor at a {ALIGNMENT}-byte aligned "
                         f"address, got {weight.dtype} with strides {weight.stride()}")
    if x.shape[-1] != k or weight.device != x.device:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} on {x.device} against weight {(n, k)} on {weight.device}")
    # By shape, not count: a block scale of (N / 128, K / 128) can hold N values too.
    if (weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) not in ((n,), (n, 1))
            or weight_scale.device != x.device):
        raise ValueError(f"fp8_linear: weight_scale must be float32 of shape ({n},) or ({n}, 1) (one a channel) on "
                         f"{x.device}, got {weight_scale.dtype} {tuple(weight_scale.shape)} on {weight_scale.device}")
    if bias is not None and (bias.dtype != torch.bfloat16 or tuple(bias.shape) != (n,) or bias.device != x.device):
        raise ValueError(f"fp8_linear: bias must be bfloat16 of shape ({n},) on {x.device}, got {bias.dtype} "
                         f"{tuple(bias.shape)} on {bias.device}")
    reason = fp8_gemm_refusal(x.dtype, x.device, n, k)
    if reason is not None:
        raise ValueError(f"fp8_linear: {reason}")
    rows = x.reshape(-1, k)
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], n)
    xq, x_scale = quantize_fp8(rows, "channel", name="activations", check=False)  # x_scale (M, 1)
    # weight.t() is the column-major (K, N) operand the FP8 GEMM takes, with no copy.
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.reshape(1, n).contiguous(), bias=bias,
                         out_dtype=torch.bfloat16)
    return y.reshape(*x.shape[:-1], n)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear in float64 (the same per-token FP8 activations, from the
    reference quantizer), for checking it."""
    from .fp8 import quantize_fp8_ref

    n, k = weight.shape
    rows = x.reshape(-1, k)
    xq, x_scale = quantize_fp8_ref(rows, "channel", name="activations")
    a = xq.to(torch.float64) * x_scale.to(torch.float64)
    w = weight.to(torch.float64) * weight_scale.reshape(n, 1).to(torch.float64)
    y = a @ w.T + (0 if bias is None else bias.to(torch.float64))
    return y.reshape(*x.shape[:-1], n)
