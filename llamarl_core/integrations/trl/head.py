"""The LM head TRL's GRPO trainer scores completions with, on llamarl's fused
log-prob op.

TRL patches the policy model's forward (`trl.trainer.utils.add_fused_lm_head`):
`model(..., labels=labels, fused_lm_head=True)` returns per-token log-probs
and entropies of the temperature-scaled next-token distribution instead of
logits. `add_fused_lm_head` here installs the same contract on the same model,
computed by `ops.linear_token_logprobs` (hidden states and the lm-head weight,
one chunk of logits at a time, the backward in one vocabulary pass a chunk):
TRL's trainer code, its loss among it, runs unchanged on what it returns.

Refused by name, at installation, rather than computed differently: a logit
soft-cap (Gemma 2, RecurrentGemma, xLSTM), a logit scale (Cohere, Granite,
MiniCPM3, Falcon-H1, Inkling's muP width, ...), an lm-head bias, a PEFT adapter
on the lm-head (LoRA: its weight reads as the base layer's; `modules_to_save`'s
trained copy is served), the per-token fields beyond log-probs and entropies, and
DeepSpeed ZeRO-3 (its partitioned lm-head is gathered only inside the head's
own forward).
"""

from __future__ import annotations

import functools
import types

import torch

from ...ops.logprob import linear_token_logprobs

OUTPUTS = ("log_probs", "entropy")
# Config fields by which a family scales or caps its logits before the softmax.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                     "logits_scaling", "logits_mup_width_multiplier", "output_logit_soft_cap", "logits_soft_cap")


def unsupported_config(config=None, outputs: tuple[str, ...] = OUTPUTS) -> str | None:
    """Why llamarl's head cannot score a model of the transformers `config` (None:
    not known yet) as TRL's would, as far as the config and the process's
    DeepSpeed settings tell (before the model is built), or None."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    extra = [name for name in outputs if name not in OUTPUTS]
    if extra:
        return f"per-token outputs {extra} (llamarl's head computes {list(OUTPUTS)})"
    text_config = config.get_text_config() if config is not None else None
    for field in _LOGIT_TRANSFORMS:
        value = getattr(text_config, field, None)
        if value is not None and value != 1.0:
            return f"the model's config sets {field}={value} (a logit transform llamarl's head does not apply)"
    if is_deepspeed_zero3_enabled():
        return "DeepSpeed ZeRO-3 partitions the lm-head, which llamarl's head reads outside its module"
    return None


def unsupported_head(model: torch.nn.Module, outputs: tuple[str, ...] = OUTPUTS) -> str | None:
    """Why llamarl's head cannot score `model` as TRL's would, or None."""
    reason = unsupported_config(model.config, outputs)
    if reason is not None:
        return reason
    head = model.get_output_embeddings()
    if head is None:
        return f"{type(model).__name__} has no output embeddings (an lm-head) to score with"
    if getattr(head, "base_layer", None) is not None:  # peft's tuner layers: .weight is the base layer's alone
        return (f"a PEFT adapter on the lm-head ({type(head).__module__}.{type(head).__name__}; llamarl's head reads "
                "its base weight alone)")
    if getattr(head, "bias", None) is not None:
        return "the lm-head has a bias (llamarl's head computes hidden @ weight.T)"
    return None


def add_fused_lm_head(model: torch.nn.Module, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                      outputs: tuple[str, ...] = OUTPUTS) -> None:
    """Give `model` (a transformers causal LM, before PEFT wraps it) TRL's fused
    LM-head contract, computed by llamarl's op: `model(input_ids, ...,
    labels=labels, fused_lm_head=True)` returns trl's FusedCausalLMOutput with
    `log_probs` and, when `outputs` names it, `entropy` of each next-token label
    (batch, seq_len - 1), 0 where the label is -100 (or of `shift_labels`, as
    given), `loss` (their negative mean, or sum / num_items_in_batch, plus the
    MoE load-balancing loss weighted by the config's router_aux_loss_coef when
    router logits are asked for), `aux_loss` and `label_mask`. Without
    `fused_lm_head` the forward is the one the model had (an override on the
    instance kept, as TRL's add_fused_lm_head keeps it; a llamarl head given
    before replaced). temperature divides
    the logits; the projection runs in the autocast dtype under autocast, else in
    the hidden states' dtype (float32 with cast_lm_head_to_fp32). ValueError
    naming what the head does not reproduce (unsupported_head)."""
    reason = unsupported_head(model, tuple(outputs))
    if reason is not None:
        raise ValueError(f"llamarl's fused LM head cannot score this model: {reason}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    from trl.trainer.utils import FusedCausalLMOutput

    # What the instance runs now: an override of its own (bound to it: rebound to
    # whichever module runs it, a deep copy included), else its class's forward.
    previous = model.__dict__.get("forward")
    previous = getattr(getattr(previous, "__func__", None), "llamarl_previous", previous)  # ours: replaced
    text_config = model.config.get_text_config()
    with_entropy = "entropy" in outputs

    def original_forward(self, *args, **kwargs):
        if previous is None:
            return type(self).forward(self, *args, **kwargs)
        if isinstance(previous, types.MethodType) and previous.__self__ is model:
            return previous.__func__(self, *args, **kwargs)
        return previous(*args, **kwargs)

    # The class's signature kept: generate() reads it (logits_to_keep at prefill, its model kwargs).
    @functools.wraps(type(model).forward)
    def fused_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                      **kwargs):
        if not fused_lm_head:
            passed = dict(labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
            return original_forward(self, *args, **kwargs, **{k: v for k, v in passed.items() if v is not None})
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        backbone = self.base_model(*args, **kwargs)
        if shift_labels is None:
            hidden, labels = backbone.last_hidden_state[:, :-1], labels[:, 1:]
        else:
            hidden, labels = backbone.last_hidden_state, shift_labels
        weight = self.get_output_embeddings().weight
        if hasattr(weight, "full_tensor"):  # an FSDP2 DTensor: the whole head, as the projection needs it
            weight = weight.full_tensor()
        hidden, labels = hidden.to(weight.device), labels.to(weight.device)
        mask = labels != -100
        device = hidden.device.type
        if cast_lm_head_to_fp32:
            dtype = torch.float32
        elif torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        else:
            dtype = hidden.dtype
        with torch.autocast(device, enabled=False):
            logp, entropy = linear_token_logprobs(hidden[mask].to(dtype), weight.to(dtype), labels[mask],
                                                  temperature=temperature, entropy=with_entropy)
        # masked_scatter keeps the outputs connected to the model when no label counts: a zero that backward takes.
        log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
        entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy) if with_entropy else None
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.sum() / count
        aux_loss = None
        if kwargs.get("output_router_logits"):
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            aux_loss = load_balancing_loss_func(backbone.router_logits, text_config.num_experts,
                                                text_config.num_experts_per_tok, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask,
                                   aux_loss=aux_loss)

    fused_forward.llamarl_previous = previous  # a second add_fused_lm_head replaces this head, not wraps it
    model.forward = types.MethodType(fused_forward, model)
