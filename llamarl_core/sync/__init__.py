"""DDMA weight sync: trainer shards straight into the generator's parameter storage.

    from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp
    src = hf_llama_fsdp(config, world_size=2, dtype=torch.float32)   # trainer
    dst = vllm_llama_tp(config, tp_size=2, dtype=torch.bfloat16)     # generator
    plan = plan_transfer(src, dst)          # validated once; plan.summary()
    plan.execute_local(src_shards, dst_shards)                      # one process

A trainer's layout is read off the live model: `module_layout(model, world)`
(any family, FSDP2 / TP / HSDP DTensors or a plain model); `module_sender(store,
model, rank, world)` sends its shards in place, `module_receiver(store, model,
rank, world)` receives into a generator model's own parameters. A layout by
hand: `Layout` of `ParamSpec`s, each placed by `Shard`, `Replicate`, `Fused` or
`Explicit`.

Across processes: `WeightSender(store, src, rank, shards).send(version)` on each
trainer rank, `WeightReceiver(store, dst, rank, params).receive()` on each
generator rank (see receiver.py for the handshake, versions, timeouts and torn
weights); `send(version, wait=False)` returns a SendHandle, `receiver.pending()`
says whether a version waits. Every rank of a sync holds the same secret
(`new_secret()`, handed to each rank as the run hands it: an argument or
LLAMARL_SECRET).

Beside this package's names, the modules other code may import (PUBLIC_MODULES):
presets.py (the Llama family's trainer and vLLM layouts without a model),
reference.py (the shards a sync must land, computed the slow way: test oracles),
live.py (layouts of live modules: `fsdp_layout` of a model before sharding,
`checkpoint_views`), layout.py and plan.py (fragments, segments: how a plan is
made; `relay_tree`, which replica relays to which), protocol.py (the Store keys
and the decisions on them; `abandon_receivers`, `DEFAULT_TIMEOUT_S`, the
checks of a timeout and a transport's name), probe.py
(view probes: how an engine's weight loaders are read into a layout), errors.py.
The rest are this package's own: endpoint.py (each side's set-up, register_sender and
register_receiver, over shared steps),
sender.py, receiver.py, relay.py (generator replicas), stream.py, board.py,
transports.py, engine.py, fp8.py, amax.py, delta.py (a point-to-point bucket's
delta codec: `WeightSender(..., delta=True)`) and delta_pair.py (what a pair of
deltas keeps and decides: the base, the density limit, the receiver's words).
"""

from __future__ import annotations

from .._moved import moved_names
from ..control.auth import new_secret
from .errors import RelayError, StaleReceiveError, SyncError, SyncTimeoutError, TornWeightsError
from .layout import Explicit, Fused, Layout, ParamSpec, Replicate, Shard
from .live import module_layout, module_receiver, module_sender
from .plan import TransferPlan, plan_transfer
from .receiver import WeightReceiver
from .sender import SendHandle, WeightSender

__all__ = [
    "Explicit", "Fused", "Layout", "ParamSpec", "Replicate", "Shard",
    "module_layout", "module_receiver", "module_sender", "TransferPlan", "plan_transfer",
    "SendHandle", "WeightReceiver", "WeightSender", "new_secret",
    "RelayError", "StaleReceiveError", "SyncError", "SyncTimeoutError", "TornWeightsError",
]

PUBLIC_MODULES = ("presets", "reference", "live", "layout", "plan", "protocol", "probe", "errors")

# Names this package exported up to 0.1, importable from here for one more release:
# {name: (its module, its name there)}.
MOVED = {
    **{name: ("llamarl_core.sync.presets", name) for name in ("hf_llama_fsdp", "vllm_llama_tp")},
    "hf_llama_shapes": ("llamarl_core.models.llama_family", "hf_llama_shapes"),
    **{name: ("llamarl_core.sync.reference", name) for name in ("reference_fsdp_shards", "reference_vllm_tp_shards")},
    **{name: ("llamarl_core.sync.live", name)
       for name in ("fsdp_layout", "local_shard", "checkpoint_views", "ModuleReceiver", "ModuleSender")},
    "fsdp_sender": ("llamarl_core.sync.live", "module_sender"),
    "Fragment": ("llamarl_core.sync.layout", "Fragment"),
    "FusedPart": ("llamarl_core.sync.layout", "FusedPart"),
    "DEFAULT_BUCKET_BYTES": ("llamarl_core.sync.plan", "DEFAULT_BUCKET_BYTES"),
    "Segment": ("llamarl_core.sync.plan", "Segment"),
    "abandon_receivers": ("llamarl_core.sync.protocol", "abandon_receivers"),
}


__getattr__ = moved_names(__name__, MOVED)
