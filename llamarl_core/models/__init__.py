"""Models the pipeline runs: the generator side's inference Llama."""

from .llama_generator import KVCache, LlamaGenerator

__all__ = ["KVCache", "LlamaGenerator"]
