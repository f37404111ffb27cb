"""Worker processes for test_live.py: tiny transformers models sharded for real
(FSDP2 fully_shard, tensor-parallel parallelize_module) over gloo ranks."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import transformers


def tiny_config(kind: str):
    """Tiny configs of the families past Llama: odd expert counts split unevenly."""
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=300, tie_word_embeddings=False)
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, intermediate_size=96)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=3,
                                           num_experts_per_tok=2, decoder_sparse_step=1)
    if kind == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=48, num_local_experts=3, num_experts_per_tok=2)
    raise ValueError(kind)


def tiny_model(kind: str, seed: int):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def sharded(rank: int, world: int, port: int, kind: str, mode: str) -> dict:
    """Shard `kind`'s tiny model ("fsdp": fully_shard per layer and root; "hsdp":
    the same on a 2-D mesh, replicated over its first dim and sharded over its
    second; "tp": q/k/v/gate/up column-parallel, o/down row-parallel; "fsdp_tp":
    tensor parallel over a 2-D mesh's second dim, FSDP2 over its first) and return
    module_layout's JSON, the local shards, and fsdp_layout of a meta-device copy."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from llamarl_core.sync import module_layout
        from llamarl_core.sync.live import fsdp_layout, local_shard

        model = tiny_model(kind, 0)
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(tiny_config(kind))
        if mode == "hsdp":
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        elif mode == "fsdp_tp":
            mesh_2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
            mesh = mesh_2d["tp"]
        else:
            mesh = init_device_mesh("cpu", (world,))
        if mode in ("fsdp", "hsdp"):
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        if mode in ("tp", "fsdp_tp"):
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            plan = {}
            for i in range(len(model.model.layers)):
                for proj in ("q_proj", "k_proj", "v_proj"):
                    plan[f"model.layers.{i}.self_attn.{proj}"] = ColwiseParallel()
                plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
                for proj in ("gate_proj", "up_proj"):
                    plan[f"model.layers.{i}.mlp.{proj}"] = ColwiseParallel()
                plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
            parallelize_module(model, mesh, plan)
        if mode == "fsdp_tp":  # FSDP2 over the tensor-parallel model: colwise weights get _StridedShard
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh_2d["dp"])
            fully_shard(model, mesh=mesh_2d["dp"])
        layout = module_layout(model, world)
        return {"layout": layout.to_json(), "fsdp_layout": fsdp_layout(meta, world, torch.float32).to_json(),
                "shards": {n: local_shard(p).numpy().copy() for n, p in model.named_parameters()}}  # numpy: no shared memory
    finally:
        dist.destroy_process_group()
