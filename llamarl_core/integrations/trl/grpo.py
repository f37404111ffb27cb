"""`GRPOTrainer`: trl's GRPOTrainer with its completions scored by llamarl's
fused log-prob op. Changing `from trl import GRPOTrainer` to `from
llamarl_core.integrations.trl import GRPOTrainer` is the whole migration: the
same arguments, the same loss for every `loss_type` and option (TRL's own code
computes it, from the per-token log-probs and entropies the head returns), the
same metrics under the same names."""

from __future__ import annotations

import inspect

import trl

from .head import add_fused_lm_head


class GRPOTrainer(trl.GRPOTrainer):
    """trl.GRPOTrainer (same arguments, same behaviour) whose policy model scores
    its completions (the loss's log-probs and entropies, the old policy's) with
    llamarl's fused LM head (head.py) in place of TRL's. ValueError at
    construction naming what that head does not reproduce (a logit soft-cap or
    scale, an lm-head bias, DeepSpeed ZeRO-3). The reference model keeps TRL's
    head: its log-probs are values, never differentiated."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        policy = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        add_fused_lm_head(policy, temperature=self.temperature, cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
                          outputs=("log_probs", "entropy"))


GRPOTrainer.__init__.__signature__ = inspect.signature(trl.GRPOTrainer.__init__)
