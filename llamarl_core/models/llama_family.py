"""The Llama family as the presets, the checkpoints and the generator read it:
which configs belong (Llama, Qwen2 with q/k/v bias, Mistral; every other
model_type and every field that adds parameters refused, naming it), their
dimensions and bias rules, their Hugging Face parameter names and shapes, and
vLLM's names for an FP8 weight's scale. Pure functions of a config: no layout,
no model, no torch.distributed.

`config` is any object with the Hugging Face field names (`transformers.LlamaConfig`,
`Qwen2Config`, `MistralConfig`, or a SimpleNamespace): hidden_size,
intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
vocab_size, tie_word_embeddings, and optionally head_dim, attention_bias, mlp_bias,
model_type.
"""

from __future__ import annotations

from dataclasses import dataclass

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
