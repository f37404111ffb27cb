"""The trainer side of a sync from a Hugging Face Llama-family model, plain or
sharded with FSDP2 `fully_shard` (dim-0 shards, `torch.chunk` sizes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .endpoints import DEFAULT_TIMEOUT_S, WeightSender
from .presets import hf_llama_fsdp


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """A parameter's storage on this rank (an FSDP2 DTensor's local shard), no copy."""
    return (param.to_local() if hasattr(param, "to_local") else param).detach()


def fsdp_sender(store: dist.Store, model: torch.nn.Module, rank: int, world_size: int, *, name: str = "weights",
                transport: str = "auto", timeout: float = DEFAULT_TIMEOUT_S,
                num_threads: int | None = None) -> WeightSender:
    """A WeightSender over `model`'s local shards, in place: `model` is a
    transformers Llama / Qwen2 / Mistral causal LM whose parameters are plain
    tensors (world_size 1) or FSDP2 shards over `world_size` ranks, all of one
    dtype. Its layout is `hf_llama_fsdp(model.config, world_size, dtype)`."""
    shards = {n: local_shard(p) for n, p in model.named_parameters()}
    dtypes = {t.dtype for t in shards.values()}
    if len(dtypes) != 1:
        raise ValueError(f"the trainer's parameters have several dtypes {sorted(map(str, dtypes))}; expected one")
    layout = hf_llama_fsdp(model.config, world_size, dtypes.pop())
    return WeightSender(store, layout, rank, shards, name=name, transport=transport, timeout=timeout,
                        num_threads=num_threads)
