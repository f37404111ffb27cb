"""The CUDA copy engine as a GPU runs it: ordering against the generator's queued
kernels, error paths that leave no copy running, the calling thread's CUDA
context, same-process senders, memory CUDA IPC cannot export, storage that moved.
Skipped without a CUDA device (see conftest.py). Each test fails on the engine as
it was before these guarantees."""

import ctypes
import datetime
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import sync_workers as workers
from helpers import hf_state_dict, run_processes, small_config
from sync_checks import mismatches, poisoned_destination
from llamarl_core._native import native_cuda
from llamarl_core.sync import SyncError, SyncTimeoutError, WeightReceiver, WeightSender
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp
from llamarl_core.sync.reference import reference_fsdp_shards, reference_vllm_tp_shards
from llamarl_core.sync.engine import KIND_COPY, run_segment_table

pytestmark = pytest.mark.gpu

# torch.cuda._sleep spins this many GPU cycles: about 1 s at the H100's 1.98 GHz
# boost clock, over 0.5 s at any clock a data-center GPU runs at.
SLEEP_CYCLES = 2_000_000_000


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))


def _client(store) -> dist.TCPStore:
    """One Store client per thread: a client blocks while it waits."""
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=60))


def _start(calls: dict):
    """Run each zero-argument call in a thread of its own; returns join(), which
    waits for them and returns key -> result, raising the first error."""
    results, errors = {}, []

    def run(key, call):
        try:
            results[key] = call()
        except Exception as exc:  # re-raised by join()
            errors.append(exc)

    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for t in threads:
        t.start()

    def join() -> dict:
        for t in threads:
            t.join(timeout=120)
        if errors:
            raise errors[0]
        return results

    return join


def _in_threads(store, name: str, fsdp: int, tp: int, seed: int):
    """Every sender and receiver of one sync registered in this process (one thread
    each: registration waits for the other side), on GPU 0, transport 'auto'.
    Returns (senders, receivers, receiver params, reference of `seed`)."""
    config = small_config("llama_gqa_bias")
    src_layout, dst_layout = hf_llama_fsdp(config, fsdp, torch.float32), vllm_llama_tp(config, tp, torch.bfloat16)
    shards = {r: {n: t.cuda() for n, t in d.items()}
              for r, d in reference_fsdp_shards(hf_state_dict(config, seed), fsdp, torch.float32).items()}
    params = {r: {n: t.cuda() for n, t in poisoned_destination(dst_layout, r).items()} for r in range(tp)}
    calls = {("src", r): (lambda r=r: WeightSender(_client(store), src_layout, r, shards[r], name=name, timeout=60))
             for r in range(fsdp)}
    calls.update({("dst", r): (lambda r=r: WeightReceiver(_client(store), dst_layout, r, params[r], name=name,
                                                          timeout=60))
                  for r in range(tp)})
    made = _start(calls)()
    senders = {r: made[("src", r)] for r in range(fsdp)}
    receivers = {r: made[("dst", r)] for r in range(tp)}
    expected = reference_vllm_tp_shards(hf_state_dict(config, seed), config, tp, torch.bfloat16)
    return senders, receivers, params, expected


def _send(senders, version: int):
    """Every sender's send(version), each in its own thread (a sender waits for its
    receivers' tickets); returns join()."""
    return _start({r: (lambda s=s: s.send(version)) for r, s in senders.items()})


# ----------------------------------------------------------------------------- e: same process


@pytest.mark.parametrize("fsdp, tp", [(1, 1), (2, 2)])
def test_same_process_sync_on_gpu_auto_equals_reference(store, fsdp, tp):
    """The exporting process cannot open its own IPC handle: senders in the
    receiver's process copy to its addresses directly, on 'auto'."""
    senders, receivers, params, expected = _in_threads(store, f"same-{fsdp}-{tp}", fsdp, tp, seed=41)
    assert {s.transport for s in senders.values()} == {"cuda_ipc"}
    sent = _send(senders, 1)
    # Receivers in threads too: a sender may serve receiver 1 before receiver 0.
    versions = _start({r: (lambda rc=rc: rc.receive(timeout=60)) for r, rc in receivers.items()})()
    sent()
    assert versions == {r: 1 for r in range(tp)}
    for r in range(tp):
        assert mismatches(expected[r], {n: t.cpu() for n, t in params[r].items()}) == []


# ----------------------------------------------------------------------------- a: queued kernels


def test_receive_waits_for_kernels_queued_on_the_generator_stream(store):
    """A decode step queued before receive() still reads the old weights: senders
    must not write until it has run. The generator's stream is not the senders'
    (pool streams do not wait for each other), so only receive() orders them."""
    senders, receivers, params, expected = _in_threads(store, "queued", 1, 1, seed=43)
    before = {n: t.cpu() for n, t in params[0].items()}
    generator = torch.cuda.Stream()
    with torch.cuda.stream(generator):
        torch.cuda._sleep(SLEEP_CYCLES)  # the tail of a long decode step
        read_by_step = {n: t.clone() for n, t in params[0].items()}  # what the step reads, after the sleep
        sent = _send(senders, 1)
        assert receivers[0].receive(timeout=60) == 1
    sent()
    assert generator.query()  # receive() returned only after the step's kernels
    generator.synchronize()
    assert mismatches(before, {n: t.cpu() for n, t in read_by_step.items()}) == []
    assert mismatches(expected[0], {n: t.cpu() for n, t in params[0].items()}) == []


def test_non_blocking_send_waits_for_the_step_before_it_not_the_forward_after(store):
    """send(wait=False) copies what the caller's stream had queued at the call (an
    optimizer step still writing the shards behind a long kernel: copies that did not
    wait would read zeros), and not what it queued after (a forward pass, here a 2 s
    kernel): the version lands whole while that kernel still runs."""
    senders, receivers, params, expected = _in_threads(store, "nonblocking", 1, 1, seed=47)
    shards = senders[0].tensors
    saved = {n: t.clone() for n, t in shards.items()}
    trainer = torch.cuda.Stream()  # not the default stream, which the receiver's thread shares
    received = _start({0: lambda: receivers[0].receive(timeout=60)})
    with torch.cuda.stream(trainer):
        for t in shards.values():
            t.zero_()
        torch.cuda._sleep(SLEEP_CYCLES // 2)  # the optimizer step, still running at send()
        for n, t in shards.items():
            t.copy_(saved[n])
        handle = senders[0].send(1, wait=False)
        torch.cuda._sleep(2 * SLEEP_CYCLES)  # the next forward pass, queued after send()
        assert received() == {0: 1}
        assert not trainer.query()  # landed while the forward still ran
        assert handle.wait(timeout=60) > 0
    trainer.synchronize()
    assert mismatches(expected[0], {n: t.cpu() for n, t in params[0].items()}) == []


def test_receive_times_out_on_kernels_that_do_not_finish_before_opening_a_ticket(store):
    senders, receivers, params, _ = _in_threads(store, "queued-late", 1, 1, seed=44)
    before = {n: t.cpu() for n, t in params[0].items()}
    generator = torch.cuda.Stream()
    with torch.cuda.stream(generator):
        torch.cuda._sleep(SLEEP_CYCLES)
        with pytest.raises(SyncTimeoutError, match="the kernels queued on cuda"):
            receivers[0].receive(timeout=0.05)
    assert receivers[0].torn is False  # no ticket was opened: nothing may have been written
    with pytest.raises(SyncTimeoutError, match="receiver 0 to ask for a version"):
        senders[0].send(1, timeout=0.2)
    generator.synchronize()
    assert mismatches(before, {n: t.cpu() for n, t in params[0].items()}) == []


# ----------------------------------------------------------------------------- b: error paths


def test_copy_timeout_raises_only_once_the_copies_completed():
    src = torch.randn(1 << 20, device="cuda")
    dst = torch.full_like(src, float("nan"))
    table = np.array([[src.data_ptr(), 0, dst.data_ptr(), 0, src.numel() * 4, 1, KIND_COPY]], dtype=np.int64)
    # The process's first engine call initialises its CUDA runtime, which waited for the
    # device's queued work on an H100 (the call returned after the sleep, untimed out).
    run_segment_table(table, src.device)
    torch.cuda._sleep(SLEEP_CYCLES)  # the copy stream waits for the current stream: the copy starts late
    start = time.monotonic()
    with pytest.raises(SyncTimeoutError, match="did not complete within 0.05 s .*nothing is left running"):
        run_segment_table(table, src.device, timeout_s=0.05)
    assert time.monotonic() - start > 0.25  # it waited for the sleep, and the copy behind it
    assert torch.cuda.current_stream().query()
    # Read on a stream that waits for nothing: the bytes have landed already.
    reader = torch.cuda.Stream()
    with torch.cuda.stream(reader):
        landed = dst.clone()
    reader.synchronize()
    assert torch.equal(landed, src)


def test_engine_errors_are_sync_errors_on_gpu():
    dst = torch.zeros(16, dtype=torch.uint8, device="cuda")
    table = np.array([[0, 0, dst.data_ptr(), 0, 16, 1, KIND_COPY]], dtype=np.int64)
    with pytest.raises(SyncError, match="segment 0: null address"):
        run_segment_table(table, dst.device)


# ----------------------------------------------------------------------------- c: thread context


def _driver() -> ctypes.CDLL:
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0
    return cuda


def _current_context(cuda: ctypes.CDLL) -> int | None:
    ctx = ctypes.c_void_p()
    assert cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return ctx.value


def test_engine_calls_leave_a_thread_without_a_context_without_one():
    """The old guard restored device 0 on exit, creating (and binding) GPU 0's
    primary context in a thread that never used CUDA."""
    cuda = _driver()
    src = torch.randn(4096, device="cuda")
    dst = torch.empty_like(src)
    torch.cuda.synchronize()
    index, mod = src.device.index or 0, native_cuda()
    table = np.array([[src.data_ptr(), 0, dst.data_ptr(), 0, src.numel() * 4, 1, KIND_COPY]], dtype=np.int64)
    seen = {}

    def fresh_thread():
        seen["before"] = _current_context(cuda)
        mod.cuda_ipc_capable(index, src.data_ptr())
        mod.cuda_ipc_export(index, src.data_ptr())
        mod.execute_segments_cuda(table, index, 0, 30.0)  # the legacy default stream
        seen["after"] = _current_context(cuda)

    thread = threading.Thread(target=fresh_thread)
    thread.start()
    thread.join(timeout=60)
    assert seen["before"] is None, "precondition: a new thread starts with no CUDA context"
    assert seen["after"] is None
    assert torch.equal(dst, src)
    # A thread that has a context keeps it.
    torch.cuda.set_device(index)
    own = _current_context(cuda)
    mod.cuda_ipc_capable(index, src.data_ptr())
    assert own is not None and _current_context(cuda) == own


_OTHER_GPU_PROBE = """
import ctypes, json, threading, torch
from llamarl_core._native import native_cuda
cuda = ctypes.CDLL("libcuda.so.1"); cuda.cuInit(0)
def active(ordinal):
    dev, flags, on = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    cuda.cuDeviceGet(ctypes.byref(dev), ordinal)
    cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(on))
    return bool(on.value)
x = torch.empty(1 << 20, device="cuda:1")
torch.cuda.synchronize(1)
out = {"gpu0_before": active(0)}
def work():
    mod = native_cuda()
    mod.cuda_ipc_capable(1, x.data_ptr())
    mod.cuda_ipc_export(1, x.data_ptr())
t = threading.Thread(target=work); t.start(); t.join()
out["gpu0_after"] = active(0)
print(json.dumps(out))
"""


def test_engine_calls_for_gpu_1_create_no_context_on_gpu_0():
    """About 500 MiB of GPU 0 per process on an 8-GPU node, before."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    result = subprocess.run([sys.executable, "-c", _OTHER_GPU_PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    if out["gpu0_before"]:
        pytest.skip("this torch created GPU 0's context while allocating on GPU 1")
    assert out["gpu0_after"] is False


# ----------------------------------------------------------------------------- e: memory IPC cannot export


_EXPANDABLE_PROBE = """
import json, torch
from llamarl_core._native import native
from llamarl_core.sync.transports import choose_transports, device_info
w = torch.empty(1 << 20, device="cuda")
receiver = device_info(w.device, {"w": w})
sender = {**device_info(w.device), "process": "another"}
out = {"ipc_error": receiver["ipc_error"], "same_process": choose_transports("cuda_ipc", [device_info(w.device)], [receiver])[(0, 0)]}
try:
    choose_transports("cuda_ipc", [sender], [receiver])
    out["explicit"] = "accepted"
except ValueError as exc:
    out["explicit"] = str(exc)
try:
    out["auto"] = choose_transports("auto", [sender], [receiver])[(0, 0)]
except ValueError as exc:
    out["auto"] = str(exc)
try:
    native().cuda_ipc_export(w.device.index or 0, w.data_ptr())
    out["export"] = "exported"
except RuntimeError as exc:
    out["export"] = str(exc)
print(json.dumps(out))
"""


@pytest.mark.gpu(seconds=6)
def test_expandable_segments_are_refused_by_name_for_cuda_ipc():
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    result = subprocess.run([sys.executable, "-c", _EXPANDABLE_PROBE], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert "'w' is not in memory from cudaMalloc" in out["ipc_error"]
    assert "expandable_segments:True" in out["ipc_error"]
    assert out["same_process"] == "cuda_ipc"  # copied directly: no IPC needed
    assert out["explicit"].startswith("transport 'cuda_ipc' cannot work here: receiver 0: 'w'")
    assert "expandable_segments" in out["explicit"] and "p2p" not in out["explicit"]
    # Never NCCL for two ranks on one GPU (it refuses them): refused, naming the pair and the reason.
    assert out["auto"].startswith("weight sync: sender 0 and receiver 0 share GPU"), out["auto"]
    assert "expandable_segments" in out["auto"]
    assert "is not from cudaMalloc" in out["export"] and "expandable_segments" in out["export"]


def test_cudamalloc_memory_is_ipc_capable():
    w = torch.empty(1 << 20, device="cuda")
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        pytest.skip("this process allocates with expandable segments")
    assert native_cuda().cuda_ipc_capable(w.device.index or 0, w.data_ptr())


# ----------------------------------------------------------------------------- f: moved storage


@pytest.mark.gpu(seconds=6)
def test_fp8_destination_on_gpu_holds_its_fp8_weights_and_scales_only(store):
    """A generator process on the GPU receiving 64 MiB of FP8 weights (per channel
    and per block) over CUDA IPC from a float32 trainer process: its allocator's
    peak past its own FP8 weights and scales grows by under 1 MiB (bf16 landing
    rows would add 128 MiB); the weights equal ops.fp8's reference bit for bit;
    the sender keeps one FP8 byte per element it sends."""
    kwargs = dict(port=store.port, device="cuda", transport="auto")
    sender, receiver = run_processes([(workers.fp8_memory_sender_body, kwargs),
                                      (workers.fp8_memory_receiver_body, kwargs)], timeout=300)
    assert receiver["transport"] == "cuda_ipc" and receiver["staging"] == 0
    assert receiver["mismatches"] == []
    assert receiver["growth"] < 1 << 20, receiver
    assert sender["packed_bytes"] == sum(rows * cols for rows, cols in workers.FP8_MEMORY["shapes"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL connects one rank a GPU)")
def test_nccl_peer_that_dies_is_a_sync_error_and_the_receiver_lives_on(store):
    """Point to point over NCCL, GPU 0 to GPU 1: the sender dies after version 1; the receive of
    version 2 raises SyncTimeoutError after its 3 s, and the receiver process is
    still alive 15 s later, past the group's 10 s timeout (NCCL's watchdog would
    tear it down under TORCH_NCCL_ASYNC_ERROR_HANDLING=3, the default)."""
    sender = mp.get_context("spawn").Process(target=workers.nccl_dying_sender_body, kwargs=dict(port=store.port))
    sender.start()
    (receiver,) = run_processes([(workers.nccl_surviving_receiver_body, dict(port=store.port))], timeout=180)
    sender.join(timeout=60)
    assert sender.exitcode == 3
    assert receiver["v1"] == 1 and receiver["v1_mismatches"] == []
    assert receiver["v2"].startswith("SyncTimeoutError:"), receiver
    assert receiver["alive"] is True


def test_receiver_on_gpu_refuses_storage_moved_since_registration(store):
    senders, receivers, params, _ = _in_threads(store, "moved", 1, 1, seed=45)
    name = "model.layers.0.mlp.gate_up_proj.weight"
    registered = params[0][name].data
    before = registered.cpu()
    params[0][name].data = torch.zeros_like(registered)  # as vLLM's post-processing does
    with pytest.raises(SyncError, match=rf"parameter '{re.escape(name)}' moved since registration"):
        receivers[0].receive(timeout=5)
    with pytest.raises(SyncTimeoutError, match="receiver 0 to ask for a version"):
        senders[0].send(1, timeout=0.5)
    assert mismatches({name: before}, {name: registered.cpu()}) == []
    assert not params[0][name].any()
