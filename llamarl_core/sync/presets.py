"""Layout presets for the Llama family (Llama, Qwen2 with q/k/v bias, Mistral).

`config` is any object with the Hugging Face field names (`transformers.LlamaConfig`,
`Qwen2Config`, `MistralConfig`, or a SimpleNamespace): hidden_size,
intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
vocab_size, tie_word_embeddings, and optionally head_dim, attention_bias, mlp_bias,
model_type.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import Fused, FusedPart, Layout, ParamSpec, Replicate, Shard

# The families whose parameters the presets describe; every other model_type is
# refused (its layout is read off the live models instead: see sync/live.py).
LLAMA_FAMILY = ("llama", "qwen2", "mistral")
# Config fields that give a model parameters the Llama layout has no place for.
FOREIGN_FIELDS = {
    "num_experts": "experts", "num_local_experts": "experts", "n_routed_experts": "experts",
    "moe_intermediate_size": "experts", "n_shared_experts": "shared experts", "q_lora_rank": "MLA projections",
    "kv_lora_rank": "MLA projections", "use_qk_norm": "q/k norms", "qk_layernorm": "q/k norms",
}

# vLLM pads the vocabulary of embed_tokens / lm_head to a multiple of 64
# (DEFAULT_VOCAB_PADDING_SIZE) before splitting it over tensor-parallel ranks.
VLLM_VOCAB_PADDING = 64


@dataclass(frozen=True)
class LlamaDims:
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool


def check_llama_family(config) -> None:
    """ValueError unless `config` is a Llama-family model whose every parameter the
    presets describe: a model_type outside LLAMA_FAMILY (Qwen3's q/k norms,
    Mixtral's experts) or a field that adds parameters is named."""
    model_type = getattr(config, "model_type", None)
    if model_type is not None and model_type not in LLAMA_FAMILY:
        raise ValueError(f"model_type {model_type!r} is not of the Llama family ({', '.join(LLAMA_FAMILY)}) that the "
                         "Llama layout presets describe; its parameters would be left out or misplaced. Read its "
                         "layouts off the live models instead (fsdp_layout, the vLLM backend)")
    foreign = [f"{field} ({what})" for field, what in FOREIGN_FIELDS.items() if getattr(config, field, None)]
    if foreign:
        raise ValueError(f"the config sets {', '.join(foreign)}, parameters the Llama layout presets have no place "
                         "for; read its layouts off the live models instead (fsdp_layout, the vLLM backend)")


def llama_dims(config) -> LlamaDims:
    """The dimensions of a Llama-family config, with the family's bias rules:
    Qwen2 has q/k/v bias only; Llama's `attention_bias` puts bias on q, k, v and o;
    `mlp_bias` on gate, up and down. Other families are refused (check_llama_family)."""
    check_llama_family(config)
    num_heads = config.num_attention_heads
    num_kv = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    is_qwen2 = getattr(config, "model_type", "") == "qwen2"
    attention_bias = bool(getattr(config, "attention_bias", False))
    if num_heads % num_kv:
        raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv}")
    return LlamaDims(
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        vocab=config.vocab_size,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
    )


def hf_llama_shapes(config) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names -> shapes, in `named_parameters()` order."""
    d = llama_dims(config)
    q_rows, kv_rows = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (d.vocab, d.hidden)}
    for i in range(d.num_layers):
        p = f"model.layers.{i}."
        attn = {"q_proj": (q_rows, d.hidden), "k_proj": (kv_rows, d.hidden), "v_proj": (kv_rows, d.hidden)}
        for proj, shape in attn.items():
            shapes[f"{p}self_attn.{proj}.weight"] = shape
            if d.qkv_bias:
                shapes[f"{p}self_attn.{proj}.bias"] = (shape[0],)
        shapes[f"{p}self_attn.o_proj.weight"] = (d.hidden, q_rows)
        if d.o_bias:
            shapes[f"{p}self_attn.o_proj.bias"] = (d.hidden,)
        for proj, shape in {
            "gate_proj": (d.intermediate, d.hidden),
            "up_proj": (d.intermediate, d.hidden),
            "down_proj": (d.hidden, d.intermediate),
        }.items():
            shapes[f"{p}mlp.{proj}.weight"] = shape
            if d.mlp_bias:
                shapes[f"{p}mlp.{proj}.bias"] = (shape[0],)
        shapes[f"{p}input_layernorm.weight"] = (d.hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (d.hidden,)
    shapes["model.norm.weight"] = (d.hidden,)
    if not d.tied:
        shapes["lm_head.weight"] = (d.vocab, d.hidden)
    return shapes


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
