"""Weight sync between real processes: trainer ranks -> generator ranks."""

import datetime
import itertools
import json
import os
import re
import signal
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import sync_workers as workers
from helpers import (CONFIG_KINDS, hf_state_dict, in_threads, llamarl_shm_entries, rank_context, run_processes,
                     run_with_small_dev_shm, small_config, start_rank, store_client)
from sync_checks import mismatches, poisoned_destination
from llamarl_core.sync import (Layout, ParamSpec, RelayError, SyncError, SyncTimeoutError, TornWeightsError, WeightReceiver,
                               WeightSender)
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp
from llamarl_core.sync.protocol import abandon_receivers
from llamarl_core.sync.reference import reference_fsdp_shards, reference_vllm_tp_shards
from llamarl_core.sync import transports
from llamarl_core.sync.reference import reference_vllm_fp8_shards
from llamarl_core.sync.transports import choose_transports, device_info


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    yield s


def _matrix():
    """Every FSDP world x TP size, each with one of: fp32 or bf16 sources on the
    default transport, fp32 -> bf16 on the point-to-point transport (in small
    buckets), each once per FSDP world and once per TP size; model configs
    rotated; FP8 destinations. (The plans themselves: test_plan.py, thousands.)"""
    scenarios = []
    combos = list(itertools.product([1, 2, 3], [1, 2, 4]))
    kinds = [("fp32", "auto"), ("bf16", "auto"), ("fp32", "p2p")]
    for i, (fsdp, tp) in enumerate(combos):
        dtype, transport = kinds[(i + i // 3) % 3]  # a Latin square over (FSDP world, TP size)
        # Point-to-point in buckets of 8 KiB: hundreds per pair, through both staging buffers.
        scenarios.append(dict(config=CONFIG_KINDS[i % len(CONFIG_KINDS)], fsdp=fsdp, tp=tp, src_dtype=dtype,
                              transport=transport, seed=100 * i, **({"bucket_bytes": 8192} if transport == "p2p" else {})))
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
    # The senders quantize FP8 with the grouped kernels (in the interpreter here), the receivers' reference on the
    # torch path.
    jobs += [(workers.receiver_body, dict(port=store.port, rank=r, scenarios=scenarios, interpreter=False))
             for r in range(4)]
    results = run_processes(jobs, timeout=300)
    senders, receivers = results[:3], results[3:]
    for s in scenarios:
        name = workers.scenario_name(s)
        expected_transport = "shm" if s["transport"] == "auto" else "p2p"
        assert [senders[r][name] for r in range(s["fsdp"])] == [expected_transport] * s["fsdp"], name
        for r in range(s["tp"]):
            assert receivers[r][name] == [], (name, r)
    assert llamarl_shm_entries() == []


def _amax_scenarios() -> dict[str, dict]:
    """FP8 syncs at FSDP 2 -> TP 2, each on a Store of its own (its "port", set by
    the fixture): the senders share groups (per tensor: every scale), or share
    none but still agree on NaN (per channel: FSDP rows are whole rows); plain
    twins count the keys the rest of the protocol leaves. "nan-*": the 2nd send
    of version 2 has a NaN in rows of FSDP rank 0, the 3rd sends version 2 again
    with finite weights, and sender 0 reaches that retry's exchange 2 s after
    sender 1."""
    base = dict(fsdp=2, tp=2, src_dtype="fp32", versions=(1, 2, 3, 4))
    # The retry waits until both receivers have seen the failed send fail (sync_workers: saw-failure).
    nan = dict(versions=(1, 2, 2, 3), poisoned=(1,), failing=(1,), stall_amax=(0, 2, 2.0),
               send_after={2: [f"saw-failure/1/{rank}" for rank in range(2)]})
    return {
        "channel-shm": dict(base, config="llama_gqa_bias", transport="auto", fp8="channel", seed=3000),
        "tensor-shm": dict(base, config="qwen2", transport="auto", fp8="tensor", seed=3010),
        "tensor-p2p": dict(base, config="mistral", transport="p2p", fp8="tensor", seed=3020),
        "plain-shm": dict(base, config="llama_gqa_bias", transport="auto", seed=3030),
        "plain-p2p": dict(base, config="mistral", transport="p2p", seed=3040),
        "nan-channel-shm": dict(base, config="llama_gqa_bias", transport="auto", fp8="channel", seed=3050, **nan),
        "nan-tensor-p2p": dict(base, config="qwen2", transport="p2p", fp8="tensor", seed=3060, **nan),
        # The same with deltas: each "nothing follows" takes its receiver's word as a stream does.
        "nan-tensor-p2p-delta": dict(base, config="qwen2", transport="p2p", fp8="tensor", seed=3100, delta=True,
                                     **nan),
        # Deltas of FP8 destinations: versions 2-4 change a few elements each, version 3 a scale too.
        "block-p2p-delta": dict(base, config="llama_gqa_bias", transport="p2p", fp8="block", seed=3110, delta=True,
                                changes="few"),
        "tensor-p2p-delta": dict(base, config="qwen2", transport="p2p", fp8="tensor", seed=3120, delta=True,
                                 changes="few"),
        "nan-block-shm-group": dict(base, config="llama_tied", transport="auto", fp8="block", seed=3070,
                                    amax_group=True, **nan),
        "tensor-p2p-group": dict(base, config="mistral", transport="p2p", fp8="tensor", seed=3080, amax_group=True),
        # Sender 1 registers 1 s after sender 0, which meanwhile reaches its first exchange.
        "tensor-shm-late": dict(base, config="qwen2", transport="auto", fp8="tensor", seed=3090, register_late=(1, 1.0)),
    }


@pytest.fixture(scope="module")
def amax_runs():
    """Every _amax_scenarios() scenario in one set of processes: (scenario -> [its
    receivers' results], scenario -> [its senders' failed sends], scenario -> its
    Store's number of keys afterwards, scenario -> the FP8 amax keys left in it).
    FP8 on the torch path: the subject is the exchange, not the kernels."""
    stores = {k: dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
              for k in _amax_scenarios()}
    scenarios = {k: dict(s, port=stores[k].port) for k, s in _amax_scenarios().items()}
    jobs = [(workers.sender_body, dict(port=0, rank=r, scenarios=list(scenarios.values()), interpreter=False))
            for r in range(2)]
    jobs += [(workers.receiver_body, dict(port=0, rank=r, scenarios=list(scenarios.values()), interpreter=False))
             for r in range(2)]
    results = run_processes(jobs, timeout=600)
    received = {k: [results[2 + r][workers.scenario_name(s)] for r in range(2)] for k, s in scenarios.items()}
    failed = {k: [results[r][f"{workers.scenario_name(s)}/failed"] for r in range(2)] for k, s in scenarios.items()}
    left = {k: workers.amax_keys_left(stores[k], s, versions=(1, 2, 3, 4)) for k, s in scenarios.items()}
    sent = {k: [results[r].get(f"{workers.scenario_name(s)}/sent") for r in range(2)] for k, s in scenarios.items()}
    return received, failed, {k: store.num_keys() for k, store in stores.items()}, left, sent


def test_fp8_syncs_leave_no_amax_keys_in_the_store(amax_runs):
    """Four FP8 syncs leave their Store with exactly the keys of the same syncs
    without FP8: every amax key is deleted once both senders have read it, and
    the weights equal the reference (quantized from the senders' float32), also
    where a sender registered after the other reached its first exchange (both then
    read each other's registration before naming the exchange's keys; before, each
    waited under keys of its own until both timed out)."""
    received, failed, num_keys, left, _ = amax_runs
    for fp8, plain in [("channel-shm", "plain-shm"), ("tensor-shm", "plain-shm"), ("tensor-p2p", "plain-p2p"),
                       ("tensor-shm-late", "plain-shm")]:
        assert received[fp8] == [[], []] and failed[fp8] == [[], []], fp8
        assert num_keys[fp8] == num_keys[plain], (fp8, num_keys)
    assert received["plain-shm"] == received["plain-p2p"] == [[], []]
    assert all(keys == [] for keys in left.values()), left


def test_fp8_nan_on_one_sender_fails_every_send_before_a_byte_moves(amax_runs):
    """A NaN on sender 0 fails version 2 on both senders (sender 0 naming the
    tensor, sender 1 told by the exchange) before either writes: the receivers
    fail naming a sender, those fed point to point at once and with nothing
    written. The retry of version 2 (same number, finite weights) then lands on
    both receivers, equal to the reference, though sender 1 reaches its exchange
    2 s before sender 0: it waits for sender 0's fresh amaxes instead of reading
    the failed attempt's "nonfinite"; no amax key is left."""
    received, failed, _, left, _ = amax_runs
    for name in ["nan-channel-shm", "nan-tensor-p2p", "nan-tensor-p2p-delta", "nan-block-shm-group"]:
        sender0, sender1 = failed[name]
        assert len(sender0) == 1 and re.match(
            r"step 1: sender rank 0, version 2: source 'model\.layers\.0\.self_attn\.q_proj\.weight' \(for FP8 "
            r"destination 'model\.layers\.0\.self_attn\.qkv_proj\.weight' on rank 0\) contains NaN or inf; "
            r"refusing to quantize it to FP8; nothing was written", sender0[0]), (name, sender0)
        assert sender1 == ["step 1: sender rank 1, version 2: sender rank(s) [0] hold NaN or inf for an FP8 "
                           "destination; nothing was written"], (name, sender1)
        for rank, lines in enumerate(received[name]):
            assert len(lines) == 1 and re.match(rf"step 1: torn (True|False): receiver rank {rank}: sender rank", lines[0]), (name, lines)
            if "p2p" in name:  # both senders' headers said so, and their reports are read
                assert lines[0].startswith(f"step 1: torn False: receiver rank {rank}: sender ranks "), lines[0]
                # Each sender's report, unless it already sends again (the retry clears it).
                for rank_line in ("sender rank 0 failed: SyncError: sender rank 0, version 2: source 'model",
                                  "sender rank 1 failed: SyncError: sender rank 1, version 2: sender rank(s) [0] hold"):
                    sender = rank_line.split(" failed")[0]
                    assert rank_line in lines[0] or f"{sender}: its report no longer stands" in lines[0], lines[0]
                assert lines[0].endswith("; nothing was written"), lines[0]
        assert left[name] == []


def test_fp8_deltas_equal_full_fp8_syncs_and_send_only_what_changed(amax_runs):
    """FP8 destinations with delta=True, point to point: every version lands equal,
    bit for bit, to the reference quantization of the senders' float32 (what a full
    FP8 sync writes); versions that change a few elements send a small part of the
    bytes, the one that rescales a row's block (a channel, a tensor) more: every
    FP8 byte under a changed scale changes with it."""
    received, failed, _, _, sent = amax_runs
    for name in ("block-p2p-delta", "tensor-p2p-delta"):
        assert received[name] == [[], []] and failed[name] == [[], []], name
        total = [{k: sum(rank[v][k] for rank in sent[name]) for k in ("wire_bytes", "full_bytes", "changed",
                                                                        "dense_buckets", "full_receivers")}
                 for v in range(4)]
        assert total[0]["full_receivers"] == 4 and total[0]["wire_bytes"] >= total[0]["full_bytes"], (name, total)
        for v in (1, 3):  # a few elements: their FP8 bytes (a scale moves with them only if the amax does)
            assert 0 < total[v]["changed"] and total[v]["wire_bytes"] < 0.1 * total[v]["full_bytes"], (name, total)
        assert total[2]["changed"] > total[1]["changed"], (name, total)  # the rescaled row's block / tensor
    # Per tensor, the rescale changes every byte of the q_proj tensor; per block, one 128-wide block's.
    assert sum(r[2]["changed"] for r in sent["tensor-p2p-delta"]) > sum(r[2]["changed"] for r in sent["block-p2p-delta"])


def test_fp8_amaxes_reduced_over_the_senders_group_equal_reference(amax_runs):
    """group=: the shared amaxes go through an all-reduce over the senders' own gloo
    group (no Store keys), bitwise equal to the reference; the NaN scenario above
    runs over a group too."""
    received, failed, num_keys, _, _ = amax_runs
    assert received["tensor-p2p-group"] == [[], []] and failed["tensor-p2p-group"] == [[], []]


def test_fp8_rank_that_missed_an_exchange_puts_only_that_version_out_of_step(store):
    """Sender 1 holds back version 2 until sender 0, which sent it, has timed out
    waiting for its amaxes; sender 1's version 2 then fails at once on sender 0's
    "timed-out" marker instead of waiting. Version 3 then lands, equal to the
    reference, and no amax key is left. (Keyed by a send counter, sender 1's
    exchanges would trail sender 0's from here on and every later FP8 sync
    would fail.)"""
    scenario = dict(config="llama_gqa_bias", fsdp=2, tp=1, src_dtype="fp32", transport="auto", fp8="tensor",
                    seed=3100)
    jobs = [(workers.late_rank_sender_body, dict(port=store.port, rank=r, scenario=scenario)) for r in range(2)]
    jobs += [(workers.polling_receiver_body, dict(port=store.port, rank=0, scenario=scenario))]
    rank0, rank1, receiver = run_processes(jobs, timeout=300)
    assert rank0["v1"] == rank1["v1"] == 1
    assert rank0["v2"].startswith("SyncTimeoutError: timed out waiting for the FP8 amaxes of sync (2, 0)"), rank0
    assert rank1["v2"].startswith("SyncTimeoutError: sender rank 0 timed out in the FP8 amax exchange of sync (2, 0)"), rank1
    assert rank0["v3"] == rank1["v3"] == 3
    assert receiver == {"v1": 1, "v3": 3, "v3_mismatches": []}
    assert rank0["amax_keys_left"] == rank1["amax_keys_left"] == []


def test_fp8_destination_holds_its_fp8_weights_and_scales_and_the_staging_buckets_only(store):
    """A generator process receiving 64 MiB of FP8 weights (per channel and per
    block) from a float32 trainer, point to point in 4 MiB buckets: its peak RSS
    past the allocation of its own FP8 weights and scales grows by less than its
    two staging buckets plus 16 MiB (gloo's buffers, allocator slack), where bf16
    landing rows would add 128 MiB; the weights equal the reference; the sender
    keeps one FP8 byte per element it sends."""
    jobs = [(workers.fp8_memory_sender_body, dict(port=store.port)),
            (workers.fp8_memory_receiver_body, dict(port=store.port))]
    sender, receiver = run_processes(jobs, timeout=300, start_method="spawn")  # its memory is measured
    elements = sum(rows * cols for rows, cols in workers.FP8_MEMORY["shapes"])
    assert receiver["mismatches"] == []
    assert receiver["staging"] == 2 * workers.FP8_MEMORY["bucket_bytes"]
    assert receiver["registered"] < elements * 1.01  # FP8 bytes, and scales
    assert receiver["growth"] < receiver["staging"] + (16 << 20), receiver
    print(f"receiver peak RSS growth {receiver['growth'] / 2**20:.1f} MiB (staging {receiver['staging'] / 2**20:.0f} "
          f"MiB, FP8 weights and scales {receiver['registered'] / 2**20:.1f} MiB)")
    assert sender["packed_bytes"] == elements


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
    # The restarted sender must register before the receivers give up on version 2 and
    # open version 3's ticket (it serves from the next ticket on). A spawned child took
    # 8.5 s to import torch + transformers on this machine when 2 cores were shared by
    # 4 users; a rank forked from the forkserver imports nothing (under a second).
    torn_timeout = 10.0
    ctx = rank_context()
    queue = ctx.Queue()

    def start(fn, **kw):
        return start_rank(ctx, queue, fn, dict(port=store.port, **kw))

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
        assert "no word from sender rank 1 " in report["torn_receive"], report  # the one killed
        assert report["torn_elapsed"] < torn_timeout + 3, report
        assert report["version_after_torn"] == 1
        assert report["torn_flag"] is True
        assert report["weights_while_torn"].startswith("TornWeightsError")
        assert report["changed_by_torn_sync"] > 0  # version 2 really was partly written
        assert report["v3"] == 3
        assert report["v3_mismatches"] == []
    assert llamarl_shm_entries() == []


@pytest.mark.parametrize("kind", ["tcp", "file"])
def test_receiver_without_senders_times_out(store, tmp_path, kind):
    """SyncTimeoutError from every Store the README names (FileStore's own wait
    timeout is a plain RuntimeError, not TCPStore's DistStoreError), naming the
    rank that never answered."""
    if kind == "file":
        store = dist.FileStore(str(tmp_path / "store"), 1)
    config = small_config("mistral")
    layout = vllm_llama_tp(config, 1, torch.bfloat16)
    start = time.monotonic()
    with pytest.raises(SyncTimeoutError, match="both sides' layouts: no word from sender rank 0 "):
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
    shards["model.layers.1.mlp.up_proj.weight"] = torch.zeros(layout.local_shape("model.layers.1.mlp.up_proj.weight", 0))
    receiver_layout = vllm_llama_tp(config, 1, torch.float32)
    # Arguments that are not ints, or too small (a float rank was published as "0.0" and
    # both sides waited out their timeouts; a NaN bucket size cut the plan into elements).
    for kwargs, named in [(dict(rank=0.0), "rank"), (dict(rank=False), "rank"), (dict(num_threads=-3), "num_threads"),
                          (dict(num_threads=0), "num_threads"), (dict(num_threads=1.5), "num_threads"),
                          (dict(num_threads="2"), "num_threads"), (dict(bucket_bytes=float("nan")), "bucket_bytes"),
                          (dict(bucket_bytes=True), "bucket_bytes"), (dict(bucket_bytes="64"), "bucket_bytes")]:
        args = {"rank": 0, **kwargs}
        with pytest.raises(ValueError, match=f"^{named} must be an int >= "):
            WeightSender(store, layout, args.pop("rank"), shards, name="bad", timeout=1.0, **args)
        args = {"rank": 0, **kwargs}
        with pytest.raises(ValueError, match=f"^{named} must be an int >= "):
            WeightReceiver(store, receiver_layout, args.pop("rank"), poisoned_destination(receiver_layout, 0),
                           name="bad", timeout=1.0, **args)
    flags = Layout(1, [ParamSpec("flags", (4,), torch.bool)])
    with pytest.raises(ValueError, match=r"^sender rank 0: parameter 'flags' is torch.bool, which a sync between "):
        WeightSender(store, flags, 0, {"flags": torch.zeros(4, dtype=torch.bool)}, name="bad", timeout=1.0)
    with pytest.raises(ValueError, match=r"^receiver rank 0: parameter 'flags' is torch.bool, which a sync between"):
        WeightReceiver(store, flags, 0, {"flags": torch.zeros(4, dtype=torch.bool)}, name="bad", timeout=1.0)
    with pytest.raises(ValueError, match="^bucket_bytes must be an int >= 1, got None"):
        WeightSender(store, layout, 0, shards, name="bad", timeout=1.0, bucket_bytes=None)
    for name in (None, 5, b"w", ""):
        with pytest.raises(ValueError, match=f"^name must be a non-empty str, got {re.escape(repr(name))}"):
            WeightSender(store, layout, 0, shards, name=name, timeout=1.0)
    # Tensors whose bytes are not their values: a lazily negated view, a meta tensor.
    negated = dict(shards, **{"model.norm.weight": shards["model.norm.weight"].clone()._neg_view()})
    with pytest.raises(ValueError, match=r"sender rank 0: 'model\.norm\.weight' is a lazily negated view"):
        WeightSender(store, layout, 0, negated, name="bad", timeout=1.0)
    with torch.device("meta"):
        meta = poisoned_destination(receiver_layout, 0)
    with pytest.raises(ValueError, match="receiver rank 0: '.*' is on the meta device"):
        WeightReceiver(store, receiver_layout, 0, meta, name="bad", timeout=1.0)
    prefixed = dist.PrefixStore("llamarl/sync/bad/", store)
    assert not prefixed.check(["src/0/info"]) and not prefixed.check(["dst/0/info"])  # nothing was published


def choose_transport(requested, senders, receivers, pairs=None) -> str:
    """The one transport every pair gets (these cases put all ranks on one host, or none)."""
    chosen = set(choose_transports(requested, senders, receivers, pairs).values())
    assert len(chosen) == 1, chosen
    return chosen.pop()


def test_transport_request_is_validated(store):
    config = small_config("mistral")
    layout = hf_llama_fsdp(config, 1, torch.float32)
    shards = {n: torch.zeros(layout.local_shape(n, 0)) for n in layout.params}
    a, b = {"host": "a", "device": "cpu", "process": "1/x"}, {"host": "b", "device": "cpu", "process": "2/y"}
    assert choose_transport("auto", [a], [a]) == "shm"
    assert choose_transport("auto", [a], [b]) == "p2p"
    assert choose_transport("p2p", [a], [a]) == "p2p"
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        choose_transport("cuda_ipc", [a], [a])
    with pytest.raises(ValueError, match="one machine, but sender 0 and receiver 0 are on different hosts"):
        choose_transport("shm", [a], [b])
    with pytest.raises(ValueError, match="one device type"):
        choose_transport("auto", [a], [_gpu(1, "g0")])
    with pytest.raises(ValueError, match="transport must be"):
        WeightSender(store, layout, 0, shards, name="t", transport="rdma", timeout=1.0)
    assert "ipc_error" not in device_info(torch.device("cpu"), shards)


def test_ranks_of_another_wire_format_are_refused_by_name():
    """Set-up compares every rank's point-to-point wire format with this
    llamarl_core's: a rank of another version (or of one before the format was
    published) is named, before a message moves."""
    from llamarl_core.sync.endpoint import check_wire_formats
    from llamarl_core.sync.protocol import P2P_WIRE_FORMAT

    ours = {"host": "a", "device": "cpu", "wire": P2P_WIRE_FORMAT}
    check_wire_formats([ours, ours], ["sender rank 0", "receiver rank 0"], "receiver rank 0")
    # 2: the checksum before 505fef6's, which a receiver of this version never matches.
    with pytest.raises(ValueError, match=r"sender rank 0 \(2\), receiver rank 1 \(none\) speak another"):
        check_wire_formats([{**ours, "wire": 2}, ours, {"host": "b", "device": "cpu"}],
                           ["sender rank 0", "receiver rank 0", "receiver rank 1"], "receiver rank 0")


def test_transport_per_pair_across_hosts():
    """'auto' shares memory within a host and goes point-to-point between hosts, pair by pair."""
    h1 = [{"host": "h1", "device": "cpu", "process": f"{p}/x"} for p in range(2)]
    h2 = [{"host": "h2", "device": "cpu", "process": f"{p}/y"} for p in range(2)]
    senders, receivers = [h1[0], h2[0]], [h1[1], h2[1]]
    assert choose_transports("auto", senders, receivers) == {(0, 0): "shm", (0, 1): "p2p", (1, 0): "p2p", (1, 1): "shm"}
    assert choose_transports("auto", senders, receivers, [(0, 0), (1, 0)]) == {(0, 0): "shm", (1, 0): "p2p"}
    assert set(choose_transports("p2p", senders, receivers).values()) == {"p2p"}
    with pytest.raises(ValueError, match="sender 0 and receiver 1 are on different hosts"):
        choose_transports("shm", senders, receivers)
    gpus = [_gpu(1, "g0", host="h1"), _gpu(2, "g1", _BOTH, host="h2")], [_gpu(3, "g0", host="h1"), _gpu(4, "g1", host="h2")]
    assert choose_transports("auto", *gpus, [(0, 0), (0, 1), (1, 1)]) == {(0, 0): "cuda_ipc", (0, 1): "p2p",
                                                                          (1, 1): "cuda_ipc"}


def _gpu(process: int, uuid: str, gpus: dict | None = None, ipc_error: str | None = None, host: str = "h") -> dict:
    """A CUDA rank's device_info: `gpus` maps the UUIDs it sees to peer access."""
    return {"host": host, "process": f"{process}/token", "device": "cuda", "uuid": uuid,
            "gpus": gpus or {uuid: True}, "ipc_error": ipc_error}


_EXPANDABLE = "'w' is not in memory from cudaMalloc (PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True' here"
_BOTH = {"g0": True, "g1": True}
_NO_PEER = {"g0": True, "g1": False}

# (senders, receivers, pairs, what 'auto' picks: one transport for every pair, a dict
# per pair, or the error it refuses with; the obstacle 'cuda_ipc' raises with, if any)
_CUDA_CASES = [
    # one process, one GPU: copied directly, even from memory CUDA IPC cannot export
    ([_gpu(1, "g0")], [_gpu(1, "g0", ipc_error=_EXPANDABLE)], None, "cuda_ipc", None),
    # one process, two GPUs: direct copies need peer access
    ([_gpu(1, "g0", _BOTH)], [_gpu(1, "g1", _BOTH)], None, "cuda_ipc", None),
    ([_gpu(1, "g0", _NO_PEER)], [_gpu(1, "g1", _NO_PEER)], None, "p2p", "cudaDeviceCanAccessPeer is 0"),
    # two processes: IPC needs exportable memory, peer access and the GPU visible
    ([_gpu(1, "g0", _BOTH)], [_gpu(2, "g1", _BOTH)], None, "cuda_ipc", None),
    # ... and on one GPU nothing else will do: NCCL connects one rank per GPU
    ([_gpu(1, "g0")], [_gpu(2, "g0", ipc_error=_EXPANDABLE)], None,
     ValueError("sender 0 and receiver 0 share GPU g0 from two processes, and CUDA IPC cannot serve them"),
     "expandable_segments:True"),
    ([_gpu(1, "g0", _NO_PEER)], [_gpu(2, "g1")], None, "p2p", "sender 0's GPU g0 cannot access receiver 0's GPU g1"),
    ([_gpu(1, "g0")], [_gpu(2, "g1")], None, "p2p", "receiver 0's GPU g1 is not visible to sender 0"),
    # several ranks: only pairs that exchange bytes count, each pair on its own
    ([_gpu(1, "g0", _NO_PEER), _gpu(2, "g1", _BOTH)], [_gpu(3, "g0", _BOTH), _gpu(4, "g1", _BOTH)],
     [(0, 0), (1, 0), (1, 1)], "cuda_ipc", None),
    ([_gpu(1, "g0", _NO_PEER), _gpu(2, "g1", _BOTH)], [_gpu(3, "g0", _BOTH), _gpu(4, "g1", _BOTH)],
     None, {(0, 0): "cuda_ipc", (0, 1): "p2p", (1, 0): "cuda_ipc", (1, 1): "cuda_ipc"},
     "sender 0's GPU g0 cannot access receiver 1's GPU g1"),
    # a receiver in a sender's process: that pair is direct, the other sender needs IPC
    ([_gpu(1, "g0"), _gpu(2, "g0")], [_gpu(1, "g0", ipc_error=_EXPANDABLE)], [(0, 0)], "cuda_ipc", None),
    ([_gpu(1, "g0"), _gpu(2, "g0")], [_gpu(1, "g0", ipc_error=_EXPANDABLE)], None,
     ValueError("sender 1 and receiver 0 share GPU g0 from two processes"), "receiver 0: 'w' is not"),
]


@pytest.mark.parametrize("senders, receivers, pairs, auto, obstacle", _CUDA_CASES)
def test_cuda_transport_choice(senders, receivers, pairs, auto, obstacle):
    transports._warn_once.cache_clear()
    if obstacle is None:
        assert choose_transport("auto", senders, receivers, pairs) == "cuda_ipc"
        assert choose_transport("cuda_ipc", senders, receivers, pairs) == "cuda_ipc"
    else:
        if isinstance(auto, ValueError):  # refused, naming the pair and why: never sent to NCCL
            with pytest.raises(ValueError, match=re.escape(str(auto))) as refused:
                choose_transports("auto", senders, receivers, pairs)
            assert obstacle in str(refused.value)
        else:
            with pytest.warns(UserWarning, match="falling back to 'p2p'") as caught:
                chosen = choose_transports("auto", senders, receivers, pairs)
            assert chosen == auto if isinstance(auto, dict) else set(chosen.values()) == {auto}
            assert obstacle in str(caught[0].message)
        with pytest.raises(ValueError, match="cannot") as raised:
            choose_transport("cuda_ipc", senders, receivers, pairs)
        assert obstacle in str(raised.value)
    if any(s["uuid"] == receivers[d]["uuid"] for i, s in enumerate(senders) for d in range(len(receivers))
           if pairs is None or (i, d) in pairs):
        with pytest.raises(ValueError, match="transport 'p2p' cannot connect sender .* NCCL connects one rank per GPU"):
            choose_transport("p2p", senders, receivers, pairs)
    else:
        assert choose_transport("p2p", senders, receivers, pairs) == "p2p"
    on_two_hosts = [{**r, "host": "elsewhere", "uuid": f"other-{r['uuid']}"} for r in receivers]
    assert choose_transport("auto", senders, on_two_hosts, pairs) == "p2p"
    with pytest.raises(ValueError, match="one machine"):
        choose_transport("cuda_ipc", senders, on_two_hosts, pairs)
    with pytest.raises(ValueError, match="needs CPU tensors"):
        choose_transport("shm", senders, receivers, pairs)


def test_cuda_ipc_fallback_warns_once():
    transports._warn_once.cache_clear()
    senders, receivers = [_gpu(1, "g0", _NO_PEER)], [_gpu(2, "g1", _NO_PEER)]
    with pytest.warns(UserWarning, match="falling back"):
        choose_transport("auto", senders, receivers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_transport("auto", senders, receivers) == "p2p"


def _threaded_pair(store, name: str, transport: str, device: str = "cpu"):
    """A sender (FSDP 1) and a receiver (TP 1) registered from two threads of this
    process, each with its own Store client; returns (sender, receiver, params, reference v1)."""
    config = small_config("llama_gqa_bias")
    src_layout, dst_layout = hf_llama_fsdp(config, 1, torch.float32), vllm_llama_tp(config, 1, torch.bfloat16)
    shards = {n: t.to(device) for n, t in reference_fsdp_shards(hf_state_dict(config, 31), 1, torch.float32)[0].items()}
    params = {n: t.to(device) for n, t in poisoned_destination(dst_layout, 0).items()}
    made = {}

    def receiver():
        made["receiver"] = WeightReceiver(store_client(store), dst_layout, 0, params, name=name, transport=transport,
                                          timeout=30)

    thread = threading.Thread(target=receiver)
    thread.start()
    sender = WeightSender(store_client(store), src_layout, 0, shards, name=name, transport=transport, timeout=30)
    thread.join(timeout=60)
    expected = reference_vllm_tp_shards(hf_state_dict(config, 31), config, 1, torch.bfloat16)[0]
    return sender, made["receiver"], params, expected


def test_a_receive_that_fails_before_its_ticket_or_dies_with_it_open_does_not_stall_later_syncs(store):
    """A receive whose Store request fails before it opens its ticket (its look at
    the failure reports) leaves nothing for the sender to skip: the next versions
    land at once. A receiver killed with its ticket open, registered again under
    its name with new memory and a new board: the sender's next send maps them and
    the version lands there, well inside its timeout."""
    sender, receiver, params, expected = _threaded_pair(store, "unopened", "shm")
    nbytes, landed = in_threads(lambda: sender.send(1, timeout=10), lambda: receiver.receive(timeout=10))
    assert landed == 1 and nbytes > 0
    real_counter = receiver.channel.counter

    def failing_counter(key, delta=0):
        raise dist.DistNetworkError("simulated: connection reset while reading the failure count")

    receiver.channel.counter = failing_counter
    with pytest.raises(dist.DistNetworkError, match="simulated"):
        receiver.receive(timeout=2)
    receiver.channel.counter = real_counter
    assert not receiver.torn and receiver._board.current() is None  # no ticket opened, nothing written
    for version in (2, 3):
        start = time.monotonic()
        sent, landed = in_threads(lambda: sender.send(version, timeout=8), lambda: receiver.receive(timeout=8))
        assert landed == version and sent == nbytes, (sent, landed)
        assert time.monotonic() - start < 1  # no wait, let alone a timeout
    receiver._board.open_ticket(4, None)  # killed in its next receive: the ticket stays open, unserved
    config = small_config("llama_gqa_bias")
    again = WeightReceiver(store_client(store), vllm_llama_tp(config, 1, torch.bfloat16), 0, params, name="unopened",
                           transport="shm", timeout=30)
    for t in again.tensors.values():  # its own new memory, which the sender must now write
        t.zero_()
    start = time.monotonic()
    assert in_threads(lambda: sender.send(4, timeout=8), lambda: again.receive(timeout=8))[1] == 4
    assert time.monotonic() - start < 4
    assert mismatches(expected, {n: t.cpu() for n, t in again.weights().items()}) == []


def test_a_receiver_registered_again_while_a_send_waits_gets_it_in_its_own_memory(store):
    """A send waits for receiver 0, which meanwhile registers again under its name
    (a restarted generator rank, with new memory and a new ticket board): the
    sender finds the new receiver's ticket, maps its memory before copying a byte,
    and the version lands there (not in the predecessor's memory), as does the next."""
    sender, receiver, params, expected = _threaded_pair(store, "again-mid-send", "shm")
    assert in_threads(lambda: sender.send(1, timeout=10), lambda: receiver.receive(timeout=10))[1] == 1
    handle = sender.send(2, timeout=20, wait=False)
    deadline = time.monotonic() + 10
    while receiver.pending() != 2:  # the send is offered, and waits for a ticket
        assert time.monotonic() < deadline
        time.sleep(0.005)
    config = small_config("llama_gqa_bias")
    again = WeightReceiver(store_client(store), vllm_llama_tp(config, 1, torch.bfloat16), 0, params,
                           name="again-mid-send", transport="shm", timeout=30)
    for version in (2, 3):
        for t in again.tensors.values():  # its own new memory, which the sender must write
            t.zero_()
        if version == 3:
            handle = sender.send(3, timeout=20, wait=False)
        assert again.receive(timeout=20) == version and handle.wait(timeout=20) > 0
        assert mismatches(expected, {n: t.cpu() for n, t in again.weights().items()}) == [], version
    sender.close()
    again.close()


@pytest.mark.parametrize("transport", ["shm", "p2p"])
def test_receiver_refuses_storage_moved_since_registration(store, transport):
    sender, receiver, params, _ = _threaded_pair(store, f"moved-{transport}", transport)
    name = "model.layers.1.self_attn.qkv_proj.weight"
    registered = params[name].data
    params[name].data = torch.zeros_like(registered)  # as vLLM's post-processing or a reload does
    with pytest.raises(SyncError, match=rf"receiver rank 0: parameter '{re.escape(name)}' moved since registration"):
        receiver.receive(timeout=5)
    assert receiver.torn is False and receiver.version is None
    if transport == "shm":  # no ticket was opened: the sender has nothing to write into
        with pytest.raises(SyncTimeoutError, match="receiver 0 to ask for a version"):
            sender.send(1, timeout=0.5)
    assert torch.isnan(registered.float()).any() and not params[name].any()  # neither storage was written
    sender.close()
    receiver.close()


def test_point_to_point_timeout_and_rejoin_are_sync_errors(store):
    """Over gloo a receive nobody sends to raises SyncTimeoutError (gloo reports its
    own timeout as a bare RuntimeError); a rank registered again under the same name
    with point-to-point pairs is refused before it joins the group's rendezvous."""
    sender, receiver, _, _ = _threaded_pair(store, "p2p-timeout", "p2p")
    start = time.monotonic()
    with pytest.raises(SyncTimeoutError, match="receiving from sender 0 did not complete in time"):
        receiver.receive(timeout=1)
    assert time.monotonic() - start < 5 and receiver.torn
    config = small_config("llama_gqa_bias")
    layout = hf_llama_fsdp(config, 1, torch.float32)
    shards = reference_fsdp_shards(hf_state_dict(config, 31), 1, torch.float32)[0]
    with pytest.raises(ValueError, match="sender rank 0 registered again under the name 'p2p-timeout'"):
        WeightSender(store_client(store), layout, 0, shards, name="p2p-timeout", transport="p2p", timeout=5)
    sender.close()
    receiver.close()


@pytest.mark.parametrize("num_replicas, fsdp, tp, transport, fp8", [
    (2, 1, 1, "auto", None), (2, 2, 2, "auto", None), (4, 2, 1, "auto", None), (4, 2, 2, "p2p", None),
    (2, 2, 2, "auto", "tensor"), (3, 2, 4, "p2p", "block")])
def test_replicas_each_equal_the_reference_after_every_sync(store, num_replicas, fsdp, tp, transport, fp8):
    """Generator replicas x TP ranks, one thread each (their own Store clients): the
    trainer ranks send to replica 0, the others get each version by relay; every
    replica's tensors equal the plain-torch reference after each of three syncs.
    Point to point, with small buckets, each relay forwards every bucket as it lands
    (relay buckets mirror the received ones), down two levels of the relay tree.
    FP8 destinations: replica 0's senders quantize; the relays copy its FP8 weights
    and scales as they are, so every replica equals the FP8 reference bit for bit
    (at TP 4 two ranks hold each KV head, each quantized with its own blocks)."""
    config, versions = small_config("llama_gqa_bias"), (1, 2, 3)
    name = f"replicas-{num_replicas}-{fsdp}-{tp}-{transport}-{fp8}"
    options = dict(transport=transport, **({"bucket_bytes": 4096} if transport == "p2p" else {}))
    src_layout, dst_layout = (hf_llama_fsdp(config, fsdp, torch.float32),
                              vllm_llama_tp(config, tp, torch.bfloat16, fp8=fp8))
    states = {v: hf_state_dict(config, 500 + v) for v in versions}
    problems, errors = {}, []

    def sender(rank):
        try:
            shards = {n: t.clone() for n, t in reference_fsdp_shards(states[1], fsdp, torch.float32)[rank].items()}
            with WeightSender(store_client(store), src_layout, rank, shards, name=name, timeout=60,
                              **options) as endpoint:
                for v in versions:
                    for n, t in reference_fsdp_shards(states[v], fsdp, torch.float32)[rank].items():
                        shards[n].copy_(t)
                    endpoint.send(v)
        except Exception as exc:  # reported below: a thread's exception would vanish
            errors.append(f"sender {rank}: {exc!r}")

    def receiver(replica, rank):
        try:
            params = poisoned_destination(dst_layout, rank)
            with WeightReceiver(store_client(store), dst_layout, rank, params, name=name, timeout=60, replica=replica,
                                num_replicas=num_replicas, **options) as endpoint:
                for v in versions:
                    assert endpoint.receive() == v
                    expected = (reference_vllm_fp8_shards(states[v], config, tp, fp8, source_dtype=torch.float32)
                                if fp8 else reference_vllm_tp_shards(states[v], config, tp, torch.bfloat16))[rank]
                    problems[(replica, rank, v)] = mismatches(expected, endpoint.weights())
        except Exception as exc:
            errors.append(f"replica {replica} rank {rank}: {exc!r}")

    threads = [threading.Thread(target=sender, args=(r,)) for r in range(fsdp)]
    threads += [threading.Thread(target=receiver, args=(rep, r)) for rep in range(num_replicas) for r in range(tp)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == [] and not any(thread.is_alive() for thread in threads)
    assert sorted(problems) == sorted((rep, r, v) for rep in range(num_replicas) for r in range(tp) for v in versions)
    assert all(lines == [] for lines in problems.values()), {k: v for k, v in problems.items() if v}
    assert llamarl_shm_entries() == []


def test_a_lost_replica_is_abandoned_at_once_and_its_replacement_fed_by_replace_relay(store):
    """Replica 1 dies: its parent's relay, waiting for it to ask for a version, fails
    at once when the receivers are abandoned (RelayError: the version landed on the
    parent); a new replica 1 under a new name is fed once the parent replaces its relay (a
    receive asking for an older version than the parent holds is refused untouched),
    and both equal the reference."""
    config = small_config("llama_gqa_bias")
    src_layout, dst_layout = hf_llama_fsdp(config, 1, torch.float32), vllm_llama_tp(config, 1, torch.bfloat16)
    states = {v: hf_state_dict(config, 700 + v) for v in (1, 2, 3)}
    shards = {n: t.clone() for n, t in reference_fsdp_shards(states[1], 1, torch.float32)[0].items()}

    def receiver(name, replica):
        return WeightReceiver(store_client(store), dst_layout, 0, poisoned_destination(dst_layout, 0), name=name,
                              timeout=30, replica=replica, num_replicas=2)

    def send(version):
        for n, t in reference_fsdp_shards(states[version], 1, torch.float32)[0].items():
            shards[n].copy_(t)
        return sender.send(version)

    def check(endpoint, version):
        expected = reference_vllm_tp_shards(states[version], config, 1, torch.bfloat16)[0]
        assert mismatches(expected, endpoint.weights()) == []

    sender, parent, child = in_threads(
        lambda: WeightSender(store_client(store), src_layout, 0, shards, name="lost", timeout=30),
        lambda: receiver("lost", 0), lambda: receiver("lost", 1))
    assert in_threads(lambda: send(1), parent.receive, child.receive)[1:] == [1, 1]
    check(parent, 1)
    check(child, 1)
    with pytest.raises(ValueError, match=r"relay_to=\[3\]: replica 0 feeds replicas \[1\]"):
        parent.receive(relay_to=[3])
    child.close()  # its process died: it asks for no version again

    def abandon_soon():
        time.sleep(0.5)
        abandon_receivers(store_client(store), "lost/replica1", "replica 1 was lost")

    start = time.monotonic()
    _, landed, _ = in_threads(lambda: send(2), lambda: parent.receive(timeout=20), abandon_soon)
    assert isinstance(landed, RelayError) and time.monotonic() - start < 5, landed
    assert landed.version == 2 and list(landed.failed) == [1] and "replica 1 was lost" in landed.failed[1]
    assert parent.version == 2 and not parent.torn
    check(parent, 2)

    parent.replace_relay(1, "lost-2/replica1")  # set up in a thread: waits for the new child to register
    child = receiver("lost-2", 1)

    def stale_then_current():
        """A receive still asking for version 2 (queued before its feed died) is told it
        will not come, untouched; the next one gets version 3."""
        with pytest.raises(SyncError, match="version 2 will not come"):
            child.receive(expect=2)
        return child.receive(expect=3)

    results = in_threads(lambda: send(3), parent.receive, stale_then_current)
    assert results[1:] == [3, 3], results
    check(parent, 3)
    check(child, 3)
    for endpoint in (sender, parent, child):
        endpoint.close()
    assert llamarl_shm_entries() == []


def test_a_child_never_completes_a_version_its_parent_got_mixed(store):
    """After a good sync, two point-to-point trainer ranks send different versions:
    replica 0 refuses them (torn), and replica 1, fed bucket by bucket from the
    first sender's header, must not take what it was forwarded as a complete
    version either: it times out, torn; replica 0's relay to it fails at once
    afterwards."""
    config = small_config("llama_gqa_bias")
    src_layout, dst_layout = hf_llama_fsdp(config, 2, torch.float32), vllm_llama_tp(config, 1, torch.bfloat16)
    shards = reference_fsdp_shards(hf_state_dict(config, 800), 2, torch.float32)
    options = dict(name="mixed", transport="p2p", bucket_bytes=4096)

    def sender(rank):
        with WeightSender(store_client(store), src_layout, rank, shards[rank], timeout=30, **options) as endpoint:
            endpoint.send(1)
            endpoint.send(2 + rank)  # rank 0 sends version 2, rank 1 version 3

    def receiver(replica):
        return WeightReceiver(store_client(store), dst_layout, 0, poisoned_destination(dst_layout, 0), timeout=30,
                              replica=replica, num_replicas=2, **options)

    endpoints = {}

    def receive(replica, timeout):
        endpoints[replica] = receiver(replica)
        assert endpoints[replica].receive() == 1
        return endpoints[replica].receive(timeout=timeout)

    results = in_threads(lambda: sender(0), lambda: sender(1), lambda: receive(0, 20), lambda: receive(1, 3))
    parent, child = results[2:]
    assert isinstance(parent, SyncError) and "senders sent different versions [2, 3]" in str(parent), parent
    assert isinstance(child, SyncTimeoutError) and endpoints[1].torn and endpoints[1].version == 1, child
    with pytest.raises(TornWeightsError):
        endpoints[1].weights()
    assert "broke off in the middle of a version" in _relay_failure(endpoints[0])
    for endpoint in endpoints.values():
        endpoint.close()


def _relay_failure(parent: WeightReceiver) -> str:
    try:
        parent.relays.ready(1, time.monotonic() + 1)
    except SyncError as exc:
        return str(exc)
    return "the relay is ready"


def test_a_relay_that_breaks_off_mid_version_fails_at_once_until_replaced(store):
    """Point to point, replica 0 forwards each bucket to replica 1 as it lands. Replica
    1's process dies after unpacking 3 buckets of version 2: replica 0 still lands
    version 2 and says the relay failed (RelayError); at version 3 that relay fails at
    once, the pair holding part of a version; replace_relay then feeds version 4 to a
    new replica 1, and every copy equals the reference."""
    jobs = [(workers.relay_trainer_body, dict(port=store.port, versions=(1, 2, 3, 4))),
            (workers.relay_parent_body, dict(port=store.port, new_child="broken-relay-2")),
            (workers.dying_relay_child_body, dict(port=store.port)),
            (workers.relay_child_body, dict(port=store.port, name="broken-relay-2"))]
    _, parent, exit_code, child = run_processes(jobs, timeout=240)
    assert exit_code == 17  # died where it was meant to
    assert parent["1"] == 1 and parent["4"] == 4 and child == {"version": 4, "mismatches": []}
    assert parent["2"]["version"] == 2 and list(parent["2"]["failed"]) == [1], parent["2"]
    assert parent["3"]["version"] == 3 and "broke off in the middle of a version" in parent["3"]["failed"][1]
    assert parent["3"]["seconds"] < 5, parent["3"]  # not a wait on the dead child
    assert parent["mismatches2"] == parent["mismatches3"] == parent["mismatches4"] == []


def test_replica_arguments_are_checked_before_registering(store):
    config = small_config("mistral")
    plain = vllm_llama_tp(config, 1, torch.bfloat16)
    with pytest.raises(ValueError, match=r"replica must be in \[0, 2\), got 2"):
        WeightReceiver(store, plain, 0, poisoned_destination(plain, 0), name="rep-bad", replica=2, num_replicas=2)
    with pytest.raises(ValueError, match=r"num_replicas must be an int >= 1, got 0"):
        WeightReceiver(store, plain, 0, poisoned_destination(plain, 0), name="rep-bad", num_replicas=0)
    with pytest.raises(ValueError, match=r"name must be a non-empty str, got None"):
        WeightReceiver(store, plain, 0, poisoned_destination(plain, 0), name="rep-bad", num_replicas=2,
                       relay_names={1: None})
    assert not dist.PrefixStore("llamarl/sync/rep-bad/", store).check(["dst/0/info"])  # nothing was published


def test_sender_rechecks_tensors_whose_storage_moved(store):
    sender, receiver, _, _ = _threaded_pair(store, "sender-moved", "shm")
    name = "model.layers.0.mlp.up_proj.weight"
    sender.tensors[name].data = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=rf"sender rank 0: '{re.escape(name)}' has shape \(3, 3\)"):
        sender.send(1, timeout=1)
    sender.close()
    receiver.close()


def test_fp8_sync_refuses_nonfinite_weights_before_writing(store):
    """Threads in one process (the shared-memory transport works within a process
    too): a NaN in the sender's rows fails its send naming the tensor before any
    byte moves; both receivers fail naming the sender, and their FP8 weights and
    scales are the ones they had."""
    config = small_config("llama_gqa_bias")
    state = hf_state_dict(config, 21)
    state["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")
    src_layout = hf_llama_fsdp(config, 1, torch.float32)
    dst_layout = vllm_llama_tp(config, 2, torch.bfloat16, fp8="tensor")
    outcome, before, after = {}, {}, {}

    def receiver(rank):
        params = poisoned_destination(dst_layout, rank)
        before[rank] = {n: t.clone() for n, t in params.items()}
        with WeightReceiver(store_client(store), dst_layout, rank, params, name="nan", timeout=30) as r:
            try:
                r.receive()
                outcome[rank] = "received"
            except SyncError as exc:
                outcome[rank] = (str(exc), r.version)
        after[rank] = params

    threads = [threading.Thread(target=receiver, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    shards = reference_fsdp_shards(state, 1, torch.float32)[0]
    with WeightSender(store_client(store), src_layout, 0, shards, name="nan", timeout=30) as sender:
        with pytest.raises(SyncError, match=r"sender rank 0, version 1: source 'model\.layers\.0\.self_attn\.q_proj"
                                            r"\.weight' .*contains NaN or inf.*; nothing was written"):
            sender.send(1)
    for t in threads:
        t.join(timeout=60)
    for rank in range(2):
        assert outcome[rank][0].startswith(f"receiver rank {rank}: sender rank 0 failed: SyncError: sender rank 0, "
                                           "version 1: source"), outcome[rank]
        assert outcome[rank][1] is None
        assert all(torch.equal(t.reshape(-1).view(torch.uint8), after[rank][n].reshape(-1).view(torch.uint8))
                   for n, t in before[rank].items())


_RECEIVER_ON_SMALL_DEV_SHM = """
import datetime, json, os, threading
import torch, torch.distributed as dist
from helpers import hf_state_dict, small_config
from sync_checks import poisoned_destination
from llamarl_core.sync import SyncError, WeightReceiver, WeightSender
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp
from llamarl_core.sync.reference import reference_fsdp_shards

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


def test_point_to_point_receiver_offered_a_send_that_stops_hears_so_and_stays_in_step(store):
    """FSDP 1 -> TP 2 point to point: both receivers are offered version 2 at once
    (pending() sees it before any header moves). Receiver 1 waits in receive()
    while the sender's round-0 stream to receiver 0 is held up and the sender is
    aborted: receiver 0 gets version 2 whole, receiver 1 a header saying nothing
    follows, at once, not at its timeout. Version 3 then lands on both, and
    pending() offers nothing more: each receiver counts what it took from the
    headers."""
    config = small_config("llama_gqa_bias")
    src_layout, dst_layout = hf_llama_fsdp(config, 1, torch.float32), vllm_llama_tp(config, 2, torch.bfloat16)
    shards = reference_fsdp_shards(hf_state_dict(config, 51), 1, torch.float32)[0]
    params = {r: poisoned_destination(dst_layout, r) for r in range(2)}
    made = {}

    def register(rank):
        made[rank] = WeightReceiver(store_client(store), dst_layout, rank, params[rank], name="p2p-stop",
                                    transport="p2p", timeout=30)

    threads = [threading.Thread(target=register, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    sender = WeightSender(store_client(store), src_layout, 0, shards, name="p2p-stop", transport="p2p", timeout=30)
    for t in threads:
        t.join(timeout=60)
    receivers = [made[0], made[1]]
    first = sender.send(1, wait=False)
    assert in_threads(lambda: receivers[0].receive(), lambda: receivers[1].receive()) == [1, 1]
    first.wait()
    assert sender._p2p_peers == [0, 1]  # round 0: receiver 0

    handle = sender.send(2, wait=False)
    deadline = time.monotonic() + 10
    while [r.pending() for r in receivers] != [2, 2]:
        assert time.monotonic() < deadline, "both receivers must see version 2 offered before any header"
        time.sleep(0.01)
    outcome = {}

    def receive_1():
        start = time.monotonic()
        try:
            receivers[1].receive()
            outcome["1"] = "received"
        except SyncError as exc:
            outcome["1"] = (str(exc), receivers[1].torn, time.monotonic() - start)

    waiting = threading.Thread(target=receive_1)
    waiting.start()
    time.sleep(0.5)  # receiver 1 waits for its header; the sender waits for receiver 0
    sender.abort("the trainer stopped")
    assert receivers[0].receive() == 2
    waiting.join(timeout=30)
    with pytest.raises(SyncError, match="aborted: the trainer stopped"):
        handle.wait(timeout=30)
    message, torn, seconds = outcome["1"]
    assert message.startswith("receiver rank 1: sender ranks [0] failed before writing version 2 (sender rank 0 "
                              "failed: aborted: the trainer stopped)") and message.endswith("; nothing was written")
    assert torn is False and seconds < 10, outcome
    third = sender.send(3, wait=False)
    assert in_threads(lambda: receivers[0].receive(), lambda: receivers[1].receive()) == [3, 3]
    third.wait()
    assert [r.pending() for r in receivers] == [None, None]
    expected = reference_vllm_tp_shards(hf_state_dict(config, 51), config, 2, torch.bfloat16)
    for r in range(2):
        assert mismatches(expected[r], params[r]) == []
    sender.close()
    for r in receivers:
        r.close()
