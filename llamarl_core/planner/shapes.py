"""A model's sizes as the cost model needs them, read off its Hugging Face config:
parameters (total, per token, per layer, experts apart), KV-cache bytes per token
and attention FLOPs per position, for dense (GQA) decoders, MoE decoders and MLA
(DeepSeek-V2/V3).

Counts are of the weight matrices (norms and biases are under 0.1% and left out);
a DeepSeek-V3 config gives 671B parameters and 37B per token, as published."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .devices import PlanError

DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2", "granite")
MOE = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
MLA = ("deepseek_v2", "deepseek_v3")
MODEL_TYPES = DENSE + MOE + MLA
TIED_BY_DEFAULT = ("gemma", "gemma2")  # transformers' default tie_word_embeddings for these is True


MAX_INT = 2**53  # the largest integer a field may hold: every one is exact as a float in the arithmetic


def _field(config: dict, *names, default=None, required=True, minimum=1):
    """The first of `names` the config sets, an integer >= minimum (PlanError naming it otherwise)."""
    for name in names:
        if config.get(name) is not None:
            value = config[name]
            if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_INT:
                kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
                raise PlanError(f"hf_config ({config.get('model_type')}): {name} must be {kind}, at most 2**53, got "
                                f"{value!r}")
            return value
    if required and default is None:
        raise PlanError(f"hf_config ({config.get('model_type')}): no {names[0]!r}")
    return default


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int  # for MLA: the heads (its latent cache is shared by all)
    vocab: int
    tied: bool
    attn_params: int  # per layer
    dense_mlp_params: int  # per dense layer
    moe_layers: int
    experts: int  # routed experts per MoE layer (0: dense)
    experts_per_token: int
    expert_params: int  # one routed expert
    shared_params: int  # shared experts + router, per MoE layer
    kv_bytes_per_token_layer: float  # at 2 bytes an element: (k, v) heads, or MLA's latent and rope key
    attn_flops_per_position: float  # per layer per (query, key) pair, forward: QK^T and AV
    mla: bool
    decode_attn_flops_per_position: float = 0.0  # MLA decodes in its absorbed form: in the latent space
    train_kv_bytes_per_token_layer: float = 0.0  # K and V as training attends to them (MLA: decompressed)

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def expert_total(self) -> int:
        """Routed expert parameters of the whole model."""
        return self.moe_layers * self.experts * self.expert_params

    @property
    def non_expert_params(self) -> int:
        """Parameters outside the routed experts: attention, dense MLPs, shared experts, routers, embeddings."""
        return (self.layers * self.attn_params + self.dense_layers * self.dense_mlp_params
                + self.moe_layers * self.shared_params + self.embedding_params)

    @property
    def total_params(self) -> int:
        return self.non_expert_params + self.expert_total

    @property
    def active_params(self) -> int:
        """Parameters a token multiplies by (the input embedding is a lookup, the head a matmul)."""
        return (self.layers * self.attn_params + self.dense_layers * self.dense_mlp_params
                + self.moe_layers * (self.shared_params + self.experts_per_token * self.expert_params)
                + self.vocab * self.hidden)

    def experts_touched(self, tokens: float) -> float:
        """Expected distinct routed experts per MoE layer that `tokens` tokens reach
        (uniform routing): all of them once tokens * k is well above the experts."""
        if not self.experts:
            return 0.0
        return self.experts * (1.0 - (1.0 - self.experts_per_token / self.experts) ** max(tokens, 0.0))

    def weights_read(self, tokens: float) -> float:
        """Parameters a forward over `tokens` tokens at once reads (decode: the batch)."""
        return self.non_expert_params - (self.vocab * self.hidden if not self.tied else 0) \
            + self.moe_layers * self.experts_touched(tokens) * self.expert_params

    @property
    def moe(self) -> bool:
        return self.experts > 0


def load_config(source) -> dict:
    """A Hugging Face config: the dict itself, a config.json, or a model folder holding one."""
    if isinstance(source, dict):
        return source
    if not isinstance(source, (str, Path)):
        raise PlanError(f"hf_config must be a config object or the path of a config.json or model folder, got "
                        f"{type(source).__name__}")
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanError(f"hf_config {str(source)!r}: no such config.json or model folder")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"hf_config {str(path)!r}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise PlanError(f"hf_config {str(path)!r}: a config is a JSON object, got {type(config).__name__}")
    return config


def model_shape(source) -> ModelShape:
    """The ModelShape of a Hugging Face config (dict, config.json or model folder).
    PlanError naming the model_type when it is none of MODEL_TYPES, or the field a
    config of its type lacks."""
    config = load_config(source)
    if "text_config" in config and "hidden_size" not in config:
        text = config["text_config"]
        if not isinstance(text, dict):
            raise PlanError(f"hf_config: text_config must be an object, got {type(text).__name__}")
        config = {**text, "model_type": text.get("model_type", "")}
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise PlanError(f"model_type {model_type!r}: the planner describes {', '.join(MODEL_TYPES)}")
    hidden = int(_field(config, "hidden_size"))
    layers = int(_field(config, "num_hidden_layers"))
    heads = int(_field(config, "num_attention_heads"))
    vocab = int(_field(config, "vocab_size"))
    tied = config.get("tie_word_embeddings", model_type in TIED_BY_DEFAULT)
    if not isinstance(tied, bool):
        raise PlanError(f"hf_config ({model_type}): tie_word_embeddings must be true or false, got {tied!r}")
    inter = int(_field(config, "intermediate_size"))
    mla = model_type in MLA
    if mla:
        q_lora = _field(config, "q_lora_rank", default=0, required=False, minimum=0)
        kv_lora = int(_field(config, "kv_lora_rank"))
        nope = int(_field(config, "qk_nope_head_dim"))
        rope = int(_field(config, "qk_rope_head_dim"))
        v_dim = int(_field(config, "v_head_dim"))
        q_params = hidden * q_lora + q_lora * heads * (nope + rope) if q_lora else hidden * heads * (nope + rope)
        attn = q_params + hidden * (kv_lora + rope) + kv_lora * heads * (nope + v_dim) + heads * v_dim * hidden
        kv_bytes = 2.0 * (kv_lora + rope)
        attn_flops = 2.0 * heads * (nope + rope) + 2.0 * heads * v_dim
        # Absorbed (as vLLM decodes MLA): scores over the latent and rope key, values in the latent.
        decode_attn_flops = 2.0 * heads * (kv_lora + rope) + 2.0 * heads * kv_lora
        train_kv_bytes = 2.0 * heads * (nope + rope + v_dim)
        kv_heads = heads
    else:
        kv_heads = int(_field(config, "num_key_value_heads", default=heads))
        head_dim = int(_field(config, "head_dim", default=hidden // heads))
        if heads % kv_heads:
            raise PlanError(f"hf_config: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                            f"{kv_heads}")
        attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
        kv_bytes = 2.0 * 2 * kv_heads * head_dim
        attn_flops = 4.0 * heads * head_dim
        decode_attn_flops, train_kv_bytes = attn_flops, kv_bytes
    experts = _field(config, "n_routed_experts", "num_experts", "num_local_experts", default=0, required=False,
                     minimum=0)
    moe_layers, k, expert, shared = 0, 0, 0, 0
    if experts:
        k = int(_field(config, "num_experts_per_tok"))
        if k > experts:
            raise PlanError(f"hf_config ({model_type}): num_experts_per_tok {k} is more than its {experts} experts")
        expert_inter = int(_field(config, "moe_intermediate_size", default=inter))
        expert = 3 * hidden * expert_inter
        n_shared = _field(config, "n_shared_experts", default=0, required=False, minimum=0)
        shared_inter = _field(config, "shared_expert_intermediate_size", default=0, required=False, minimum=0)
        shared = 3 * hidden * (shared_inter or n_shared * expert_inter) + hidden * experts
        if mla:  # DeepSeek: layer i routes from first_k_dense_replace on, every moe_layer_freq-th
            first_dense = _field(config, "first_k_dense_replace", default=0, required=False, minimum=0)
            freq = _field(config, "moe_layer_freq", default=1, required=False)
            moe_layers = len(range(-(-first_dense // freq) * freq, layers, freq))  # counted, not walked
        else:  # Qwen-MoE: layer i routes when (i + 1) is a multiple of decoder_sparse_step, bar mlp_only_layers
            step = _field(config, "decoder_sparse_step", default=1, required=False)
            only_mlp = config.get("mlp_only_layers") or []
            if not isinstance(only_mlp, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only_mlp):
                raise PlanError(f"hf_config ({model_type}): mlp_only_layers must be a list of layer indices, got "
                                f"{only_mlp!r}")
            routed = range(step - 1, layers, step)  # counted, not walked: layers may be any size
            moe_layers = len(routed) - len({i for i in only_mlp if i in routed})
    if model_type in MOE + MLA and not experts and model_type != "deepseek_v2":
        raise PlanError(f"hf_config ({model_type}): no routed experts (n_routed_experts / num_experts)")
    return ModelShape(model_type=model_type, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                      vocab=vocab, tied=tied, attn_params=attn, dense_mlp_params=3 * hidden * inter,
                      moe_layers=moe_layers, experts=experts, experts_per_token=k, expert_params=expert,
                      shared_params=shared, kv_bytes_per_token_layer=kv_bytes, attn_flops_per_position=attn_flops,
                      mla=mla, decode_attn_flops_per_position=decode_attn_flops,
                      train_kv_bytes_per_token_layer=train_kv_bytes)
