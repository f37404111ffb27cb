"""Models the pipeline runs: the generator side's inference Llama."""

from .llama_generator import KVCache, LlamaGenerator, Rollout, sample_tokens

__all__ = ["KVCache", "LlamaGenerator", "Rollout", "sample_tokens"]
