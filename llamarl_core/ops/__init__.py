"""Operators: host launchers, references and functional APIs (kernels in llamarl_core.kernels)."""

from .aipo import AIPOStats, aipo_loss, aipo_loss_ref, group_advantages, linear_aipo_loss
from .fp8 import dequantize_fp8, fp8_amax, quantize_fp8, quantize_fp8_ref, quantize_fp8_with_scale
from .fp8_linear import fp8_gemm_refusal, fp8_linear, fp8_linear_ref
from .logprob import linear_token_logprobs, token_logprobs, token_logprobs_ref
from .objectives import DEFAULTS, LOSS_TYPES, Objective

__all__ = [
    "AIPOStats", "DEFAULTS", "LOSS_TYPES", "aipo_loss", "aipo_loss_ref", "dequantize_fp8", "fp8_amax",
    "fp8_gemm_refusal", "fp8_linear", "fp8_linear_ref", "group_advantages", "linear_aipo_loss",
    "linear_token_logprobs", "Objective", "quantize_fp8", "quantize_fp8_ref", "quantize_fp8_with_scale",
    "token_logprobs", "token_logprobs_ref",
]
