"""Operators: host launchers, references and functional APIs (kernels in llamarl_core.kernels)."""

from .fp8 import dequantize_fp8, fp8_amax, quantize_fp8, quantize_fp8_ref, quantize_fp8_with_scale

__all__ = ["dequantize_fp8", "fp8_amax", "quantize_fp8", "quantize_fp8_ref", "quantize_fp8_with_scale"]
