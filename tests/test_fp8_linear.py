"""The FP8 linear layer (ops/fp8_linear.py): one FP8 GEMM with the activations
quantized per token, against its float64 reference; its refusals; and the
generator's FP8 layers running it: on CPU (torch's FP8 GEMM there) and, on a
GPU (`pytest -m gpu`), on its tensor cores."""

import datetime

import pytest
import torch
import torch.distributed as dist

import generator_workers as workers
from helpers import run_processes
from llamarl_core.models.llama_generator import Fp8Linear
from llamarl_core.ops.fp8 import quantize_fp8
from llamarl_core.ops.fp8_linear import fp8_gemm_refusal, fp8_linear, fp8_linear_ref

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def _fp8_gemm_on(request):
    """A GPU before sm_89 has no FP8 GEMM: its cases are skipped, saying so."""
    device = request.node.callspec.params.get("device") if hasattr(request.node, "callspec") else None
    if device == "cuda":
        reason = fp8_gemm_refusal(torch.bfloat16, torch.device("cuda"), 16, 16)
        if reason is not None:
            pytest.skip(reason)


def _quantized_weight(n: int, k: int, granularity: str, seed: int, device="cpu"):
    """(FP8 weight, its scale as one float32 per output row) of a random (n, k) weight."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * torch.rand(n, 1) * 3
    q, scale = quantize_fp8(w, granularity, backend="torch")
    scale = scale.reshape(-1).expand(n).contiguous() if granularity == "tensor" else scale
    return q.to(device), scale.to(device)


def _within_rounding(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, q, scale, bias=None) -> None:
    """y (bf16) is ref (float64) rounded to bf16 after the GEMM's accumulation:
    within one bf16 ulp of ref (2^-8 relative: the rounding and the bias's) plus
    the accumulation's error relative to the sum of |terms|: a few float32 ulps
    (2^-20) on the CPU; 2^-12 on a GPU, whose FP8 tensor cores keep about 14 bits
    of each partial sum before it is promoted to float32 (DeepSeek-V3 report,
    3.3.2; seen on an H200: 2^-20 failed by up to 0.36 at K = 1024)."""
    from llamarl_core.ops.fp8 import quantize_fp8_ref

    accumulation = 2.0**-12 if y.is_cuda else 2.0**-20
    x, q, scale, ref = x.cpu(), q.cpu(), scale.cpu(), ref.cpu()
    xq, xs = quantize_fp8_ref(x.reshape(-1, x.shape[-1]), "channel")
    magnitude = (xq.double().abs() * xs.double()) @ (q.double().abs() * scale.reshape(-1, 1).double()).T
    if bias is not None:
        magnitude = magnitude + bias.cpu().double().abs()
    bound = ref.abs().reshape(magnitude.shape) * 2.0**-8 + magnitude * accumulation
    gap = (y.cpu().double().reshape(magnitude.shape) - ref.reshape(magnitude.shape)).abs()
    assert (gap <= bound).all(), (gap - bound).max().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("shape", [(1, 64, 48), (7, 128, 16), (2, 5, 32, 96), (333, 1024, 512)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fp8_linear_equals_its_float64_reference(granularity, shape, bias, device):
    """On fresh random inputs (rows of very different sizes, a zero row): the FP8
    GEMM's bf16 output is the float64 product of the per-token FP8 activations
    and the FP8 weight (plus the bias), within bf16 rounding; on a GPU with no
    host sync."""
    *lead, k, n = shape
    x = (torch.randn(*lead, k) * torch.rand(*lead, 1) * 10).to(torch.bfloat16)
    x.reshape(-1, k)[0] = 0
    q, scale = _quantized_weight(n, k, granularity, seed=sum(shape), device=device)
    b = (torch.randn(n) * 4).to(torch.bfloat16).to(device) if bias else None
    x = x.to(device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        y = fp8_linear(x, q, scale, b)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    assert y.dtype == torch.bfloat16 and y.shape == (*lead, n) and y.device == x.device
    ref = fp8_linear_ref(x.cpu(), q.cpu(), scale.cpu(), None if b is None else b.cpu())
    assert torch.equal(y.reshape(-1, n)[0].cpu(), torch.zeros(n, dtype=torch.bfloat16) if b is None else b.cpu())
    _within_rounding(y, ref, x, q, scale, b)


def test_fp8_linear_empty_and_non_finite_rows():
    q, scale = _quantized_weight(32, 64, "channel", seed=1)
    assert fp8_linear(torch.empty(0, 64, dtype=torch.bfloat16), q, scale).shape == (0, 32)
    x = torch.randn(3, 64).to(torch.bfloat16)
    x[1, 5] = float("nan")
    y = fp8_linear(x, q, scale)
    assert not torch.isfinite(y[1]).any()
    _within_rounding(y[[0, 2]], fp8_linear_ref(x[[0, 2]], q, scale), x[[0, 2]], q, scale)


def test_fp8_linear_refuses_what_it_does_not_compute():
    q, scale = _quantized_weight(32, 64, "channel", seed=2)
    x = torch.randn(4, 64).to(torch.bfloat16)
    cases = [
        ((x.float(), q, scale), "torch.float32"),
        ((x[:, :40], q[:, :40].contiguous(), scale), r"\(32, 40\) is not a multiple of 16"),
        ((x, q[:24], scale[:24]), r"\(24, 64\) is not a multiple of 16"),
        ((x, q.float(), scale), "contiguous torch.float8_e4m3fn"),
        ((x, q.t().contiguous().t(), scale), "contiguous"),
        ((x, q, scale[:16]), r"of shape \(32,\) or \(32, 1\)"),
        ((x, q, scale.reshape(1, 32)), r"of shape \(32,\) or \(32, 1\)"),  # 32 values, not one a channel
        ((x, q, scale.double()), "float32"),
        ((torch.randn(4, 32).to(torch.bfloat16), q, scale), r"x \(4, 32\)"),
        ((x, q, scale, torch.zeros(32)), r"bias must be bfloat16 of shape \(32,\)"),
        ((x, q, scale, torch.zeros(16, dtype=torch.bfloat16)), r"bias must be bfloat16 of shape \(32,\)"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            fp8_linear(*args)
    assert fp8_gemm_refusal(torch.bfloat16, torch.device("meta"), 32, 64) == "no FP8 GEMM on meta"


def _expected_scale(name: str, layer: Fp8Linear, config) -> torch.Tensor:
    """One scale per output row, from the layer's scale parameter and the
    config's part sizes (not from the layer's own bookkeeping)."""
    scale = getattr(layer, layer.scale_name).detach().cpu()
    if scale.dim() == 2:  # per channel
        return scale.reshape(-1)
    if "qkv_proj" in name:
        head_dim = config.hidden_size // config.num_attention_heads
        parts = [config.num_attention_heads * head_dim] + [config.num_key_value_heads * head_dim] * 2
    elif "gate_up_proj" in name:
        parts = [config.intermediate_size] * 2
    else:
        parts = [layer.weight.shape[0]]
    return scale.reshape(-1).repeat_interleave(torch.tensor(parts)) if scale.numel() > 1 else scale.expand(sum(parts))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_generator_fp8_layers_run_the_fp8_gemm(granularity, device):
    """LlamaGenerator(fp8=, fp8_gemm="fp8") in bf16, synced from the trainer's
    weights (k_proj and up_proj 8 times larger than q / v and gate: distinct
    per-part scales): every FP8 layer runs the FP8 GEMM and its output, bias
    included, is fp8_linear's float64 reference with the scale each row's part
    has; the logits stay near those of dequantizing the same FP8 weights (the
    activations' rounding only), and decoding with the KV cache gives them
    again. "auto" dequantizes on CPU and runs the FP8 GEMM on a GPU: its logits
    are, bit for bit, those of the one it picks."""
    config, hf = workers.fp8_gemm_model()
    generators = {gemm: workers.fp8_gemm_generator(config, hf, granularity, gemm, device)
                  for gemm in ("fp8", "dequantize", "auto")}
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4)).to(device)
    seen = []
    names = {m: n for n, m in generators["fp8"].named_modules()}
    hooks = [m.register_forward_hook(lambda m, args, out: seen.append((m, args[0], out)))
             for m in generators["fp8"].modules() if isinstance(m, Fp8Linear)]
    with torch.no_grad():
        logits = {gemm: g(ids).float() for gemm, g in generators.items()}
        for hook in hooks:
            hook.remove()
        assert len(seen) == 2 * 2  # qkv and gate_up through forward (o and down are row-parallel: matmul)
        for layer, x, out in seen:
            assert layer.runs_fp8_gemm(x)
            scale = _expected_scale(names[layer], layer, config)
            ref = fp8_linear_ref(x.cpu(), layer.weight.cpu(), scale, layer.bias.cpu())
            _within_rounding(out, ref, x, layer.weight, scale, layer.bias)
        cache = generators["fp8"].new_cache()
        steps = [generators["fp8"](ids[:, :5], cache)] + [generators["fp8"](ids[:, i: i + 1], cache) for i in range(5, 9)]
    assert torch.equal(logits["auto"], logits["fp8" if device == "cuda" else "dequantize"])
    gap = (logits["fp8"] - logits["dequantize"]).abs().max().item()
    spread = logits["dequantize"].abs().max().item()
    print(f"{granularity}: max |FP8 GEMM logits - dequantized| = {gap:.4f} (logits up to {spread:.2f})")
    assert 0 < gap < 0.1 * spread
    assert (torch.cat(steps, dim=1).float() - logits["fp8"]).abs().max().item() <= 0.05 * spread


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_fp8_gemm_at_tp2_over_gloo_matches_tp1(granularity):
    """The FP8 GEMM in tensor-parallel layers (2 ranks over gloo, bf16): the
    row-parallel o_proj / down_proj multiply their input slices, all-reduce, then
    add the bias once; each rank's logits stay within the activations' rounding
    of the TP 1 FP8-GEMM generator's (each rank quantizes its own slice of a
    row-parallel input, so they are not bit for bit the same)."""
    config, hf = workers.fp8_gemm_model()
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = workers.fp8_gemm_generator(config, hf, granularity, "fp8")(ids).float()
        dequantized = workers.fp8_gemm_generator(config, hf, granularity, "dequantize")(ids).float()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    ranks = run_processes([(workers.fp8_gemm_tp_logits, dict(port=store.port, rank=r, world=2, granularity=granularity))
                           for r in range(2)], timeout=180)
    reference_gap = (expected - dequantized).abs().max().item()
    gaps = [(torch.from_numpy(logits) - expected).abs().max().item() for logits in ranks]
    print(f"{granularity}: TP 2 vs TP 1 FP8 GEMM {gaps}; TP 1 FP8 GEMM vs dequantized {reference_gap:.4f}")
    assert max(gaps) <= 2 * reference_gap, (gaps, reference_gap)


def test_fp8_gemm_refusals_in_the_generator():
    """gemm="fp8" where it cannot run says why: block scales at construction, a
    float32 model or a projection not a multiple of 16 at the first forward."""
    with pytest.raises(ValueError, match="block scales"):
        Fp8Linear(64, 32, False, "block", (32,), torch.bfloat16, "cpu", gemm="fp8")
    with pytest.raises(ValueError, match="gemm must be one of"):
        Fp8Linear(64, 32, False, "channel", (32,), torch.bfloat16, "cpu", gemm="fast")
    layer = Fp8Linear(64, 32, False, "channel", (32,), torch.float32, "cpu", gemm="fp8")
    with pytest.raises(ValueError, match="torch.float32"):
        layer(torch.randn(2, 64))
    layer = Fp8Linear(40, 32, False, "channel", (32,), torch.bfloat16, "cpu", gemm="fp8")
    with pytest.raises(ValueError, match="multiple of 16"):
        layer(torch.randn(2, 40).to(torch.bfloat16))
    auto = Fp8Linear(40, 32, False, "channel", (32,), torch.bfloat16, "cpu")
    assert not auto.runs_fp8_gemm(torch.randn(2, 40).to(torch.bfloat16))

