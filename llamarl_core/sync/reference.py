"""Reference resharding in plain torch, independent of layouts and the planner.

Tests and benchmarks compare every sync against these: the trainer's FSDP shards
are `torch.chunk` pieces of the full Hugging Face tensors, and the generator's
tensor-parallel tensors are built by slicing and concatenating the full tensors
the way vLLM's loaders do.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..ops.fp8_format import fp8_scale_name

VOCAB_PADDING = 64


def reference_fsdp_shards(
    state_dict: Mapping[str, torch.Tensor], world_size: int, dtype: torch.dtype
) -> dict[int, dict[str, torch.Tensor]]:
    """rank -> name -> `torch.chunk(t, world_size)[rank]` (empty where chunk gives fewer pieces).

    Tied parameters are sharded once: a model's state_dict() names a tensor that
    several modules share under each of them (with tie_word_embeddings=True,
    `lm_head.weight` is `model.embed_tokens.weight`); only the first name that
    holds it is kept, the one named_parameters() yields, and its later aliases
    (the same memory, dtype, shape and strides) are left out. ValueError, before
    anything is copied, for what this cannot describe: a tensor that overlaps
    another's memory without being the same view of it, a 0-dim tensor (FSDP
    shards dim 0), a meta tensor (no memory to tell an alias by).
    """
    distinct = _without_tied_aliases(state_dict)
    shards: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(world_size)}
    for name, full in distinct.items():
        pieces = torch.chunk(full.detach().to(dtype), world_size, dim=0)
        for rank in range(world_size):
            piece = pieces[rank] if rank < len(pieces) else full.new_empty((0, *full.shape[1:]), dtype=dtype)
            shards[rank][name] = piece.contiguous().clone()
    return shards


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset())


def _without_tied_aliases(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """state_dict in its order without the later names of a tensor (see
    reference_fsdp_shards). Memory is compared by byte span within one storage."""
    kept: dict[str, torch.Tensor] = {}
    spans: dict[tuple, list[tuple[int, int, str]]] = {}  # (device, storage address) -> (first byte, end, name)
    for name, t in state_dict.items():
        if t.dim() == 0:
            raise ValueError(f"{name!r} is 0-dim: FSDP shards parameters on dim 0")
        if t.device.type == "meta":
            raise ValueError(f"{name!r} is a meta tensor: no memory to tell a tied alias by")
        alias = None
        if t.numel():  # an empty tensor has no bytes to share
            start = t.storage_offset() * t.element_size()
            end = start + (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()
            storage = spans.setdefault((t.device, t.untyped_storage().data_ptr()), [])
            for other_start, other_end, other in storage:
                if start < other_end and other_start < end:
                    if not _same_view(t, kept[other]):
                        raise ValueError(f"{name!r} overlaps {other!r} in memory without being the same tensor: "
                                         "it cannot be sharded on its own")
                    alias = other
                    break
            if alias is None:
                storage.append((start, end, name))
        if alias is None:
            kept[name] = t
    return kept


def _kv_rows(t: torch.Tensor, num_kv_heads: int, tp_size: int, rank: int) -> torch.Tensor:
    if tp_size <= num_kv_heads:
        return torch.chunk(t, tp_size, dim=0)[rank]
    per_head = torch.chunk(t, num_kv_heads, dim=0)
    return per_head[rank // (tp_size // num_kv_heads)]


def reference_vllm_tp_shards(
    state_dict: Mapping[str, torch.Tensor], config, tp_size: int, dtype: torch.dtype
) -> dict[int, dict[str, torch.Tensor]]:
    """rank -> vLLM parameter name -> tensor, from full Hugging Face tensors."""
    num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    sd = {k: v.detach().to(dtype) for k, v in state_dict.items()}
    out: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(tp_size)}
    for rank in range(tp_size):
        shard = out[rank]
        for name, t in sd.items():
            prefix, _, kind = name.rpartition(".")
            if ".self_attn.q_proj." in name:
                base = prefix.rsplit(".", 1)[0]
                k, v = sd[f"{base}.k_proj.{kind}"], sd[f"{base}.v_proj.{kind}"]
                shard[f"{base}.qkv_proj.{kind}"] = torch.cat(
                    [torch.chunk(t, tp_size, 0)[rank], _kv_rows(k, num_kv, tp_size, rank), _kv_rows(v, num_kv, tp_size, rank)]
                )
            elif ".mlp.gate_proj." in name:
                base = prefix.rsplit(".", 1)[0]
                up = sd[f"{base}.up_proj.{kind}"]
                shard[f"{base}.gate_up_proj.{kind}"] = torch.cat(
                    [torch.chunk(t, tp_size, 0)[rank], torch.chunk(up, tp_size, 0)[rank]]
                )
            elif any(p in name for p in (".k_proj.", ".v_proj.", ".up_proj.")):
                continue
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                shard[name] = torch.chunk(t, tp_size, 1)[rank]
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                padded = -(-t.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
                full = torch.zeros((padded, t.shape[1]), dtype=dtype)
                full[: t.shape[0]] = t
                shard[name] = torch.chunk(full, tp_size, 0)[rank]
            else:  # norms, o_proj / down_proj biases: replicated
                shard[name] = t
        out[rank] = {k: v.contiguous().clone() for k, v in shard.items()}
    return out


def reference_vllm_fp8_shards(
    state_dict: Mapping[str, torch.Tensor], config, tp_size: int, granularity: str, dtype: torch.dtype = torch.bfloat16,
    source_dtype: torch.dtype | None = None,
) -> dict[int, dict[str, torch.Tensor]]:
    """`reference_vllm_tp_shards` with the linear weights quantized to FP8 the way
    vLLM lays them out: per block on the local tensor; per channel on local rows,
    except o_proj / down_proj (split on dim 1) whose rows are whole only in the
    full tensor; per tensor from the full tensor, one scale per fused part.
    source_dtype: the dtype of the values quantized (the trainer's: a sync
    quantizes its senders' tensors; default `dtype`); the rest is in `dtype`."""
    from ..ops.fp8 import cast_fp8_ref, quantize_fp8_ref, scale_from_amax

    num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    source_dtype = dtype if source_dtype is None else source_dtype
    shards = reference_vllm_tp_shards(state_dict, config, tp_size, dtype)
    sources = reference_vllm_tp_shards(state_dict, config, tp_size, source_dtype)
    full = {k: v.detach().to(source_dtype) for k, v in state_dict.items()}
    amax = lambda t, dim=None: t.to(torch.float32).abs().amax() if dim is None else t.to(torch.float32).abs().amax(dim)  # noqa: E731
    for rank, shard in shards.items():
        for name in [n for n in shard if n.endswith(("qkv_proj.weight", "gate_up_proj.weight", "o_proj.weight", "down_proj.weight"))]:
            local = sources[rank][name]
            base = name.rsplit(".", 2)[0]
            row_split = name.endswith(("o_proj.weight", "down_proj.weight"))
            if granularity == "block" or (granularity == "channel" and not row_split):
                q, scale = quantize_fp8_ref(local, granularity)
            elif granularity == "channel":
                scale = scale_from_amax(amax(full[name], 1)).reshape(-1, 1)
                q = cast_fp8_ref(local, scale)
            elif row_split:
                scale = scale_from_amax(amax(full[name]))
                q = cast_fp8_ref(local, scale)
            else:
                if name.endswith("qkv_proj.weight"):
                    parts = [f"{base}.q_proj.weight", f"{base}.k_proj.weight", f"{base}.v_proj.weight"]
                    kv_rows = head_dim * max(1, num_kv // tp_size)
                    rows = [full[parts[0]].shape[0] // tp_size, kv_rows, kv_rows]
                else:
                    parts = [f"{base}.gate_proj.weight", f"{base}.up_proj.weight"]
                    rows = [full[parts[0]].shape[0] // tp_size] * 2
                scale = scale_from_amax(torch.stack([amax(full[p]) for p in parts]))
                q = cast_fp8_ref(local, torch.cat([scale[i].expand(r) for i, r in enumerate(rows)]).reshape(-1, 1))
            shard[name] = q
            shard[fp8_scale_name(name, granularity)] = scale
    return shards
