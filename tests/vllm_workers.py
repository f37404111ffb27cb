"""Real processes for the vLLM tests: FSDP2 trainer ranks, and transformers'
greedy decoding as the reference (the engine: integrations.vllm.host)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os

import torch
import torch.distributed as dist
import transformers

from helpers import deltas_by_size


def tiny_config(kind: str):
    """Configs vLLM's CPU attention takes (head_dim 32), a vocabulary vLLM pads
    (1000 -> 1024), weights large enough that greedy tokens are clear; past the
    Llama family, Qwen3 (q/k norms) and two MoE models with 3 experts (uneven
    over 2 FSDP ranks) whose expert width vLLM's CPU kernel does not pad (a
    multiple of 32 per tensor-parallel rank); Qwen3-MoE's second layer a dense
    MLP (mlp_only_layers)."""
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, initializer_range=0.2,
                  torch_dtype="float32", bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    if kind == "llama_tied":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True)
    if kind == "qwen2_tied":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False)
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=32, moe_intermediate_size=64, num_experts=3,
                                           num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
                                           tie_word_embeddings=False,
                                           architectures=["Qwen3MoeForCausalLM"])
    if kind == "mixtral":
        return transformers.MixtralConfig(**{**common, "intermediate_size": 64}, num_local_experts=3,
                                          num_experts_per_tok=2, tie_word_embeddings=False,
                                          architectures=["MixtralForCausalLM"])
    if kind == "deepseek_v2":  # MLA: vLLM computes W_UK_T / W_UV from kv_b_proj after loading
        return transformers.DeepseekV2Config(**{**common, "num_key_value_heads": 4}, moe_intermediate_size=64,
                                             n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                             first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=64,
                                             qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
                                             topk_method="greedy", n_group=1, topk_group=1,
                                             tie_word_embeddings=False, architectures=["DeepseekV2ForCausalLM"])
    raise ValueError(kind)


# ----------------------------------------------------------------------------- the trainer


def trainer_rank(port: int, rank: int, world: int, kind: str, seed: int, versions: list[int], name: str,
                 die_before_send: int | None = None, send_after: dict[int, str] | None = None,
                 timeout_s: float = 60.0, transport: str = "auto", delta: bool = False,
                 steps: dict[int, str] | None = None) -> list[dict] | None:
    """One FSDP2 trainer rank (world > 1: fully_shard over gloo): registers its shards
    with module_sender, sends each version (an AdamW step on a random batch between
    versions, and a forward with no backward just before each send), and returns
    the full state dict of every version sent (rank 0).
    die_before_send: the index of a send this rank never makes (it exits at once).
    send_after: send index -> a Store key to wait for before that version's step.
    transport, delta: module_sender's; each send's last_send goes into the Store
    under <name>/sent/<rank>/<version> (JSON).
    steps: send index -> what changes the weights before it instead of the AdamW
    step: "few" (three elements of this rank's shard of each matrix, +0.25),
    "none"."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from llamarl_core.sync import module_sender

    torch.set_num_threads(1)
    if delta:
        deltas_by_size()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    if world > 1:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"pg/{name}/", store), rank=rank, world_size=world)
    torch.manual_seed(seed)
    config = tiny_config(kind)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    states = []
    try:
        with module_sender(store, model, rank, world, name=name, timeout=timeout_s, transport=transport,
                           delta=delta) as sender:
            for i, version in enumerate(versions):
                if i in (send_after or {}):
                    store.wait([send_after[i]], datetime.timedelta(seconds=timeout_s))
                step = (steps or {}).get(i, "adamw")
                if i and step == "few":
                    with torch.no_grad():
                        for param in model.parameters():
                            local = param.to_local() if hasattr(param, "to_local") else param
                            if local.dim() == 2 and local.numel():
                                local.view(-1)[:3] += 0.25
                elif i and step == "adamw":
                    gen = torch.Generator().manual_seed(seed + i)
                    ids = torch.randint(3, config.vocab_size, (2, 12), generator=gen)
                    model(input_ids=ids, labels=ids).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
                if i == die_before_send:
                    os._exit(1)  # killed mid-sync: the other ranks' shards have landed, not this one's
                # A forward with no backward (FSDP2 leaves the root unsharded): the sender reshards.
                model(input_ids=torch.tensor([[5, 6, 7]]))
                sender.send(version, timeout=timeout_s)
                store.set(f"{name}/sent/{rank}/{version}", json.dumps(dataclasses.asdict(sender.last_send)))
                states.append({k: v.numpy().copy() for k, v in state.items()})  # numpy: outlives this process
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return states if rank == 0 else None


def reference_model(kind: str, state: dict):
    """The transformers model of `kind` (fp32) with a trainer's state dict."""
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind), torch_dtype=torch.float32)
    model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
    return model.eval()


def checkpoint_tensors(kind: str, state: dict, folder) -> list[tuple[str, torch.Tensor]]:
    """A trainer's state dict as the checkpoint tensors vLLM loads: what
    transformers' save_pretrained writes (MoE experts one tensor each)."""
    from safetensors.torch import load_file

    reference_model(kind, state).save_pretrained(folder)
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return sorted(tensors.items())


@torch.no_grad()
def reference_logprobs(kind: str, state: dict, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """transformers' log-prob of each of `tokens` after `prompt` and the tokens before
    it, under softmax(logits / temperature) (fp32 model, float64 softmax)."""
    model = reference_model(kind, state)
    logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


@torch.no_grad()
def reference_greedy(kind: str, state: dict, prompts: list[list[int]], max_tokens: int):
    """transformers' greedy tokens and their log-probs (fp32)."""
    model = reference_model(kind, state)
    out = []
    for prompt in prompts:
        ids, tokens, logprobs = list(prompt), [], []
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
            lp = torch.log_softmax(logits, dim=-1)
            token = int(torch.argmax(lp))
            tokens.append(token)
            logprobs.append(float(lp[token]))
            ids.append(token)
        out.append((tokens, logprobs))
    return out
