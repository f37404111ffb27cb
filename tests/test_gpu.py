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


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|, in float64 on the CPU."""
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    return ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def _tolerance(dtype, naive_error: float) -> float:
    """float32: the CPU tests' 1e-5. bf16: twice the error of plain torch in bf16 on
    the same GPU against the same float64 reference, plus a floor for tiny errors."""
    return 1e-5 if dtype == torch.float32 else 2 * naive_error + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, v", [(97, 1001), (300, 128256)])
def test_aipo_triton_kernels_on_gpu_match_reference(dtype, n, v):
    from llamarl_core.ops.aipo import aipo_loss, aipo_loss_ref, linear_aipo_loss

    gen = torch.Generator().manual_seed(n)
    logits = (torch.randn(n, v, generator=gen) * 2).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    behavior, advantages = -torch.rand(n, generator=gen) * 9, torch.randn(n, generator=gen)
    cuda = [t.cuda() for t in (targets, behavior, advantages)]

    def run(fn, x, *, compute_dtype="default"):
        x = x.clone().requires_grad_()
        kw = {} if compute_dtype == "default" else {"compute_dtype": compute_dtype}
        inputs = cuda if x.is_cuda else (targets, behavior, advantages)
        out = fn(x, *inputs, temperature=0.7, **kw)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        return loss, x.grad

    loss, grad = run(aipo_loss, logits.cuda())
    ref, ref_grad = run(aipo_loss_ref, logits.double())
    naive, naive_grad = run(aipo_loss_ref, logits.cuda(), compute_dtype=None)  # plain torch in `dtype`
    assert _relative_error(loss, ref) <= _tolerance(dtype, _relative_error(naive, ref))
    assert _relative_error(grad, ref_grad) <= _tolerance(dtype, _relative_error(naive_grad, ref_grad))

    h = torch.randn(n, 64, generator=gen).to(dtype)
    w = (torch.randn(v, 64, generator=gen) / 8).to(dtype)

    def run_linear(fn, hidden, weight, **kw):
        hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        inputs = cuda if hx.is_cuda else (targets, behavior, advantages)
        if fn is linear_aipo_loss:
            out, _ = fn(hx, wx, *inputs, temperature=0.7, chunk_size=64)
        else:
            out = fn(hx @ wx.t(), *inputs, temperature=0.7, **kw)
        out.backward()
        return out, hx.grad, wx.grad

    ours = run_linear(linear_aipo_loss, h.cuda(), w.cuda())
    ref64 = run_linear(aipo_loss_ref, h.double(), w.double())
    naive = run_linear(aipo_loss_ref, h.cuda(), w.cuda(), compute_dtype=None)
    for got, expected, plain in zip(ours, ref64, naive):
        assert _relative_error(got, expected) <= _tolerance(dtype, _relative_error(plain, expected))


def test_linear_aipo_weight_gradient_gemm_runs_in_bf16():
    """With bf16 inputs on a GPU every GEMM of linear_aipo_loss takes bf16 operands
    (tensor cores), the weight gradient accumulating in float32: no GEMM on
    float32 upcasts of the hidden states or dlogits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from llamarl_core.ops.aipo import linear_aipo_loss

    class GemmOperands(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            if name in ("aten::mm", "aten::addmm"):
                operands = args[:2] if name == "aten::mm" else args[1:3]
                self.seen.append((str(func), tuple(t.dtype for t in operands)))
            return func(*args, **(kwargs or {}))

    n, hidden, vocab = 300, 256, 4096
    h = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (n,), device="cuda")
    mode = GemmOperands()
    with mode:
        loss, _ = linear_aipo_loss(h, w, targets, torch.full((n,), -8.0, device="cuda"), torch.randn(n, device="cuda"),
                                   chunk_size=64)
    loss.backward()
    assert mode.seen, "no GEMM was recorded"
    assert all(dtypes == (torch.bfloat16, torch.bfloat16) for _, dtypes in mode.seen), mode.seen
    assert w.grad.dtype == torch.bfloat16 and torch.isfinite(w.grad.float()).all()


@pytest.mark.parametrize("linear", [False, True])
def test_aipo_loss_waits_only_for_its_target_check(linear):
    """Forward + backward of aipo_loss / linear_aipo_loss (token_mean, entropy)
    make no synchronizing call torch's sync debug mode sees: under "error" mode
    any would raise. The one host sync left, the wait for the target check's
    event, is invisible to that mode; with a bad target it raises the check's
    ValueError, naming the first bad index."""
    from llamarl_core.ops.aipo import aipo_loss, linear_aipo_loss

    n, hidden, vocab = 300, 64, 4096
    gen = torch.Generator(device="cuda").manual_seed(3)
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    targets[::7] = -100
    per_token = [torch.randn(n, device="cuda", generator=gen) for _ in range(2)]
    mask = (torch.rand(n, device="cuda", generator=gen) > 0.2).float()
    h = torch.randn(n, hidden, device="cuda", generator=gen, requires_grad=True)
    w = torch.randn(vocab, hidden, device="cuda", generator=gen, requires_grad=True)
    logits = (h @ w.t()).detach().requires_grad_()

    def step(t):
        if linear:
            return linear_aipo_loss(h, w, t, *per_token, mask, entropy=True, chunk_size=128)
        return aipo_loss(logits, t, *per_token, mask, entropy=True)

    step(targets)[0].backward()  # compiles the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, stats = step(targets)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss) and torch.isfinite(stats.entropy)
    bad = targets.clone()
    bad[[5, 200]] = torch.tensor([vocab, -3], device="cuda")
    with pytest.raises(ValueError, match=rf"targets\[5\] = {vocab} is outside \[0, {vocab}\)"):
        step(bad)
