"""Triton device code, installed as `llamarl_core.kernels`.

Kernels here take pointers, strides and sizes and know nothing of the pipeline;
their launchers live in `llamarl_core.ops`.
"""
