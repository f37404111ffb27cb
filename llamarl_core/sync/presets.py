"""Layout presets for the Llama family (Llama, Qwen2 with q/k/v bias, Mistral):
the trainer's (FSDP) and vLLM's tensor-parallel layout of its parameters. The
family itself (which configs, their dimensions and parameter names) is
models/llama_family.py's.

`config` is any object with the Hugging Face field names (`transformers.LlamaConfig`,
`Qwen2Config`, `MistralConfig`, or a SimpleNamespace): hidden_size,
intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
vocab_size, tie_word_embeddings, and optionally head_dim, attention_bias, mlp_bias,
model_type.
"""

from __future__ import annotations

import torch

from ..models.llama_family import VLLM_VOCAB_PADDING, LlamaDims, hf_llama_shapes, llama_dims
from .layout import Fused, FusedPart, Layout, ParamSpec, Replicate, Shard

def hf_llama_fsdp(config, world_size: int, dtype: torch.dtype) -> Layout:
    """Trainer layout: Hugging Face names, every parameter split on dim 0 as
    `torch.chunk(t, world_size)` splits it (FSDP2 `Shard(0)` local tensors)."""
    return Layout(
        world_size,
        [ParamSpec(name, shape, dtype, Shard(0)) for name, shape in hf_llama_shapes(config).items()],
    )


def _even_ranges(rows: int, tp_size: int, what: str) -> tuple[tuple[int, int], ...]:
    if rows % tp_size:
        raise ValueError(f"{what}: {rows} is not divisible by tp_size {tp_size}")
    step = rows // tp_size
    return tuple((r * step, (r + 1) * step) for r in range(tp_size))


def _kv_head_ranges(d: LlamaDims, tp_size: int) -> tuple[tuple[int, int], ...]:
    """Rows of k_proj / v_proj per TP rank. With tp_size > num_kv_heads each KV head
    is replicated on tp_size / num_kv_heads consecutive ranks (vLLM's rule)."""
    if tp_size <= d.num_kv_heads:
        return _even_ranges(d.num_kv_heads * d.head_dim, tp_size, "num_key_value_heads * head_dim")
    if tp_size % d.num_kv_heads:
        raise ValueError(
            f"tp_size {tp_size} > num_key_value_heads {d.num_kv_heads} must be a multiple of it"
        )
    replicas = tp_size // d.num_kv_heads
    return tuple(((r // replicas) * d.head_dim, (r // replicas + 1) * d.head_dim) for r in range(tp_size))


def vllm_llama_tp(config, tp_size: int, dtype: torch.dtype, fp8: str | None = None) -> Layout:
    """Generator layout: vLLM's names and tensor-parallel layout.

    - `self_attn.qkv_proj`: rank r holds its q heads, then its k heads, then its v
      heads (KV heads replicated when tp_size > num_key_value_heads); bias alike.
    - `o_proj` and `down_proj` split on dim 1 (their biases replicated).
    - `mlp.gate_up_proj`: rank r holds its gate rows, then its up rows.
    - norms replicated.
    - `embed_tokens` and `lm_head` split on dim 0 after padding the vocabulary to a
      multiple of 64 (padding rows stay zero); `lm_head` omitted when tied.
    - fp8: None, or a granularity ("tensor", "channel", "block") for the weights
      of qkv_proj, o_proj, gate_up_proj and down_proj, which the generator then
      holds in float8_e4m3fn with a scale, quantized by the senders
      (llamarl_core/sync/fp8.py). Norms, biases, embeddings and lm_head stay in
      `dtype`.
    """
    d = llama_dims(config)
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if d.num_heads % tp_size:
        raise ValueError(f"num_attention_heads {d.num_heads} is not divisible by tp_size {tp_size}")
    q_rows, kv_rows = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    q_ranges = _even_ranges(q_rows, tp_size, "num_attention_heads * head_dim")
    kv_ranges = _kv_head_ranges(d, tp_size)
    mlp_ranges = _even_ranges(d.intermediate, tp_size, "intermediate_size")
    padded_vocab = -(-d.vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    if padded_vocab % tp_size:
        raise ValueError(f"padded vocabulary {padded_vocab} is not divisible by tp_size {tp_size}")

    def fused(name: str, parts: list[tuple[str, tuple[int, ...], tuple]], cols: tuple[int, ...]) -> ParamSpec:
        rows = sum(shape[0] for _, shape, _ in parts)
        return ParamSpec(name, (rows, *cols), dtype, Fused(tuple(FusedPart(s, shape, r) for s, shape, r in parts)),
                         fp8=fp8 if name.endswith(".weight") else None)

    vocab_shard = Shard(0, padded_size=padded_vocab)
    params = [ParamSpec("model.embed_tokens.weight", (d.vocab, d.hidden), dtype, vocab_shard)]
    for i in range(d.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        kinds = ["weight"] + (["bias"] if d.qkv_bias else [])
        for kind in kinds:
            cols = (d.hidden,) if kind == "weight" else ()
            params.append(
                fused(
                    f"{a}qkv_proj.{kind}",
                    [
                        (f"{a}q_proj.{kind}", (q_rows, *cols), q_ranges),
                        (f"{a}k_proj.{kind}", (kv_rows, *cols), kv_ranges),
                        (f"{a}v_proj.{kind}", (kv_rows, *cols), kv_ranges),
                    ],
                    cols,
                )
            )
        params.append(ParamSpec(f"{a}o_proj.weight", (d.hidden, q_rows), dtype, Shard(1), fp8=fp8))
        if d.o_bias:
            params.append(ParamSpec(f"{a}o_proj.bias", (d.hidden,), dtype, Replicate()))
        for kind in ["weight"] + (["bias"] if d.mlp_bias else []):
            cols = (d.hidden,) if kind == "weight" else ()
            params.append(
                fused(
                    f"{m}gate_up_proj.{kind}",
                    [
                        (f"{m}gate_proj.{kind}", (d.intermediate, *cols), mlp_ranges),
                        (f"{m}up_proj.{kind}", (d.intermediate, *cols), mlp_ranges),
                    ],
                    cols,
                )
            )
        params.append(ParamSpec(f"{m}down_proj.weight", (d.hidden, d.intermediate), dtype, Shard(1), fp8=fp8))
        if d.mlp_bias:
            params.append(ParamSpec(f"{m}down_proj.bias", (d.hidden,), dtype, Replicate()))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            params.append(ParamSpec(f"model.layers.{i}.{norm}.weight", (d.hidden,), dtype, Replicate()))
    params.append(ParamSpec("model.norm.weight", (d.hidden,), dtype, Replicate()))
    if not d.tied:
        params.append(ParamSpec("lm_head.weight", (d.vocab, d.hidden), dtype, vocab_shard))
    return Layout(tp_size, params)
