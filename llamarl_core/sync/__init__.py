"""DDMA weight sync: trainer shards straight into the generator's parameter storage.

    src = hf_llama_fsdp(config, world_size=2, dtype=torch.float32)   # trainer
    dst = vllm_llama_tp(config, tp_size=2, dtype=torch.bfloat16)     # generator
    plan = plan_transfer(src, dst)          # validated once; plan.summary()
    plan.execute_local(src_shards, dst_shards)                      # one process

A trainer's layout is read off the live model: `module_layout(model, world)`
(any family, FSDP2 / TP / HSDP DTensors or a plain model), `fsdp_layout(model,
world, dtype)` before sharding; `module_sender(store, model, rank, world)`
(alias `fsdp_sender`) sends its shards in place, `module_receiver(store, model,
rank, world)` receives into a generator model's own parameters.

Across processes: `WeightSender(store, src, rank, shards).send(version)` on each
trainer rank, `WeightReceiver(store, dst, rank, params).receive()` on each
generator rank (see receiver.py for the handshake, versions, timeouts and torn
weights); `send(version, wait=False)` returns a SendHandle, `receiver.pending()`
says whether a version waits. Modules: protocol.py (the Store keys and the
decisions on them), endpoint.py (the set-up both sides share), sender.py,
receiver.py and relay.py (generator replicas).
"""

from .errors import RelayError, StaleReceiveError, SyncError, SyncTimeoutError, TornWeightsError
from .protocol import abandon_receivers
from .receiver import WeightReceiver
from .sender import SendHandle, WeightSender
from .live import (ModuleReceiver, ModuleSender, checkpoint_views, fsdp_layout, fsdp_sender, local_shard, module_layout,
                   module_receiver, module_sender)
from .layout import Explicit, Fragment, Fused, FusedPart, Layout, ParamSpec, Replicate, Shard
from .plan import DEFAULT_BUCKET_BYTES, Segment, TransferPlan, plan_transfer
from .presets import hf_llama_fsdp, hf_llama_shapes, vllm_llama_tp
from .reference import reference_fsdp_shards, reference_vllm_tp_shards

__all__ = [
    "DEFAULT_BUCKET_BYTES", "Explicit", "Fragment", "Fused", "FusedPart", "Layout", "ParamSpec", "Replicate", "Segment",
    "RelayError", "SendHandle", "Shard", "StaleReceiveError", "SyncError", "SyncTimeoutError", "TornWeightsError", "TransferPlan", "WeightReceiver",
    "WeightSender", "abandon_receivers", "ModuleReceiver", "ModuleSender", "checkpoint_views", "fsdp_layout", "module_layout",
    "module_receiver", "module_sender", "fsdp_sender", "hf_llama_fsdp", "local_shard", "hf_llama_shapes", "plan_transfer", "reference_fsdp_shards",
    "reference_vllm_tp_shards", "vllm_llama_tp",
]
