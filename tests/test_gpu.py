"""The CUDA paths: copy engine, IPC handles and a sync between processes on a GPU.
Skipped without a CUDA device (see conftest.py)."""

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist

import sync_workers as workers
from helpers import hf_state_dict, mismatches, poisoned_destination, run_processes, small_config
from llamarl_core._native import native_cuda
from llamarl_core.sync import hf_llama_fsdp, plan_transfer, reference_fsdp_shards, reference_vllm_tp_shards, vllm_llama_tp
from llamarl_core.sync.engine import KIND_F32_TO_BF16, run_segment_table

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_execute_local_on_gpu_equals_reference(src_dtype):
    config = small_config("llama_gqa_bias")
    state = hf_state_dict(config, 11)
    dst_layout = vllm_llama_tp(config, 4, torch.bfloat16)
    plan = plan_transfer(hf_llama_fsdp(config, 3, src_dtype), dst_layout)
    src = {r: {n: t.cuda() for n, t in d.items()} for r, d in reference_fsdp_shards(state, 3, src_dtype).items()}
    dst = {r: {n: t.cuda() for n, t in poisoned_destination(dst_layout, r).items()} for r in range(4)}
    plan.execute_local(src, dst)
    ref = reference_vllm_tp_shards(state, config, 4, torch.bfloat16)
    for r in range(4):
        assert mismatches(ref[r], {n: t.cpu() for n, t in dst[r].items()}) == []


def test_cast_kernel_matches_torch_bitwise_on_strided_rows():
    src = torch.randn(300, 257, device="cuda") * 1e3
    dst = torch.full((300, 300), float("nan"), dtype=torch.bfloat16, device="cuda")
    table = np.array([[src.data_ptr(), src.stride(0) * 4, dst[:, 10:].data_ptr(), dst.stride(0) * 2, 257, 300,
                       KIND_F32_TO_BF16]], dtype=np.int64)
    run_segment_table(table, src.device)
    assert torch.equal(dst[:, 10:267].view(torch.int16), src.to(torch.bfloat16).view(torch.int16))
    assert torch.isnan(dst[:, :10].float()).all() and torch.isnan(dst[:, 267:].float()).all()


def test_ipc_export_reports_the_offset_inside_the_allocation():
    mod = native_cuda()
    base = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    view = base[4096:]
    _, offset, alloc_bytes = mod.cuda_ipc_export(base.device.index or 0, view.data_ptr())
    _, base_offset, _ = mod.cuda_ipc_export(base.device.index or 0, base.data_ptr())
    assert offset - base_offset == 4096 and alloc_bytes >= 1 << 20
    assert mod.cuda_device_by_uuid(mod.cuda_device_uuid(0)) == 0
    assert mod.cuda_device_by_uuid("0" * 32) == -1


def test_sync_between_processes_over_cuda_ipc():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    scenarios = [dict(config="qwen2", fsdp=2, tp=2, src_dtype=d, transport="auto", seed=5, device="cuda")
                 for d in ("fp32", "bf16")]
    jobs = [(workers.sender_body, dict(port=store.port, rank=r, scenarios=scenarios)) for r in range(2)]
    jobs += [(workers.receiver_body, dict(port=store.port, rank=r, scenarios=scenarios)) for r in range(2)]
    results = run_processes(jobs, timeout=300)
    for s in scenarios:
        name = workers.scenario_name(s)
        assert [results[r][name] for r in range(2)] == ["cuda_ipc"] * 2
        assert results[2][name] == [] and results[3][name] == []


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("shape", [(1, 1), (127, 129), (300, 200), (4096, 1), (1024, 4096)])
def test_fp8_triton_kernel_on_gpu_matches_reference(granularity, shape):
    from llamarl_core.ops.fp8 import quantize_fp8, quantize_fp8_ref

    w = (torch.randn(shape) * 3).to(torch.bfloat16)
    w.view(-1)[:: 97] *= 1e3
    q, scale = quantize_fp8(w.cuda(), granularity)
    q_ref, scale_ref = quantize_fp8_ref(w, granularity)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale.cpu(), scale_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, v", [(97, 1001), (300, 128256)])
def test_aipo_triton_kernels_on_gpu_match_reference(dtype, n, v):
    from llamarl_core.ops.aipo import aipo_loss, aipo_loss_ref, linear_aipo_loss

    gen = torch.Generator().manual_seed(n)
    logits = (torch.randn(n, v, generator=gen) * 2).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    behavior, advantages = -torch.rand(n, generator=gen) * 9, torch.randn(n, generator=gen)
    x = logits.cuda().requires_grad_()
    loss, stats = aipo_loss(x, targets.cuda(), behavior.cuda(), advantages.cuda(), temperature=0.7)
    loss.backward()
    xr = logits.double().requires_grad_()
    ref = aipo_loss_ref(xr, targets, behavior, advantages, temperature=0.7)
    ref.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert abs(loss.item() - ref.item()) <= tol * abs(ref.item())
    assert ((x.grad.cpu().double() - xr.grad).abs().max() / xr.grad.abs().max()).item() <= tol
    assert (stats.logprobs <= 0).all()
    h = torch.randn(n, 64, generator=gen).to(dtype).cuda().requires_grad_()
    w = (torch.randn(v, 64, generator=gen) / 8).to(dtype).cuda().requires_grad_()
    linear_loss, _ = linear_aipo_loss(h, w, targets.cuda(), behavior.cuda(), advantages.cuda(), chunk_size=64)
    linear_loss.backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
