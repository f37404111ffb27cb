"""Process body for the tensor-parallel LlamaGenerator test."""

import datetime

import torch
import torch.distributed as dist
import transformers

from helpers import MODEL_CLASSES, small_config
from sync_checks import poisoned_destination
from llamarl_core.models.llama_generator import LlamaGenerator
from llamarl_core.sync import plan_transfer
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp
from llamarl_core.sync.reference import reference_vllm_tp_shards


def hf_model(kind: str, seed: int):
    """The real Hugging Face model, weights redrawn from N(0, 0.1) (norms and biases too)."""
    config = small_config(kind)
    torch.manual_seed(seed)
    model = MODEL_CLASSES[config.model_type](config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return config, model


def synced_generator(kind: str, seed: int, fp8: str | None = None):
    """(config, HF model, LlamaGenerator holding the HF weights after a TP-1 sync;
    with `fp8`, its decoder layers' weights quantized so by the sync)."""
    config, hf = hf_model(kind, seed)
    generator = LlamaGenerator(config, fp8=fp8)
    plan = plan_transfer(hf_llama_fsdp(config, 1, torch.float32), vllm_llama_tp(config, 1, torch.float32, fp8=fp8))
    plan.execute_local({0: {n: p.detach() for n, p in hf.named_parameters()}}, {0: dict(generator.named_parameters())})
    return config, hf, generator


def tp_logits_gap(port: int, rank: int, world: int, kind: str, seed: int, fp8: str | None = None) -> float:
    """Max |logits - HF logits| of this rank's LlamaGenerator (tensor parallel over
    gloo); with `fp8`, of its FP8 generator synced from the HF weights against the
    TP 1 FP8 generator's logits."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        config, hf = hf_model(kind, seed)
        generator = LlamaGenerator(config, world, rank, group=dist.group.WORLD, fp8=fp8)
        state = {n: p.detach() for n, p in hf.named_parameters()}
        ids = torch.randint(0, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            if fp8 is None:
                shard = reference_vllm_tp_shards(state, config, world, torch.float32)[rank]
                for name, param in generator.named_parameters():
                    param.copy_(shard[name])
                expected = hf(ids).logits
            else:
                plan_transfer(hf_llama_fsdp(config, 1, torch.float32), generator.layout).execute_local(
                    {0: state}, {r: dict(generator.named_parameters()) if r == rank else
                                 poisoned_destination(generator.layout, r) for r in range(world)})
                expected = synced_generator(kind, seed, fp8)[2](ids)
            cache = generator.new_cache()
            decoded = torch.cat([generator(ids[:, :8], cache)] + [generator(ids[:, i : i + 1], cache) for i in range(8, 13)], 1)
            return max((generator(ids) - expected).abs().max().item(), (decoded - expected).abs().max().item())
    finally:
        dist.destroy_process_group()


def fp8_gemm_model(seed: int = 3):
    """A small Llama whose projections are all multiples of 16 (the FP8 GEMM's
    operands, at TP 1 and 2: head_dim 16, 2 KV heads), biases on, weights from
    N(0, 0.1) with k_proj and up_proj 8 times larger (so the per-part scales of
    the fused qkv and gate_up differ)."""
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=1001,
                                      attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.8 if name.endswith(("k_proj.weight", "up_proj.weight")) else 0.1)
    return config, hf


def fp8_gemm_generator(config, hf, granularity: str, gemm: str, device="cpu", world: int = 1, rank: int = 0):
    """LlamaGenerator(fp8=granularity, fp8_gemm=gemm) in bf16, rank `rank` of
    `world` (over the default process group), synced from `hf`'s weights."""
    generator = LlamaGenerator(config, world, rank, group=dist.group.WORLD if world > 1 else None,
                               dtype=torch.bfloat16, fp8=granularity, fp8_gemm=gemm, device=device)
    plan = plan_transfer(hf_llama_fsdp(config, 1, torch.float32), generator.layout)
    plan.execute_local({0: {n: p.detach().to(device) for n, p in hf.named_parameters()}},
                       {r: dict(generator.named_parameters()) if r == rank else poisoned_destination(generator.layout, r)
                        for r in range(world)})
    return generator


def fp8_gemm_tp_logits(port: int, rank: int, world: int, granularity: str):
    """This rank's logits (a float32 numpy array: a tensor would travel by shared
    memory its process takes away) from the FP8-GEMM generator at TP `world` over gloo."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        config, hf = fp8_gemm_model()
        generator = fp8_gemm_generator(config, hf, granularity, "fp8", world=world, rank=rank)
        ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            return generator(ids).float().numpy()
    finally:
        dist.destroy_process_group()
