"""LlamaGenerator: vLLM's fused layout, logits equal to transformers' models after a sync."""

import datetime

import pytest
import torch
import torch.distributed as dist

import generator_workers as workers
from helpers import CONFIG_KINDS, run_processes
from llamarl_core.models.llama_generator import LlamaGenerator
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp


@pytest.mark.parametrize("kind", [*CONFIG_KINDS, "llama3_rope"])
def test_tp1_after_sync_matches_transformers(kind):
    config, hf, generator = workers.synced_generator(kind, 3)
    # Its parameters are exactly the generator layout's tensors.
    specs = vllm_llama_tp(config, 1, torch.float32).local_tensor_specs(0)
    assert {n: (tuple(p.shape), p.dtype) for n, p in generator.named_parameters()} == specs
    ids = torch.randint(0, config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        assert (generator(ids) - expected).abs().max().item() <= 1e-4
        cache = generator.new_cache()
        steps = [generator(ids[:, :10], cache)] + [generator(ids[:, i : i + 1], cache) for i in range(10, 17)]
        assert (torch.cat(steps, dim=1) - expected).abs().max().item() <= 1e-4
        assert cache.length == 17


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_generator_computes_with_the_weights_its_sync_quantized(granularity):
    """LlamaGenerator(fp8=...): its parameters are the FP8 layout's tensors (float8
    weights, float32 scales); after a sync from the trainer's float32 weights they
    equal the FP8 reference, and its logits equal, bit for bit, those of a plain
    generator holding q x scale (float64 products rounded to float32), and decoding
    with its KV cache gives them again; the FP8 rounding moves them off
    transformers' by less than 0.25."""
    from llamarl_core.ops.fp8 import expand_scale
    from llamarl_core.sync.reference import reference_vllm_fp8_shards, reference_vllm_tp_shards

    config, hf, generator = workers.synced_generator("llama_gqa_bias", 7, granularity)
    layout = vllm_llama_tp(config, 1, torch.float32, fp8=granularity)
    assert {n: (tuple(p.shape), p.dtype) for n, p in generator.named_parameters()} == layout.local_tensor_specs(0)
    state = {n: p.detach() for n, p in hf.named_parameters()}
    quantized = reference_vllm_fp8_shards(state, config, 1, granularity, torch.float32)[0]
    params = dict(generator.named_parameters())
    assert all(torch.equal(params[n].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else params[n],
                           t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t) for n, t in quantized.items())
    plain = LlamaGenerator(config)
    weights = reference_vllm_tp_shards(state, config, 1, torch.float32)[0]
    for name, q in quantized.items():
        if q.dtype != torch.float8_e4m3fn:
            continue
        scale = quantized[name[: -len("weight")] + ("weight_scale_inv" if granularity == "block" else "weight_scale")]
        kind = granularity
        if scale.dim() == 1:  # one per fused part: q, k, v or gate, up rows, from the config
            head_dim = config.hidden_size // config.num_attention_heads
            rows = ([config.num_attention_heads * head_dim] + [config.num_key_value_heads * head_dim] * 2
                    if "qkv_proj" in name else [config.intermediate_size] * 2)
            scale, kind = scale.repeat_interleave(torch.tensor(rows))[:, None], "channel"
        full = expand_scale(scale.to(torch.float64), tuple(q.shape), kind)
        weights[name] = (q.to(torch.float64) * full).to(torch.float32)
    plain.load_state_dict(weights)
    ids = torch.randint(0, config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = generator(ids)
        assert torch.equal(logits, plain(ids))
        cache = generator.new_cache()
        steps = [generator(ids[:, :10], cache)] + [generator(ids[:, i : i + 1], cache) for i in range(10, 17)]
        assert (torch.cat(steps, dim=1) - logits).abs().max().item() <= 1e-4  # other matmul shapes
        gap = (logits - hf(ids).logits).abs().max().item()
    print(f"{granularity}: max |FP8 logits - transformers'| = {gap:.4f}")
    assert 0 < gap < 0.25


@pytest.mark.parametrize("kind", ["llama_gqa_bias", "qwen2"])
def test_tp2_over_gloo_matches_transformers(kind):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    gaps = run_processes([(workers.tp_logits_gap, dict(port=store.port, rank=r, world=2, kind=kind, seed=5))
                          for r in range(2)], timeout=180)
    assert max(gaps) <= 1e-4, gaps


def test_fp8_tp2_over_gloo_matches_fp8_tp1():
    """Per-tensor FP8 at TP 2 (scales of whole tensors, one per fused q / k / v and
    gate / up part, so the same FP8 values as at TP 1): each rank, synced from the
    trainer's weights, gives the TP 1 FP8 generator's logits within 1e-4 (the
    row-parallel sums add in another order), with and without its KV cache."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    gaps = run_processes([(workers.tp_logits_gap, dict(port=store.port, rank=r, world=2, kind="llama_gqa_bias",
                                                       seed=5, fp8="tensor")) for r in range(2)], timeout=180)
    assert max(gaps) <= 1e-4, gaps


def test_bad_configuration_is_refused():
    config, _ = workers.hf_model("mistral", 0)
    with pytest.raises(ValueError, match="process group"):
        LlamaGenerator(config, tp_size=2)
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        LlamaGenerator(config)


def test_generate_records_the_logprobs_it_samples_from():
    config, hf, generator = workers.synced_generator("llama_gqa_bias", 4)
    prompts = torch.randint(0, config.vocab_size, (4, 6), generator=torch.Generator().manual_seed(2))
    out = generator.generate(prompts, 9, temperature=0.7, generator=torch.Generator().manual_seed(3))
    assert out.tokens.shape == out.logprobs.shape == (4, 9) and not out.padding.any()
    # Teacher-forced through transformers: the recorded log-probs are log_softmax(logits / 0.7) at the sampled tokens.
    with torch.no_grad():
        logits = hf(torch.cat([prompts, out.tokens], 1)).logits[:, 5:-1]
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, out.tokens[..., None]).squeeze(-1)
    assert (out.logprobs - expected).abs().max().item() <= 1e-4
    assert (out.logprobs <= 0).all()
    # The same generator state gives the same samples.
    again = generator.generate(prompts, 9, temperature=0.7, generator=torch.Generator().manual_seed(3))
    assert torch.equal(again.tokens, out.tokens)


def test_generate_stops_sequences_at_eos():
    config, _, generator = workers.synced_generator("mistral", 6)
    prompts = torch.randint(0, config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(1))
    free = generator.generate(prompts, 12, generator=torch.Generator().manual_seed(0))
    eos = int(free.tokens[0, 3])  # a token row 0 samples at step 3
    # Same generator state: every row samples the same tokens until its first eos.
    out = generator.generate(prompts, 12, eos_token_id=eos, generator=torch.Generator().manual_seed(0))
    for b in range(3):
        hits = (free.tokens[b] == eos).nonzero()
        stop = int(hits[0]) if len(hits) else 12
        assert torch.equal(out.tokens[b, : stop + 1], free.tokens[b, : stop + 1])
        assert not out.padding[b, : stop + 1].any()
        if stop + 1 < out.tokens.shape[1]:
            assert (out.tokens[b, stop + 1 :] == eos).all() and out.padding[b, stop + 1 :].all()
            assert (out.logprobs[b, stop + 1 :] == 0).all()
    assert out.padding.any()  # row 0 stopped early
    with pytest.raises(ValueError, match="temperature"):
        generator.generate(prompts, 2, temperature=0.0)


def test_weight_sync_lands_in_the_generator_parameters_it_samples_with():
    """A WeightReceiver registered with the generator's own parameters (shared-memory
    transport, a sender thread in this process): after one sync its logits are the
    trainer's."""
    import threading

    from llamarl_core.sync import WeightReceiver, WeightSender
    from llamarl_core.sync.reference import reference_fsdp_shards

    config, hf = workers.hf_model("llama_tied", 8)
    generator = LlamaGenerator(config)
    params = dict(generator.named_parameters())
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    client = lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False,  # noqa: E731
                                   timeout=datetime.timedelta(seconds=30))
    shards = reference_fsdp_shards({n: p.detach() for n, p in hf.named_parameters()}, 1, torch.float32)[0]
    sender_layout = hf_llama_fsdp(config, 1, torch.float32)
    sender = threading.Thread(target=lambda: WeightSender(client(), sender_layout, 0, shards, name="gen").send(1))
    sender.start()
    receiver = WeightReceiver(client(), vllm_llama_tp(config, 1, torch.float32), 0, params, name="gen")
    assert receiver.receive() == 1
    sender.join(timeout=30)
    assert all(p is params[n] for n, p in generator.named_parameters())  # the same Parameter objects
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (generator(ids) - hf(ids).logits).abs().max().item() <= 1e-4
