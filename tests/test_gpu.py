"""The CUDA paths: copy engine, IPC handles and a sync between processes on a GPU.
Skipped without a CUDA device (see conftest.py)."""

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist

import sync_workers as workers
from helpers import hf_state_dict, run_processes, small_config
from sync_checks import mismatches, poisoned_destination
from llamarl_core._native import native_cuda
from llamarl_core.sync import plan_transfer
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp
from llamarl_core.sync.reference import reference_fsdp_shards, reference_vllm_tp_shards
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


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_generator_synced_on_gpu_equals_cpu_and_dequantizes_without_host_syncs(granularity):
    """LlamaGenerator(fp8=) on the GPU, filled by a sync planned and run there (the
    grouped FP8 Triton kernels): its FP8 weights and scales equal, bit for bit,
    those the CPU's torch path gives; its logits (float32) the CPU generator's
    within 1e-4 of their largest (float32 GEMMs summing in another order; TF32 would
    be some 10x further); and dequantizing a layer never waits for the host (per-part
    scales included)."""
    from llamarl_core.models.llama_generator import Fp8Linear, LlamaGenerator

    config = small_config("llama_gqa_bias")
    state = reference_fsdp_shards(hf_state_dict(config, 13), 1, torch.float32)[0]
    source = hf_llama_fsdp(config, 1, torch.float32)
    models = {}
    for device in ("cpu", "cuda"):
        generator = LlamaGenerator(config, fp8=granularity, device=device)
        plan_transfer(source, generator.layout).execute_local({0: {n: t.to(device) for n, t in state.items()}},
                                                              {0: dict(generator.named_parameters())})
        models[device] = generator
    on_gpu = dict(models["cuda"].named_parameters())
    for name, t in models["cpu"].named_parameters():
        got = on_gpu[name].cpu()
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t), name
    ids = torch.randint(0, config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        on_cpu = models["cpu"](ids)
        gap = (models["cuda"](ids.cuda()).cpu() - on_cpu).abs().max().item() / on_cpu.abs().max().item()
        layers = [m for m in models["cuda"].modules() if isinstance(m, Fp8Linear)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for layer in layers:
                layer.dequantized(torch.bfloat16)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert gap <= 1e-4, gap


def test_cast_kernel_matches_torch_bitwise_on_strided_rows():
    src = torch.randn(300, 257, device="cuda") * 1e3
    dst = torch.full((300, 300), float("nan"), dtype=torch.bfloat16, device="cuda")
    table = np.array([[src.data_ptr(), src.stride(0) * 4, dst[:, 10:].data_ptr(), dst.stride(0) * 2, 257, 300,
                       KIND_F32_TO_BF16]], dtype=np.int64)
    run_segment_table(table, src.device)
    assert torch.equal(dst[:, 10:267].view(torch.int16), src.to(torch.bfloat16).view(torch.int16))
    assert torch.isnan(dst[:, :10].float()).all() and torch.isnan(dst[:, 267:].float()).all()


@pytest.mark.parametrize("seed", range(4))
def test_copy_kernel_writes_random_rectangles_exactly(seed):
    """Random rectangles at random offsets (every access width from 1 to 16 bytes,
    rows merged, rows cut into pieces) and fp32 -> bf16 casts: exactly torch's
    slices and casts, nothing else written; once as a one-off table and once
    uploaded (CudaSegments) and launched on a stream of the caller's, twice."""
    from llamarl_core.sync.engine import KIND_COPY, CudaSegments

    gen = torch.Generator().manual_seed(seed)
    kind = KIND_F32_TO_BF16 if seed % 2 else KIND_COPY
    dtype = torch.float32 if kind == KIND_F32_TO_BF16 else [torch.uint8, torch.bfloat16][seed // 2]
    out_dtype = torch.bfloat16 if kind == KIND_F32_TO_BF16 else dtype
    src = (torch.randn(600, 70000, generator=gen) * 100).to(dtype).cuda()
    rects, next_row = [(0, 0, 0, 0, 16, 70000)], 16  # whole rows: one row of 4.5 MB, cut into pieces
    for _ in range(60):
        h, w = (int(x) for x in torch.randint(1, 100, (2,), generator=gen))
        r0, c0 = int(torch.randint(0, 600 - h, (1,), generator=gen)), int(torch.randint(0, 70000 - w, (1,), generator=gen))
        rects.append((r0, c0, next_row, int(torch.randint(0, 70000 - w, (1,), generator=gen)), h, w))
        next_row += h
    expected = torch.full((next_row, 70000), 3, dtype=out_dtype, device="cuda")
    for r0, c0, R0, C0, h, w in rects:
        expected[R0:R0 + h, C0:C0 + w] = src[r0:r0 + h, c0:c0 + w].to(out_dtype)

    def table_into(dst):
        unit = src.element_size() if kind == KIND_COPY else 1
        return np.array([(src[r0, c0:].data_ptr(), src.stride(0) * src.element_size(), dst[R0, C0:].data_ptr(),
                          dst.stride(0) * dst.element_size(), w * unit, h, kind) for r0, c0, R0, C0, h, w in rects],
                        dtype=np.int64)

    once = torch.full_like(expected, 3)
    run_segment_table(table_into(once), once.device)
    assert torch.equal(once.view(torch.uint8), expected.view(torch.uint8))
    uploaded = torch.full_like(expected, 3)
    program = CudaSegments(table_into(uploaded), uploaded.device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    for _ in range(2):
        program.launch(stream)
    stream.synchronize()
    assert torch.equal(uploaded.view(torch.uint8), expected.view(torch.uint8))
    assert program.run() == sum(h * w for *_, h, w in rects) * expected.element_size()


def test_copy_kernel_launch_is_captured_in_a_cuda_graph():
    """The uploaded table's launch has no host sync and no allocation: a CUDA graph
    captures it, and each replay copies the source's current values."""
    from llamarl_core.sync.engine import KIND_COPY, CudaSegments

    src = torch.randn(4096, 1024, device="cuda")
    dst = torch.zeros(4096, 512, device="cuda")
    table = np.array([(src.data_ptr(), src.stride(0) * 4, dst.data_ptr(), dst.stride(0) * 4, 512 * 4, 4096,
                       KIND_COPY)], dtype=np.int64)
    program = CudaSegments(table, src.device)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        program.launch(stream)  # warm-up outside the capture
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            program.launch(torch.cuda.current_stream())
    for _ in range(2):
        src.normal_()
        dst.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dst, src[:, :512])


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


# (1024, 4096): 8 whole rows a program in one tile (per tensor: flat); (64, 14336): one
# row padded to 16384; (16, 32784): rows past the one-tile limit, walked twice;
# (256, 160): a ragged edge block held as one tile; the rest unaligned: walked.
FP8_GPU_SHAPES = [(1, 1), (127, 129), (300, 200), (4096, 1), (1024, 4096), (64, 14336), (16, 32784), (256, 160)]


def _fp8_weight(shape, dtype=torch.bfloat16, transposed=False):
    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    w = torch.randn(shape[::-1] if transposed else shape, generator=gen) * 3
    w.view(-1)[::97] *= 1e3
    return w.to(dtype).t() if transposed else w.to(dtype)


def _assert_fp8_matches_reference(w, granularity, **kw):
    from llamarl_core.ops.fp8 import fp8_amax, fp8_amax_ref, quantize_fp8, quantize_fp8_ref, quantize_fp8_with_scale

    q_ref, scale_ref = quantize_fp8_ref(w, granularity)
    for check in (True, False):
        q, scale = quantize_fp8(w.cuda(), granularity, check=check, **kw)
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)), (granularity, check)
        assert torch.equal(scale.cpu(), scale_ref), (granularity, check)
        amax = fp8_amax(w.cuda(), granularity, check=check)
        assert torch.equal(amax.cpu(), fp8_amax_ref(w, granularity).reshape(amax.shape))
        q = quantize_fp8_with_scale(w.cuda(), scale_ref.cuda(), granularity, check=check)
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)), (granularity, check, "scale given")


@pytest.mark.gpu(seconds=19)
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_triton_kernel_on_gpu_matches_reference(granularity):
    """bf16 at every tiling's shape; fp16, fp32 and transposed (strided) weights at
    one tile / flat and at an unaligned walk."""
    for shape in FP8_GPU_SHAPES:
        _assert_fp8_matches_reference(_fp8_weight(shape), granularity)
    for dtype in (torch.float16, torch.float32, torch.bfloat16):
        for transposed in (False, True):
            for shape in ((1024, 4096), (300, 200)):
                if dtype != torch.bfloat16 or transposed:
                    _assert_fp8_matches_reference(_fp8_weight(shape, dtype, transposed), granularity)


@pytest.mark.gpu(seconds=14)
def test_fp8_every_sweep_tiling_on_gpu_matches_reference():
    """Each candidate `llamarl bench fp8 --gpu-sweep` times gives the reference's bits."""
    from llamarl_core.ops.fp8 import quantize_fp8_ref
    from llamarl_core.ops.fp8_launch import SWEEP_TILINGS, launch_quantize_fp8

    for shape, dtype in (((1024, 4096), torch.bfloat16), ((64, 14336), torch.bfloat16), ((256, 4096), torch.float32)):
        w = _fp8_weight(shape, dtype)
        for granularity, tilings in SWEEP_TILINGS.items():
            q_ref, scale_ref = quantize_fp8_ref(w, granularity)
            for tiling in tilings:
                q, scale = launch_quantize_fp8(w.cuda(), granularity, tiling=tiling)
                assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)), tiling
                assert torch.equal(scale.cpu(), scale_ref), tiling


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_unchecked_nan_and_inf_give_inf_scales_on_gpu(granularity):
    from llamarl_core.ops.fp8 import fp8_amax, fp8_amax_ref, quantize_fp8

    for transposed, bad in ((False, float("nan")), (True, float("inf")), (False, float("-inf")), (True, float("nan"))):
        w = _fp8_weight((1024, 4096), transposed=transposed)
        w[700, 3000] = bad
        _q, scale = quantize_fp8(w.cuda(), granularity, check=False)
        amax = fp8_amax(w.cuda(), granularity, check=False).cpu()
        nonfinite = ~torch.isfinite(fp8_amax_ref(w, granularity).reshape(amax.shape))
        assert nonfinite.any() and torch.equal(~torch.isfinite(scale.cpu()), nonfinite)
        assert (scale.cpu()[nonfinite] == float("inf")).all() and (amax[nonfinite] == float("inf")).all()
        with pytest.raises(ValueError, match="layers.1.down: contains NaN or inf"):
            quantize_fp8(w.cuda(), granularity, name="layers.1.down")


def test_fp8_unchecked_calls_never_sync_with_the_host():
    """check=False: kernels only. torch's sync debug mode raises on any
    synchronizing CUDA call; the checked default makes exactly such a call."""
    from llamarl_core.ops.fp8 import fp8_amax, quantize_fp8, quantize_fp8_with_scale, scale_from_amax

    weights = [_fp8_weight((1024, 4096)), _fp8_weight((300, 200), transposed=True)]
    weights = [w.cuda() for w in weights]
    scales = {}
    for w in weights:  # warm-up: compiling and loading the kernels
        for granularity in ("tensor", "channel", "block"):
            scales[w.shape, granularity] = scale_from_amax(fp8_amax(w, granularity))
            quantize_fp8(w, granularity, check=False)
            quantize_fp8_with_scale(w, scales[w.shape, granularity], granularity, check=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for w in weights:
            for granularity in ("tensor", "channel", "block"):
                quantize_fp8(w, granularity, check=False)
                fp8_amax(w, granularity, check=False)
                quantize_fp8_with_scale(w, scales[w.shape, granularity], granularity, check=False)
        with pytest.raises(RuntimeError, match="synchroniz"):
            quantize_fp8(weights[0], "channel")
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|, in float64 on the CPU."""
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    return ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def _tolerance(dtype, naive_error: float) -> float:
    """float32: the CPU tests' 1e-5. bf16: twice the error of plain torch in bf16 on
    the same GPU against the same float64 reference, plus a floor for tiny errors."""
    return 1e-5 if dtype == torch.float32 else 2 * naive_error + 1e-6


@pytest.mark.gpu(seconds=7)
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


@pytest.mark.parametrize("form", ["logits", "linear", "sequences"])
def test_aipo_loss_waits_only_for_its_target_check(form):
    """Forward + backward of aipo_loss / linear_aipo_loss (token_mean, entropy;
    "sequences": gspo on flat tokens with sequence_ids, sequence_mean, grouped on
    the device) make no synchronizing call torch's sync debug mode sees: under
    "error" mode any would raise. The one host sync left, the wait for the target
    check's event, is invisible to that mode; with a bad target it raises the
    check's ValueError, naming the first bad index."""
    from llamarl_core.ops.aipo import aipo_loss, linear_aipo_loss

    n, hidden, vocab = 300, 64, 4096
    gen = torch.Generator(device="cuda").manual_seed(3)
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    targets[::7] = -100
    # behaviour log-probs (<= 0) and advantages
    per_token = [-torch.rand(n, device="cuda", generator=gen) * 5, torch.randn(n, device="cuda", generator=gen)]
    mask = (torch.rand(n, device="cuda", generator=gen) > 0.2).float()
    h = torch.randn(n, hidden, device="cuda", generator=gen, requires_grad=True)
    w = torch.randn(vocab, hidden, device="cuda", generator=gen, requires_grad=True)
    logits = (h @ w.t()).detach().requires_grad_()

    sequence_ids = torch.randint(-5, 40, (n,), device="cuda", generator=gen) * 1000  # 45 sequences, any ids

    def step(t):
        if form == "linear":
            return linear_aipo_loss(h, w, t, *per_token, mask, entropy=True, chunk_size=128)
        if form == "sequences":
            return aipo_loss(logits, t, *per_token, mask, entropy=True, loss_type="gspo",
                             old_logprobs=per_token[0] - 0.1, sequence_ids=sequence_ids, reduction="sequence_mean")
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
