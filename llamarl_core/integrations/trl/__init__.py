"""llamarl as a backend of TRL (trl 1.16, the `trl` extra): change one import.

    from llamarl_core.integrations.trl import GRPOTrainer   # was: from trl import GRPOTrainer

`GRPOTrainer` takes trl.GRPOTrainer's arguments and trains as it does, its
completions scored by llamarl's fused log-prob op (grpo.py, head.py), its
vLLM engine, colocated or a server, synced by DDMA (generation.py), and
`DdmaWeightTransfer`, the `weight_transfer` backend of TRL's AsyncGRPOTrainer
(server.py).
"""

from __future__ import annotations

from importlib.util import find_spec

if find_spec("trl") is None:
    raise ImportError("llamarl_core.integrations.trl needs TRL: pip install 'llamarl-core[trl]'")

from .grpo import GRPOTrainer
from .head import add_fused_lm_head
from .server import DdmaWeightTransfer

__all__ = ["DdmaWeightTransfer", "GRPOTrainer", "add_fused_lm_head"]
