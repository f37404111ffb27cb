"""Operators: host launchers, references and functional APIs (kernels in llamarl_core.kernels)."""

from .aipo import AIPOStats, aipo_loss, aipo_loss_ref, group_advantages, linear_aipo_loss
from .fp8 import dequantize_fp8, fp8_amax, quantize_fp8, quantize_fp8_ref, quantize_fp8_with_scale

__all__ = [
    "AIPOStats", "aipo_loss", "aipo_loss_ref", "dequantize_fp8", "fp8_amax", "group_advantages", "linear_aipo_loss",
    "quantize_fp8", "quantize_fp8_ref", "quantize_fp8_with_scale",
]
