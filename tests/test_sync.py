"""Weight sync between real processes: trainer ranks -> generator ranks."""

import datetime
import itertools
import json
import multiprocessing as mp
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

import sync_workers as workers
from helpers import (
    CONFIG_KINDS,
    _child,
    llamarl_shm_entries,
    poisoned_destination,
    run_processes,
    run_with_small_dev_shm,
    small_config,
)
from llamarl_core.sync import SyncTimeoutError, WeightReceiver, WeightSender, hf_llama_fsdp, vllm_llama_tp


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    yield s


def _matrix():
    """Every FSDP world x TP size, both dtype pairs on the default transport and
    fp32 -> bf16 on the point-to-point transport; model configs rotated; FP8
    destinations."""
    scenarios = []
    combos = list(itertools.product([1, 2, 3], [1, 2, 4]))
    for i, (fsdp, tp) in enumerate(combos):
        for j, (dtype, transport) in enumerate([("fp32", "auto"), ("bf16", "auto"), ("fp32", "p2p")]):
            scenarios.append(dict(config=CONFIG_KINDS[(i + j) % len(CONFIG_KINDS)], fsdp=fsdp, tp=tp,
                                  src_dtype=dtype, transport=transport, seed=100 * i + 10 * j))
    # FP8 generator weights: every granularity at TP 1 and 2, and once over p2p.
    for k, (granularity, tp) in enumerate(itertools.product(["tensor", "channel", "block"], [1, 2])):
        scenarios.append(dict(config=CONFIG_KINDS[k % len(CONFIG_KINDS)], fsdp=2, tp=tp, src_dtype="fp32",
                              transport="auto", seed=1000 + k, fp8=granularity))
    scenarios.append(dict(config="llama_gqa_bias", fsdp=3, tp=2, src_dtype="bf16", transport="p2p", seed=2000,
                          fp8="tensor"))
    return scenarios


def test_sync_between_processes_equals_reference(store):
    scenarios = _matrix()
    jobs = [(workers.sender_body, dict(port=store.port, rank=r, scenarios=scenarios)) for r in range(3)]
    jobs += [(workers.receiver_body, dict(port=store.port, rank=r, scenarios=scenarios)) for r in range(4)]
    results = run_processes(jobs, timeout=300)
    senders, receivers = results[:3], results[3:]
    for s in scenarios:
        name = workers.scenario_name(s)
        expected_transport = "shm" if s["transport"] == "auto" else "p2p"
        assert [senders[r][name] for r in range(s["fsdp"])] == [expected_transport] * s["fsdp"], name
        for r in range(s["tp"]):
            assert receivers[r][name] == [], (name, r)
    assert llamarl_shm_entries() == []


def test_sync_through_a_file_store(tmp_path):
    scenarios = [dict(config="qwen2", fsdp=2, tp=1, src_dtype="fp32", transport="auto", seed=3)]
    path = str(tmp_path / "store")
    jobs = [(workers.sender_body, dict(port=path, rank=r, scenarios=scenarios)) for r in range(2)]
    jobs += [(workers.receiver_body, dict(port=path, rank=0, scenarios=scenarios))]
    senders0, _, receiver = run_processes(jobs, timeout=180)
    name = workers.scenario_name(scenarios[0])
    assert senders0[name] == "shm"
    assert receiver[name] == []


def test_killed_sender_leaves_receiver_consistent_and_restart_completes(store):
    scenario = dict(config="llama_gqa_bias", fsdp=2, tp=2, src_dtype="fp32", transport="auto", seed=7,
                    bucket_bytes=4096)  # many small buckets, so the kill lands mid-sync
    torn_timeout = 8.0
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()

    def start(fn, **kw):
        p = ctx.Process(target=_child, args=(fn, dict(port=store.port, **kw), queue))
        p.start()
        return p

    receivers = [start(workers.torn_receiver_body, rank=r, scenario=scenario, torn_timeout=torn_timeout) for r in range(2)]
    sender0 = start(workers.sender_body, rank=0, scenarios=[scenario], versions=(1, 2, 3))
    doomed = start(workers.stalling_sender_body, rank=1, scenario=scenario, stall_in_version=2)
    procs = [*receivers, sender0, doomed]
    try:
        store.wait(["test/stalled/1"], datetime.timedelta(seconds=120))
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.join(timeout=30)
        assert doomed.exitcode == -signal.SIGKILL
        # The receivers must give up on version 2 within their timeout; then restart rank 1.
        time.sleep(1.0)
        restarted = start(workers.sender_body, rank=1, scenarios=[scenario], versions=(3,))
        procs.append(restarted)
        results = {}
        for _ in range(4):  # two receivers, sender 0, the restarted sender
            pid, status, value = queue.get(timeout=180)
            assert status == "ok", value
            results[pid] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
    for p in receivers:
        report = results[p.pid]
        assert report["v1"] == 1
        assert report["torn_receive"].startswith("SyncTimeoutError"), report
        assert "senders to finish" in report["torn_receive"]
        assert report["torn_elapsed"] < torn_timeout + 3, report
        assert report["version_after_torn"] == 1
        assert report["torn_flag"] is True
        assert report["weights_while_torn"].startswith("TornWeightsError")
        assert report["changed_by_torn_sync"] > 0  # version 2 really was partly written
        assert report["v3"] == 3
        assert report["v3_mismatches"] == []
    assert llamarl_shm_entries() == []


def test_receiver_without_senders_times_out(store):
    config = small_config("mistral")
    layout = vllm_llama_tp(config, 1, torch.bfloat16)
    start = time.monotonic()
    with pytest.raises(SyncTimeoutError, match="both sides' layouts"):
        WeightReceiver(store, layout, 0, poisoned_destination(layout, 0), name="lonely", timeout=1.0)
    assert time.monotonic() - start < 5


def test_registration_refuses_bad_tensors_before_publishing(store):
    config = small_config("mistral")
    layout = hf_llama_fsdp(config, 2, torch.float32)
    shards = {n: torch.zeros(layout.local_shape(n, 0)) for n in layout.params}
    shards["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"sender rank 0: 'model\.layers\.1\.mlp\.up_proj\.weight' has shape"):
        WeightSender(store, layout, 0, shards, name="bad", timeout=1.0)
    with pytest.raises(ValueError, match="outside the layout's world size"):
        WeightSender(store, layout, 2, shards, name="bad", timeout=1.0)
    prefixed = dist.PrefixStore("llamarl/sync/bad/", store)
    assert not prefixed.check(["src/0/info"])  # nothing was published


def test_transport_request_is_validated(store):
    config = small_config("mistral")
    layout = hf_llama_fsdp(config, 1, torch.float32)
    shards = {n: torch.zeros(layout.local_shape(n, 0)) for n in layout.params}
    from llamarl_core.sync.transports import choose_transport

    infos = [{"host": "a", "device": "cpu"}, {"host": "a", "device": "cpu"}]
    assert choose_transport("auto", infos) == "shm"
    assert choose_transport("auto", [{"host": "a", "device": "cpu"}, {"host": "b", "device": "cpu"}]) == "p2p"
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        choose_transport("cuda_ipc", infos)
    with pytest.raises(ValueError, match="one machine"):
        choose_transport("shm", [{"host": "a", "device": "cpu"}, {"host": "b", "device": "cpu"}])
    with pytest.raises(ValueError, match="transport must be"):
        WeightSender(store, layout, 0, shards, name="t", transport="rdma", timeout=1.0)


def test_fp8_sync_refuses_nonfinite_weights_on_every_rank(store):
    """Threads in one process (the shared-memory transport works within a process
    too): a NaN reaching receiver 0 fails both receivers at once, both torn."""
    import threading

    from llamarl_core.sync import SyncError, reference_fsdp_shards
    from helpers import hf_state_dict

    config = small_config("llama_gqa_bias")
    state = hf_state_dict(config, 21)
    state["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")  # rows of TP rank 0 only
    src_layout = hf_llama_fsdp(config, 1, torch.float32)
    dst_layout = vllm_llama_tp(config, 2, torch.bfloat16, fp8="tensor")
    outcome = {}

    def client():  # one Store client per thread: a client blocks while it waits
        return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=30))

    def receiver(rank):
        params = poisoned_destination(dst_layout, rank)
        with WeightReceiver(client(), dst_layout, rank, params, name="nan", timeout=30) as r:
            try:
                r.receive()
                outcome[rank] = "received"
            except SyncError as exc:
                outcome[rank] = (str(exc), r.torn, r.version)

    threads = [threading.Thread(target=receiver, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    shards = reference_fsdp_shards(state, 1, torch.float32)[0]
    with WeightSender(client(), src_layout, 0, shards, name="nan", timeout=30) as sender:
        sender.send(1)
    for t in threads:
        t.join(timeout=60)
    assert "qkv_proj.weight: contains NaN or inf" in outcome[0][0] and outcome[0][1:] == (True, None)
    assert "another rank received NaN or inf" in outcome[1][0] and outcome[1][1:] == (True, None)


_RECEIVER_ON_SMALL_DEV_SHM = """
import datetime, json, os, threading
import torch, torch.distributed as dist
from helpers import hf_state_dict, poisoned_destination, small_config
from llamarl_core.sync import SyncError, WeightReceiver, WeightSender, hf_llama_fsdp, reference_fsdp_shards, vllm_llama_tp

config = small_config("llama_tied")
layout = vllm_llama_tp(config, 1, torch.float32)
master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
client = lambda: dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=60))
out = {}

def sender():  # set-up needs both sides; this one waits for a memory handle that never comes
    shards = reference_fsdp_shards(hf_state_dict(config, 0), 1, torch.float32)[0]
    try:
        WeightSender(client(), hf_llama_fsdp(config, 1, torch.float32), 0, shards, name="small", timeout=3)
    except SyncError as exc:
        out["sender"] = str(exc)

thread = threading.Thread(target=sender)
thread.start()
params = poisoned_destination(layout, 0)
for t in params.values():
    t.copy_(torch.randn(t.shape).to(t.dtype))
before = {n: (t.data_ptr(), t.clone()) for n, t in params.items()}
out["param_bytes"] = sum(t.numel() * t.element_size() for t in params.values())
try:
    WeightReceiver(client(), layout, 0, params, name="small", timeout=30)
except RuntimeError as exc:
    out["error"] = str(exc)
thread.join()
out["changed"] = [n for n, (ptr, copy) in before.items()
                  if params[n].data_ptr() != ptr or not torch.equal(params[n].view(torch.uint8), copy.view(torch.uint8))]
fs = os.statvfs("/dev/shm")
out["free_after"] = fs.f_bavail * fs.f_frsize
print(json.dumps(out))
"""


def test_receiver_larger_than_dev_shm_fails_cleanly_with_tensors_unchanged():
    """A receiver whose CPU parameters (float32, ~1.9 MB) exceed a 1 MiB /dev/shm:
    registration raises naming the rank and the bytes needed and free, with every
    tensor where and as it was and nothing left in /dev/shm. Before posix_fallocate
    the process died with SIGBUS while copying the parameters in."""
    proc = run_with_small_dev_shm(_RECEIVER_ON_SMALL_DEV_SHM, "1M")
    assert proc.returncode == 0, f"child exited with {proc.returncode} ({-signal.SIGBUS} is SIGBUS): {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout)
    assert out["param_bytes"] > 1 << 20
    needed = re.search(r"receiver rank 0: cannot move its \d+ tensors into shared memory, none moved: "
                       r"shared memory region needs (\d+) bytes, /dev/shm has 1048576 bytes free", out.get("error", ""))
    assert needed, out
    assert int(needed.group(1)) >= out["param_bytes"]
    assert out["changed"] == []
    assert out["free_after"] == 1 << 20
    assert "receiver 0's memory handle" in out["sender"]  # the failed receiver published no handle
