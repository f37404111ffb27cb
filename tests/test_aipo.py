"""AIPO / PPO-clip / PPO + TIS losses: the Triton kernels (on a GPU when there is
one, else in Triton's interpreter on CPU tensors) and the torch CPU path against
a float64 reference, values and gradients."""

import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from llamarl_core.ops.aipo import IGNORE_INDEX, aipo_loss, aipo_loss_ref, group_advantages, linear_aipo_loss
from llamarl_core.ops.logprob_launch import GPU_CONFIGS, LogprobConfig, logprob_launches
from llamarl_core.ops.aipo_inputs import REDUCTIONS
from llamarl_core.ops.objectives import DEFAULTS, OLD_POLICY_TYPES

LOSS_TYPES = ["aipo", "ppo", "ppo_tis"]


CUDA = torch.cuda.is_available()
KERNELS = "triton-cuda" if CUDA else "triton-interpreter"


def kernels_and_torch(loss_types):
    """(device, loss_type) pairs for `device` and `loss_type` parametrized together:
    every loss type on the torch path and in the kernels, but in Triton's
    interpreter the first alone: without a GPU the kernels compute the log-probs
    and the objective runs on the torch path after them (ops.objective_launch.
    fused_objective_runs), which the torch cases check for every loss type."""
    in_kernels = loss_types if CUDA else loss_types[:1]
    return [(KERNELS, t) for t in in_kernels] + [("torch", t) for t in loss_types]


@pytest.fixture(params=[KERNELS, "torch"])
def device(request, monkeypatch):
    """Where the loss runs: triton-cuda, the kernels on CUDA tensors; triton-interpreter,
    the kernels on CPU tensors under TRITON_INTERPRET=1 (conftest, without a GPU);
    torch, the chunked CPU path."""
    if request.param == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        return torch.device("cpu")
    return torch.device("cuda" if CUDA else "cpu")


def _inputs(n, v, dtype, seed, ratio="mixed", mask="partial"):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=gen) * 2).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    with torch.no_grad():
        logp = torch.log_softmax(logits.double(), -1).gather(-1, targets[:, None]).squeeze(-1).float()
    # Behaviour log-probs around the learner's: ratios below rho, and far above it.
    shift = {"below": 0.5, "above": -6.0, "mixed": None}[ratio]
    offsets = torch.randn(n, generator=gen) * 3 if shift is None else torch.full((n,), shift)
    behavior = (logp + offsets).clamp(max=0.0)  # log-probabilities: at most 0 (the loss refuses more)
    old = (logp + torch.randn(n, generator=gen) * 0.3).clamp(max=0.0)
    advantages = torch.randn(n, generator=gen)
    m = {"partial": (torch.rand(n, generator=gen) > 0.3).float(), "zero": torch.zeros(n), "ones": torch.ones(n)}[mask]
    return logits, targets, behavior, advantages, m, old


def _errors(loss, grad, ref_loss, ref_grad):
    scale = ref_grad.abs().max().clamp(min=1e-30)
    return abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-30), ((grad.double() - ref_grad).abs().max() / scale).item()


def _old(loss_type, old):
    """old_logprobs as a keyword for the objectives that read them (the others refuse them)."""
    return {"old_logprobs": old} if loss_type in OLD_POLICY_TYPES else {}


def _without_old(inputs, loss_type):
    return {k: v for k, v in inputs.items() if k != "old_logprobs" or loss_type in OLD_POLICY_TYPES}


def _params(**kw):
    """kw without rho for an objective that does not read it (those refuse it)."""
    if "rho" not in DEFAULTS[kw.get("loss_type", "aipo")]:
        kw.pop("rho", None)
    return kw


def _run(logits, targets, behavior, advantages, m, old, fn, device=torch.device("cpu"), **kw):
    """fn on the inputs moved to `device`; returns its output and the logits' gradient on CPU."""
    x = logits.to(device).clone().requires_grad_()
    on_device = [t.to(device) for t in (targets, behavior, advantages, m, old)]
    out = fn(x, *on_device[:4], **_old(kw.get("loss_type", "aipo"), on_device[4]), **kw)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return out, x.grad.cpu()


SHAPES = [(1, 1001), (97, 1001), (300, 1001), (97, 32000), (300, 32000)]


@pytest.mark.parametrize("n, v", SHAPES)
@pytest.mark.parametrize("device, loss_type", kernels_and_torch(LOSS_TYPES), indirect=["device"])
def test_fp32_matches_float64_reference(device, n, v, loss_type):
    args = _inputs(n, v, torch.float32, n + v)
    kw = _params(rho=2.0, temperature=0.7, loss_type=loss_type)
    (loss, stats), grad = _run(*args, aipo_loss, device, **kw)
    ref, ref_grad = _run(args[0].double(), *args[1:], aipo_loss_ref, **kw)
    loss_err, grad_err = _errors(loss, grad, ref, ref_grad)
    assert loss_err <= 1e-5 and grad_err <= 1e-5, (loss_err, grad_err)
    assert (stats.logprobs <= 0).all() and torch.isfinite(grad).all()


@pytest.mark.parametrize("n, v", [(97, 1001), (97, 32000)])
@pytest.mark.parametrize("device, loss_type", kernels_and_torch(LOSS_TYPES), indirect=["device"])
def test_bf16_within_twice_the_error_of_plain_torch_bf16(device, n, v, loss_type):
    args = _inputs(n, v, torch.bfloat16, 7 * n + v)
    kw = _params(rho=2.0, temperature=0.7, loss_type=loss_type)
    (loss, _), grad = _run(*args, aipo_loss, device, **kw)
    naive, naive_grad = _run(*args, aipo_loss_ref, compute_dtype=None, **kw)
    ref, ref_grad = _run(args[0].double(), *args[1:], aipo_loss_ref, **kw)
    ours, theirs = _errors(loss, grad, ref, ref_grad), _errors(naive, naive_grad, ref, ref_grad)
    assert grad.dtype == torch.bfloat16
    assert ours[0] <= 2 * theirs[0] + 1e-6 and ours[1] <= 2 * theirs[1] + 1e-6, (ours, theirs)


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "sum"])
@pytest.mark.parametrize("ratio", ["below", "above"])
@pytest.mark.parametrize("mask", ["partial", "ones"])
def test_reductions_ratios_and_masks(device, reduction, ratio, mask):
    args = _inputs(60, 1001, torch.float32, 3, ratio=ratio, mask=mask)
    seq = torch.arange(60) // 9
    kw = _params(rho=4.0, reduction=reduction)
    (loss, stats), grad = _run(*args, aipo_loss, device, sequence_ids=seq.to(device), **kw)
    ref, ref_grad = _run(args[0].double(), *args[1:], aipo_loss_ref, sequence_ids=seq, **kw)
    assert max(_errors(loss, grad, ref, ref_grad)) <= 1e-5
    expected_truncated = 1.0 if ratio == "above" else 0.0  # exp(6) > 4 > exp(-0.5)
    assert stats.truncated_fraction.item() == pytest.approx(expected_truncated)


def test_fully_masked_gives_zero_loss_and_zero_gradients(device):
    args = _inputs(50, 1001, torch.float32, 4, mask="zero")
    for reduction in ("token_mean", "sequence_mean", "sum"):
        (loss, stats), grad = _run(*args, aipo_loss, device, reduction=reduction,
                                   sequence_ids=(torch.arange(50) // 5).to(device))
        assert loss.item() == 0.0 and torch.count_nonzero(grad) == 0
        assert torch.isfinite(stats.mismatch_kl) and torch.isfinite(stats.mean_ratio)


def test_stats_match_their_definitions(device):
    logits, targets, behavior, advantages, m, old = _inputs(80, 1001, torch.float32, 5)
    _, stats = aipo_loss(*(t.to(device) for t in (logits, targets, behavior, advantages, m)), rho=2.0, entropy=True)
    logp_all = torch.log_softmax(logits.double(), -1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    sel = m.bool()
    log_ratio = logp - behavior.double()  # log(pi / mu) of tokens sampled from mu
    assert torch.allclose(stats.logprobs.cpu().double()[sel], logp[sel], atol=1e-5)
    assert torch.count_nonzero(stats.logprobs.cpu()[~sel]) == 0  # a token whose mask is 0 is never scored
    assert stats.mean_ratio.item() == pytest.approx(torch.exp(log_ratio)[sel].mean().item(), rel=1e-5)
    assert stats.truncated_fraction.item() == pytest.approx((torch.exp(log_ratio) > 2.0)[sel].double().mean().item())
    k3 = torch.exp(log_ratio) - 1 - log_ratio
    assert stats.mismatch_kl.item() == pytest.approx(k3[sel].mean().item(), rel=1e-4)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    assert stats.entropy.item() == pytest.approx(entropy[sel].mean().item(), rel=1e-5)


def test_masked_vocabulary_ignore_index_and_leading_dims(device):
    logits, targets, behavior, advantages, m, old = _inputs(48, 1001, torch.float32, 6)
    logits[:, 500:] = float("-inf")  # masked vocabulary
    targets = targets % 500
    targets[::7] = IGNORE_INDEX
    shaped = [t.reshape(6, 8).to(device) for t in (targets, behavior, advantages, m)]
    x = logits.reshape(6, 8, 1001).to(device).clone().requires_grad_()
    loss, stats = aipo_loss(x, *shaped, temperature=0.7, entropy=True)
    loss.backward()
    grad = x.grad.cpu()
    xr = logits.double().clone().requires_grad_()
    ref = aipo_loss_ref(xr, targets, behavior, advantages, m, temperature=0.7)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(grad.reshape(48, 1001).double(), xr.grad, atol=1e-6)
    assert (x.grad.reshape(48, 1001)[:, 500:] == 0).all()
    assert (x.grad.reshape(48, 1001)[::7] == 0).all()  # ignored tokens
    assert torch.isfinite(stats.entropy)


def test_log_probs_never_positive_for_peaked_logits(device):
    logits = torch.randn(64, 1001, device=device) * 1e4  # one dominant logit per row
    targets = logits.argmax(-1)
    loss, stats = aipo_loss(logits, targets, torch.zeros(64, device=device), torch.ones(64, device=device))
    assert (stats.logprobs <= 0).all() and torch.isfinite(loss)


def test_bad_targets_and_arguments_raise():
    logits, targets, behavior, advantages, m, old = _inputs(10, 101, torch.float32, 8)
    for bad in (101, -1, -5):
        t = targets.clone()
        t[3] = bad
        with pytest.raises(ValueError, match=rf"targets\[3\] = {bad} is outside \[0, 101\)"):
            aipo_loss(logits, t, behavior, advantages)
    t = targets.clone()
    t[[2, 6, 8]] = torch.tensor([IGNORE_INDEX, 500, -7])
    with pytest.raises(ValueError, match=r"targets\[6\] = 500 is outside"):  # the first bad one
        linear_aipo_loss(torch.randn(10, 8), torch.randn(101, 8), t, behavior, advantages)
    with pytest.raises(ValueError, match="sequence_ids"):
        aipo_loss(logits, targets, behavior, advantages, reduction="sequence_mean")
    with pytest.raises(ValueError, match="advantages must have shape"):
        aipo_loss(logits, targets, behavior, advantages[:-1])
    with pytest.raises(ValueError, match="loss_type"):
        aipo_loss(logits, targets, behavior, advantages, loss_type="grpo")
    head = torch.nn.Linear(8, 101, bias=False)
    with pytest.raises(ValueError, match=r"weight must be a tensor, got Linear \(pass the lm-head's weight"):
        linear_aipo_loss(torch.randn(10, 8), head, targets, behavior, advantages)


@pytest.mark.parametrize("v", [1, 5, 97, 1025])
@pytest.mark.parametrize("device, loss_type", kernels_and_torch(LOSS_TYPES), indirect=["device"])
def test_odd_vocabularies_masked_columns_and_ignored_tokens(device, v, loss_type):
    """Vocabularies of one token, a prime, one past a block size; every fourth
    column -inf but the targets'; ignored tokens; temperature above 1; the entropy."""
    logits, targets, behavior, advantages, m, old = _inputs(37, v, torch.float32, v)
    if v >= 5:
        logits[:, 1::4] = float("-inf")
        targets -= targets % 4
    targets[::5] = IGNORE_INDEX
    kw = _params(rho=2.0, temperature=1.3, loss_type=loss_type)
    (loss, stats), grad = _run(logits, targets, behavior, advantages, m, old, aipo_loss, device, entropy=True, **kw)
    ref, ref_grad = _run(logits.double(), targets, behavior, advantages, m, old, aipo_loss_ref, **kw)
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item()) + 1e-7
    # One token: dl / dlogits is 0, the kernels' p = exp(0) within rounding.
    torch.testing.assert_close(grad.double(), ref_grad, rtol=0, atol=1e-5 * ref_grad.abs().max().item() + 1e-7)
    x = logits.double() / 1.3
    logp_all = torch.log_softmax(x, -1)
    entropy = -torch.where(logp_all > float("-inf"), logp_all.exp() * logp_all, 0.0).sum(-1)
    sel = (m * (targets != IGNORE_INDEX)).bool()
    assert stats.entropy.item() == pytest.approx(entropy[sel].mean().item(), rel=1e-5, abs=1e-6)


def test_a_row_of_minus_inf_only_with_an_ignored_token_adds_nothing(device):
    """A row with no probability mass, its token ignored: no NaN reaches the loss or
    the other rows, and its own gradient is 0."""
    logits, targets, behavior, advantages, m, old = _inputs(20, 97, torch.float32, 14)
    logits[6] = float("-inf")
    targets[6] = IGNORE_INDEX
    (loss, stats), grad = _run(logits, targets, behavior, advantages, m, old, aipo_loss, device, temperature=0.7)
    keep = torch.arange(20) != 6
    ref, ref_grad = _run(logits[keep].double(), *(t[keep] for t in (targets, behavior, advantages, m, old)),
                         aipo_loss_ref, temperature=0.7)
    assert max(_errors(loss, grad[keep], ref, ref_grad)) <= 1e-5
    assert torch.equal(grad[6], torch.zeros(97)) and stats.logprobs[6].item() == 0.0


# ----------------------------------------------------------------------------- log-prob kernels, every config


def _logprob_ref(logits, targets, temperature, coef):
    """float64 (lse, logp, entropy, dlogits = coef * (onehot - softmax) / T). A row of
    -inf only: lse -inf, entropy NaN, logp NaN (0 if ignored), p = 0."""
    x = logits.double() / temperature
    lse = torch.logsumexp(x, -1)
    p = torch.where(lse[:, None] == float("-inf"), 0.0, torch.exp(x - lse[:, None]))
    valid = targets != IGNORE_INDEX
    logp = torch.where(valid, x.gather(-1, targets.clamp(min=0)[:, None]).squeeze(-1) - lse, 0.0)
    entropy = lse - torch.where(p > 0, p * x, 0.0).sum(-1) / p.sum(-1)
    onehot = torch.nn.functional.one_hot(targets.clamp(min=0), x.shape[1]) * valid[:, None]
    return lse, logp, entropy, coef.double()[:, None] / temperature * (onehot - p)


# Several blocks a row (16), masked rows (4 a program over 7), the backward's 2-D
# grid (min_programs), one warp; then each config a GPU launches.
KERNEL_CONFIGS = [(LogprobConfig(16, 4, 4),) * 2, (LogprobConfig(128, 2, 4), LogprobConfig(128, 2, 4, min_programs=6)),
                  (LogprobConfig(64, 1, 1), LogprobConfig(64, 1, 1, min_programs=64)),
                  *(configs for _, *configs in GPU_CONFIGS)]


# Launches run straight, not through the launchers' numpy.errstate: numpy warns of
# the overflows to -inf (and log2(0), 0 / 0 in a row of -inf only) a GPU takes silently.
IEEE_IN_INTERPRETER = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


@IEEE_IN_INTERPRETER
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 5, 97, 129, 1001])
def test_logprob_kernels_match_float64_reference_for_every_config(dtype, vocab):
    """lse, logp, entropy and dlogits of every config against float64 on fresh
    inputs with -inf columns, a row of -inf only, ignored tokens, temperature 0.7;
    outputs poisoned with NaN first."""
    device = torch.device("cuda" if CUDA else "cpu")
    n = 7
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(n, vocab, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    if vocab >= 5:
        logits[:, 2::3] = float("-inf")
        targets -= (targets % 3 == 2).long()
    logits[5] = float("-inf")
    targets[[2, 5]] = IGNORE_INDEX
    coef = torch.randn(n, generator=gen)
    want = _logprob_ref(logits, targets, 0.7, coef)
    on = [t.to(device) for t in (logits, targets, coef)]
    for config in KERNEL_CONFIGS:
        lse, logp, ent = (torch.full((n,), float("nan"), device=device) for _ in range(3))
        dlogits = torch.full_like(on[0], float("nan"))
        forward, backward = logprob_launches(on[0], on[1], lse, logp, ent, on[2], dlogits, 0.7, *config)
        forward.launch(device)
        backward.launch(device)
        # atol: a few float32 ulps of |x / T| (up to about 20 here), which H = lse - E[x / T] cancels.
        for name, got, expected in zip(("lse", "logp", "entropy"), (lse, logp, ent), want[:3]):
            torch.testing.assert_close(got.cpu().double(), expected, rtol=2e-6, atol=1e-5, equal_nan=True,
                                       msg=lambda m: f"{name}, {config}: {m}")
        expected = want[3].to(dtype).double() if dtype != torch.float32 else want[3]
        torch.testing.assert_close(dlogits.cpu().double(), expected, rtol=2**-7 if dtype != torch.float32 else 1e-5,
                                   atol=1e-6, msg=lambda m: f"dlogits, {config}: {m}")
        # The entropy's gradient too: + g * (-p (log p + H)) / T, with the entropies the forward wrote.
        grad_entropy = torch.randn(n, generator=gen)
        dlogits.fill_(float("nan"))
        logprob_launches(on[0], on[1], lse, logp, ent, on[2], dlogits, 0.7, *config,
                         grad_entropy=grad_entropy.to(device))[1].launch(device)
        x = logits.double() / 0.7
        p = torch.where(want[0][:, None] == float("-inf"), 0.0, torch.exp(x - want[0][:, None]))
        log_p = torch.where(p > 0, x - want[0][:, None], 0.0)
        with_entropy = want[3] - grad_entropy.double()[:, None] / 0.7 * p * (log_p + torch.nan_to_num(want[2])[:, None])
        expected = with_entropy.to(dtype).double() if dtype != torch.float32 else with_entropy
        torch.testing.assert_close(dlogits.cpu().double(), expected, rtol=2**-7 if dtype != torch.float32 else 1e-5,
                                   atol=1e-5, msg=lambda m: f"dlogits with the entropy's gradient, {config}: {m}")


def test_gpu_sweep_candidates_compile_for_sm90_without_spills():
    """Every config `bench_aipo --gpu-sweep` times compiles for an H100, so the GPU
    run cannot fail on one, and any of them can become a default."""
    probe = textwrap.dedent("""
        import json
        from dataclasses import asdict
        from llamarl_core.bench import bench_aipo_sweep
        from llamarl_core.ops import kernel_check
        kernel_check._variants = bench_aipo_sweep.sweep_variants
        print(json.dumps([asdict(r) for r in kernel_check.compile_here((90,))]))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # Outside the repository: the installed package (its bench subpackage), not the sources.
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, env=env,
                         cwd=tempfile.gettempdir())
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    assert len(rows) == 22
    assert [(r["name"], r["error"]) for r in rows if r["error"] or r["spill_bytes"]] == []


@IEEE_IN_INTERPRETER
def test_gpu_sweep_runs_end_to_end_on_tiny_inputs(monkeypatch):
    """The sweep's code path on tiny inputs (CPU tensors in the interpreter without
    a GPU), every timing one call: a slip in it must not cost a GPU run."""
    from llamarl_core.bench import bench_aipo, bench_aipo_sweep

    monkeypatch.setattr(bench_aipo_sweep, "_median_ms", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(bench_aipo_sweep, "_SWEEP_LAUNCHES", ((128, 1, 4), (64, 2, 2)))
    monkeypatch.setattr(bench_aipo_sweep, "_SWEEP_MIN_PROGRAMS", (0, 16))
    spec = bench_aipo.parse_args(["--gpu-sweep", "--sweep-chunks-mib", "1", "4"])
    result = bench_aipo_sweep.gpu_sweep(spec, torch.device("cuda" if CUDA else "cpu"), shapes=((6, 300),),
                                  linear=(40, 16, 3000))
    report = bench_aipo_sweep.sweep_report(result)
    assert len(result["kernels"]) == 2 + 2 + 4 + 1 and len(result["linear"]) == 3
    assert all(r["diff"] < 1e-2 for r in result["kernels"] if "diff" in r), report
    assert "best backward at 6 x 300" in report and "linear_aipo_loss, chunk 4 MiB" in report


def test_gpu_sweep_arguments_parse_and_it_asks_for_a_gpu():
    from llamarl_core.bench import bench_aipo, bench_aipo_sweep

    spec = bench_aipo.parse_args(["--gpu-sweep", "--sweep-chunks-mib", "256", "512"])
    assert spec.gpu_sweep and spec.sweep_chunks_mib == [256, 512]
    forwards, backwards = bench_aipo_sweep.sweep_configs()
    assert GPU_CONFIGS[-1][1] in forwards and GPU_CONFIGS[-1][2] in backwards  # the defaults beside their rivals
    if not CUDA:
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            bench_aipo.main(["--gpu-sweep"])


# ----------------------------------------------------------------------------- linear variant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device, loss_type", kernels_and_torch(["aipo", "ppo_tis"]), indirect=["device"])
@pytest.mark.parametrize("chunk_size", [None, 16, 41])
def test_linear_variant_matches_reference(device, dtype, loss_type, chunk_size):
    gen = torch.Generator().manual_seed(11)
    n, h, v = 97, 64, 1001
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (torch.randn(v, h, generator=gen) / 8).to(dtype)
    _, targets, behavior, advantages, m, old = _inputs(n, v, torch.float32, 12)
    kw = _params(rho=2.0, temperature=0.7, loss_type=loss_type, reduction="sequence_mean")
    seq = torch.arange(n) // 10
    hx, wx = hidden.to(device).clone().requires_grad_(), weight.to(device).clone().requires_grad_()
    loss, stats = linear_aipo_loss(hx, wx, *(t.to(device) for t in (targets, behavior, advantages, m)),
                                   chunk_size=chunk_size, **_old(loss_type, old.to(device)), sequence_ids=seq.to(device),
                                   **kw)
    loss.backward()
    kw.update(**_old(loss_type, old), sequence_ids=seq)
    grad_h, grad_w = hx.grad.cpu(), wx.grad.cpu()

    def reference(compute_dtype, cast):
        hr, wr = hidden.to(cast).clone().requires_grad_(), weight.to(cast).clone().requires_grad_()
        out = aipo_loss_ref(hr @ wr.t(), targets, behavior, advantages, m, compute_dtype=compute_dtype, **kw)
        out.backward()
        return out, hr.grad, wr.grad

    ref, ref_h, ref_w = reference(torch.float64, torch.float64)
    if dtype == torch.float32:
        tol_loss = tol_h = tol_w = 1e-5
    else:  # within twice the error of the naive bf16 version (+ a floor for tiny errors)
        naive, naive_h, naive_w = reference(None, dtype)
        tol_loss = 2 * abs(naive.item() - ref.item()) / abs(ref.item()) + 1e-6
        tol_h = 2 * ((naive_h.double() - ref_h).abs().max() / ref_h.abs().max()).item() + 1e-6
        tol_w = 2 * ((naive_w.double() - ref_w).abs().max() / ref_w.abs().max()).item() + 1e-6
    assert abs(loss.item() - ref.item()) / abs(ref.item()) <= tol_loss
    assert ((grad_h.double() - ref_h).abs().max() / ref_h.abs().max()).item() <= tol_h
    assert ((grad_w.double() - ref_w).abs().max() / ref_w.abs().max()).item() <= tol_w
    assert grad_h.dtype == dtype and grad_w.dtype == dtype and (stats.logprobs <= 0).all()


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 1.0, 5.0, 3.0, 2.0])
    groups = torch.tensor([7, 7, 7, 9, 9, 9])
    assert torch.allclose(group_advantages(rewards, groups), torch.tensor([1 / 3, -2 / 3, 1 / 3, 5 / 3, -1 / 3, -4 / 3]))
    std = group_advantages(rewards, groups, normalize_std=True)
    assert torch.allclose(std[:3], torch.tensor([1 / 3, -2 / 3, 1 / 3]) / torch.tensor([1.0, 0.0, 1.0]).std() , atol=1e-5)
    # One NaN reward would spread over its group: refused naming it.
    with pytest.raises(ValueError, match=r"rewards\[4\] = nan: rewards must be finite"):
        group_advantages(torch.tensor([1.0, 0.0, 1.0, 5.0, float("nan"), 2.0]), groups)
    for eps in (float("nan"), -1e-6, True):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            group_advantages(rewards, groups, normalize_std=True, eps=eps)


def test_mismatch_kl_estimates_kl_of_behaviour_from_learner(monkeypatch):
    """Tokens sampled from a known behaviour distribution mu, scored by a known
    learner distribution pi: stats.mismatch_kl must estimate KL(mu || pi) (float64,
    exact), within 4 standard errors of the Monte Carlo mean; the estimator with
    the ratio inverted (mu / pi) has a different mean, far outside that band. The
    statistic is computed from the log-probs whatever path made them: the torch
    path here (20000 rows would take minutes in the interpreter)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(21)
    v, n = 40, 20000
    mu = torch.softmax(torch.randn(v, generator=gen, dtype=torch.float64) * 1.5, 0)
    pi = torch.softmax(torch.randn(v, generator=gen, dtype=torch.float64) * 1.5, 0)
    tokens = torch.multinomial(mu, n, replacement=True, generator=gen)
    logits = pi.log().to(torch.float32).expand(n, v)  # every row is the learner's distribution
    _, stats = aipo_loss(logits, tokens, mu.log()[tokens].to(torch.float32), torch.zeros(n))
    kl = (mu * (mu / pi).log()).sum().item()
    log_ratio = (pi / mu).log()[tokens]
    per_token = log_ratio.exp() - 1 - log_ratio
    standard_error = (per_token.std() / n**0.5).item()
    assert abs(stats.mismatch_kl.item() - kl) <= 4 * standard_error, (stats.mismatch_kl.item(), kl, standard_error)
    inverted_mean = (mu * mu / pi).sum().item() - 1 - kl  # E_mu[mu / pi - 1 - log(mu / pi)]
    assert abs(inverted_mean - kl) > 20 * standard_error


# ----------------------------------------------------------------------------- KL penalty against a reference policy


def _ref_logprobs(logits, targets, seed, temperature):
    """A reference policy's log-probs of the targets: the learner's, displaced both
    ways (k3 and its derivative are asymmetric in ref - logp)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        logp = torch.log_softmax(logits.double() / temperature, -1).gather(-1, targets[:, None]).squeeze(-1)
    return (logp + torch.randn(logp.shape, generator=gen, dtype=torch.float64)).clamp(max=0.0).float()


def _k3_mean(logits, targets, ref, m, temperature):
    """Mean over the masked tokens of exp(ref - logp) - (ref - logp) - 1, in float64."""
    logp = torch.log_softmax(logits.double() / temperature, -1).gather(-1, targets[:, None]).squeeze(-1)
    x = ref.double() - logp
    return ((torch.exp(x) - x - 1) * m).sum().item() / m.sum().item()


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("device, loss_type", kernels_and_torch(LOSS_TYPES), indirect=["device"])
def test_kl_penalty_matches_float64_reference(device, loss_type, reduction):
    n, v = 61, 1001
    args = _inputs(n, v, torch.float32, 31)
    logits, targets, m = args[0], args[1], args[4]
    ref = _ref_logprobs(logits, targets, 32, 0.7)
    seq = torch.arange(n) // 7
    kw = _params(rho=2.0, temperature=0.7, loss_type=loss_type, reduction=reduction, kl_coef=0.3)
    (loss, stats), grad = _run(*args, aipo_loss, device, sequence_ids=seq.to(device), ref_logprobs=ref.to(device), **kw)
    expected, expected_grad = _run(logits.double(), *args[1:], aipo_loss_ref, sequence_ids=seq, ref_logprobs=ref, **kw)
    assert max(_errors(loss, grad, expected, expected_grad)) <= 1e-5
    assert stats.ref_kl.item() == pytest.approx(_k3_mean(logits, targets, ref, m, 0.7), rel=1e-5)
    without, _ = _run(logits.double(), *args[1:], aipo_loss_ref, sequence_ids=seq, **{**kw, "kl_coef": 0.0})
    assert abs(expected.item() - without.item()) > 1e-3  # the penalty is really in the loss


def test_reference_kl_term_is_its_definition():
    """The reference's own KL term, checked by hand: with reduction="sum" it adds
    kl_coef * sum(m * k3) to the loss and kl_coef * (1 - exp(ref - logp)) * m to
    dl / dlogp, so dlogits gains that times (onehot - softmax)."""
    logits, targets, behavior, advantages, m, old = _inputs(40, 101, torch.float64, 33)
    ref = _ref_logprobs(logits, targets, 34, 1.0).double()
    with_kl, grad_kl = _run(logits, targets, behavior, advantages, m, old, aipo_loss_ref, reduction="sum",
                            ref_logprobs=ref, kl_coef=0.3)
    plain, grad_plain = _run(logits, targets, behavior, advantages, m, old, aipo_loss_ref, reduction="sum")
    p = torch.softmax(logits, -1)
    x = ref - p.log().gather(-1, targets[:, None]).squeeze(-1)
    assert (with_kl - plain).item() == pytest.approx(0.3 * ((torch.exp(x) - x - 1) * m).sum().item(), rel=1e-12)
    dlogp = 0.3 * (1 - torch.exp(x)) * m
    expected = dlogp[:, None] * (torch.nn.functional.one_hot(targets, 101) - p)
    assert torch.allclose(grad_kl - grad_plain, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("device, loss_type", kernels_and_torch(LOSS_TYPES), indirect=["device"])
def test_linear_variant_kl_penalty_matches_float64_reference(device, loss_type, reduction):
    gen = torch.Generator().manual_seed(35)
    n, h, v = 53, 48, 1001
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) / 8
    _, targets, behavior, advantages, m, old = _inputs(n, v, torch.float32, 36)
    ref = _ref_logprobs(hidden @ weight.t(), targets, 37, 0.7)
    seq = torch.arange(n) // 6
    kw = _params(rho=2.0, temperature=0.7, loss_type=loss_type, reduction=reduction, kl_coef=0.3)
    hx, wx = hidden.to(device).clone().requires_grad_(), weight.to(device).clone().requires_grad_()
    loss, stats = linear_aipo_loss(hx, wx, *(t.to(device) for t in (targets, behavior, advantages, m)),
                                   **_old(loss_type, old.to(device)), sequence_ids=seq.to(device),
                                   ref_logprobs=ref.to(device), chunk_size=16, **kw)
    loss.backward()
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    expected = aipo_loss_ref(hr @ wr.t(), targets, behavior, advantages, m, **_old(loss_type, old), sequence_ids=seq,
                             ref_logprobs=ref, **kw)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
    for got, want in ((hx.grad.cpu(), hr.grad), (wx.grad.cpu(), wr.grad)):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() <= 1e-5
    assert stats.ref_kl.item() == pytest.approx(_k3_mean(hidden @ weight.t(), targets, ref, m, 0.7), rel=1e-5)


def test_kl_penalty_vanishes_when_the_reference_is_the_learner(device):
    """ref_logprobs = the learner's own log-probs: k3 = 0 and dk3 / dlogp = 0 exactly,
    so the loss and the gradients are those without the penalty, bit for bit."""
    logits, targets, behavior, advantages, m, old = _inputs(45, 1001, torch.float32, 38)
    kw = _params(rho=2.0, temperature=0.7)
    (loss, stats), grad = _run(logits, targets, behavior, advantages, m, old, aipo_loss, device, **kw)
    (kl_loss, kl_stats), kl_grad = _run(logits, targets, behavior, advantages, m, old, aipo_loss, device,
                                        ref_logprobs=stats.logprobs, kl_coef=1.0, **kw)
    assert stats.ref_kl is None and kl_stats.ref_kl.item() == 0.0
    assert torch.equal(kl_loss, loss) and torch.equal(kl_grad, grad)

    gen = torch.Generator().manual_seed(39)
    hidden = torch.randn(45, 32, generator=gen).to(device)
    weight = (torch.randn(1001, 32, generator=gen) / 8).to(device)
    on_device = [t.to(device) for t in (targets, behavior, advantages, m)]

    def linear(**extra):
        hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out, out_stats = linear_aipo_loss(hx, wx, *on_device, chunk_size=16, **kw, **extra)
        out.backward()
        return out, out_stats, hx.grad, wx.grad

    plain = linear()
    with_kl = linear(ref_logprobs=plain[1].logprobs, kl_coef=1.0)
    assert with_kl[1].ref_kl.item() == 0.0
    for a, b in zip((plain[0], *plain[2:]), (with_kl[0], *with_kl[2:])):
        assert torch.equal(a, b)


def test_bad_kl_arguments_raise():
    logits, targets, behavior, advantages, m, old = _inputs(10, 101, torch.float32, 40)
    weight = torch.randn(101, 8)
    hidden = torch.randn(10, 8)
    calls = [lambda **kw: aipo_loss(logits, targets, behavior, advantages, **kw),
             lambda **kw: linear_aipo_loss(hidden, weight, targets, behavior, advantages, **kw),
             lambda **kw: aipo_loss_ref(logits, targets, behavior, advantages, **kw)]
    for call in calls:
        with pytest.raises(ValueError, match=r"kl_coef=0\.1 needs ref_logprobs"):
            call(kl_coef=0.1)
        for bad in (-0.1, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=r"kl_coef must be finite and >= 0"):
                call(kl_coef=bad, ref_logprobs=behavior)
    with pytest.raises(ValueError, match="ref_logprobs must have shape"):
        aipo_loss(logits, targets, behavior, advantages, ref_logprobs=behavior[:-1], kl_coef=0.1)


def test_ref_kl_estimates_kl_of_learner_from_reference(monkeypatch):
    """Tokens sampled from the learner pi (behaviour = learner), scored against a
    known reference: stats.ref_kl must estimate KL(pi || ref) within 4 standard
    errors; the estimator with the ratio inverted (pi / ref) has a different mean,
    far outside that band. On the torch path, as in the mismatch test."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(41)
    v, n = 40, 20000
    pi = torch.softmax(torch.randn(v, generator=gen, dtype=torch.float64) * 1.5, 0)
    ref = torch.softmax(torch.randn(v, generator=gen, dtype=torch.float64) * 1.5, 0)
    tokens = torch.multinomial(pi, n, replacement=True, generator=gen)
    logits = pi.log().to(torch.float32).expand(n, v)
    _, stats = aipo_loss(logits, tokens, pi.log()[tokens].float(), torch.zeros(n),
                         ref_logprobs=ref.log()[tokens].float(), kl_coef=0.1)
    kl = (pi * (pi / ref).log()).sum().item()
    x = (ref / pi).log()[tokens]
    standard_error = ((x.exp() - x - 1).std() / n**0.5).item()
    assert abs(stats.ref_kl.item() - kl) <= 4 * standard_error, (stats.ref_kl.item(), kl, standard_error)
    inverted_mean = (pi * pi / ref).sum().item() - 1 - kl  # E_pi[pi / ref - 1 - log(pi / ref)]
    assert abs(inverted_mean - kl) > 20 * standard_error


# ----------------------------------------------------------------------------- batched (B, T) inputs


# Each case: the leading shape, the advantages' form ("row": (B,), "row1": (B, 1),
# "token": (B, T)), the reduction with its sequences ("implied": one a row, "packed":
# two a row by sequence_ids numbered within each row), how padding is marked ("mask":
# mask 0 and out-of-range targets there; "ignore": no mask, IGNORE_INDEX targets).
REDUCTION_CASES = [("token_mean", None), ("sequence_mean", "implied"), ("sequence_mean", "packed"), ("sum", None)]


def _batched_cases():
    """A few dozen random shapes, every combination of the forms above once, then
    the edges: a lone token, B = 1, nothing counted, leading dims (2, 3, T)."""
    gen = torch.Generator().manual_seed(123)
    cases = []
    for i, ((reduction, seq), adv, pad) in enumerate(itertools.product(REDUCTION_CASES, ("row", "row1", "token"),
                                                                      ("mask", "ignore"))):
        lead = (int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 10, (1,), generator=gen)))
        vocab = [2, 5, 13, 97, 300][i % 5]
        cases.append(dict(lead=lead, vocab=vocab, adv=adv, reduction=reduction, seq=seq, pad=pad, seed=i,
                          kl=i % 3 == 0, empty=False))
    cases += [dict(lead=(1, 1), vocab=7, adv="row", reduction="sequence_mean", seq="implied", pad="mask", seed=100,
                   kl=True, empty=False),
              dict(lead=(1, 7), vocab=33, adv="row1", reduction="token_mean", seq=None, pad="mask", seed=101,
                   kl=False, empty=False),
              dict(lead=(3, 4), vocab=19, adv="row", reduction="sequence_mean", seq="implied", pad="mask", seed=102,
                   kl=True, empty=True),
              dict(lead=(2, 3, 6), vocab=29, adv="row1", reduction="sequence_mean", seq="packed", pad="mask",
                   seed=103, kl=True, empty=False)]
    return cases


BATCHED_CASES = _batched_cases()


def _batched_inputs(case, logits):
    """Per-token inputs of a case for `logits` (..., T, V): garbage wherever a token
    does not count (targets -1, V + 7 or huge; NaN / inf in the float inputs), and
    the same inputs flattened to the tokens that count, with global sequence ids:
    the flat call the batched one must equal."""
    gen = torch.Generator().manual_seed(case["seed"])
    lead, v = case["lead"], case["vocab"]
    rows, t = lead[:-1], lead[-1]
    targets = torch.randint(0, v, lead, generator=gen)
    lengths = torch.zeros(rows, dtype=torch.int64) if case["empty"] else torch.randint(0, t + 1, rows, generator=gen)
    if not case["empty"]:
        lengths.view(-1)[0] = t  # at least one full row
    pad = torch.arange(t) >= lengths.unsqueeze(-1)
    inside = ~pad & (torch.rand(lead, generator=gen) < 0.1)  # ignored tokens among the counted
    targets[inside] = IGNORE_INDEX
    garbage = torch.tensor([-1, v + 7, 10**9])[torch.randint(0, 3, lead, generator=gen)]
    targets = torch.where(pad, garbage if case["pad"] == "mask" else IGNORE_INDEX, targets)
    mask = None if case["pad"] == "ignore" else (~pad).float()
    counted = ~pad & (targets != IGNORE_INDEX)
    with torch.no_grad():
        logp = torch.log_softmax(logits.double(), -1).gather(-1, targets.clamp(0, v - 1).unsqueeze(-1)).squeeze(-1)

    def around_logp(scale, padding):
        around = (logp + torch.randn(lead, generator=gen, dtype=torch.float64) * scale).clamp(max=0.0)
        return torch.where(pad, padding, around).float()

    behavior, old, ref = around_logp(1.5, float("nan")), around_logp(0.3, float("inf")), around_logp(1.0, -float("inf"))
    per_row = torch.randn(rows, generator=gen)
    advantages = {"row": per_row, "row1": per_row.unsqueeze(-1), "token": torch.randn(lead, generator=gen)}[case["adv"]]
    row_index = torch.arange(per_row.numel()).reshape(*rows, 1).expand(lead)
    ids = (torch.arange(t) >= torch.randint(0, t + 1, (*rows, 1), generator=gen)).long()  # 0 then 1 in each row
    batched = dict(targets=targets, behavior_logprobs=behavior, advantages=advantages, mask=mask, old_logprobs=old,
                   sequence_ids=ids if case["seq"] == "packed" else None)
    global_ids = row_index * 2 + ids if case["seq"] == "packed" else row_index
    full_advantages = advantages if case["adv"] == "token" else per_row.unsqueeze(-1).expand(lead)
    flat = dict(targets=targets[counted], behavior_logprobs=behavior[counted], advantages=full_advantages[counted],
                mask=None if mask is None else mask[counted], old_logprobs=old[counted],
                sequence_ids=global_ids[counted])
    if case["kl"]:
        batched.update(ref_logprobs=ref, kl_coef=0.3)
        flat.update(ref_logprobs=ref[counted], kl_coef=0.3)
    return batched, flat, counted


def _assert_close(got, want, what, rel=1e-5):
    """|got - want| <= rel * max |want| elementwise (exact where want is all 0)."""
    atol = rel * want.abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=atol, msg=lambda m: f"{what}: {m}")


def _flat_reference_stats(logits, flat, loss_type, rho):
    """float64 log-probs and stat means over the counted tokens (flat logits (K, V))."""
    logp_all = torch.log_softmax(logits.double(), -1)
    logp = logp_all.gather(-1, flat["targets"].unsqueeze(-1)).squeeze(-1)
    count = max(logp.numel(), 1)
    log_ratio = logp - flat["behavior_logprobs"].double()
    r_old = torch.exp(logp - flat["old_logprobs"].double())
    a = flat["advantages"].double()
    means = dict(
        entropy=-torch.where(logp_all > float("-inf"), logp_all.exp() * logp_all, 0.0).sum(-1),
        mean_ratio=log_ratio.exp(),
        # aipo truncates r at rho, ppo_tis exp(old - b), ppo nothing
        truncated_fraction={"aipo": log_ratio.exp() > rho, "ppo": torch.zeros_like(logp, dtype=torch.bool),
                            "ppo_tis": torch.exp(flat["old_logprobs"].double() - flat["behavior_logprobs"].double())
                            > rho}[loss_type].double(),
        mismatch_kl=log_ratio.exp() - 1 - log_ratio,
        clip_fraction=None if loss_type == "aipo" else (torch.clamp(r_old, 0.8, 1.2) * a < r_old * a).double())
    if "ref_logprobs" in flat:
        x = flat["ref_logprobs"].double() - logp
        means["ref_kl"] = torch.exp(x) - x - 1
    return logp, {name: None if v is None else v.sum().item() / count for name, v in means.items()}


def _check_batched_stats(stats, counted, logits_flat, flat, loss_type, case):
    """stats.logprobs in the targets' shape, 0 where a token does not count; every
    mean over the counted tokens alone (NaN / inf in the padding change none)."""
    logp, means = _flat_reference_stats(logits_flat, flat, loss_type, rho=2.0)
    assert stats.logprobs.shape == counted.shape, case
    assert torch.count_nonzero(stats.logprobs.cpu()[~counted]) == 0, case
    _assert_close(stats.logprobs.cpu()[counted], logp, f"logprobs {case}", rel=1e-5)
    assert (stats.ref_kl is None) == ("ref_kl" not in means) and (stats.clip_fraction is None) == (loss_type == "aipo")
    for name, want in means.items():
        if want is not None:
            assert getattr(stats, name).item() == pytest.approx(want, rel=1e-5, abs=1e-6), (name, case)
    return means["clip_fraction"]


@pytest.mark.parametrize("device, loss_type", kernels_and_torch(LOSS_TYPES), indirect=["device"])
def test_batched_equals_flat_call_on_the_counted_tokens(device, loss_type):
    """aipo_loss on (B, T) (and (2, 3, T)) batches with per-row advantages, implied or
    packed sequences and garbage in the padding equals the float64 reference's flat
    call on the counted tokens alone, values and gradients; the padding gets
    dlogits exactly 0. The reference's own batched call agrees with its flat one."""
    clip_fractions = []
    for case in BATCHED_CASES:
        gen = torch.Generator().manual_seed(1000 + case["seed"])
        logits = torch.randn(*case["lead"], case["vocab"], generator=gen) * 2
        batched, flat_all, counted = _batched_inputs(case, logits)
        batched, flat = _without_old(batched, loss_type), _without_old(flat_all, loss_type)
        kw = _params(rho=2.0, temperature=1.0, loss_type=loss_type, reduction=case["reduction"])
        x = logits.to(device).clone().requires_grad_()
        on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batched.items()}
        loss, stats = aipo_loss(x, entropy=True, **on_device, **kw)
        loss.backward()
        xr = logits[counted].double().requires_grad_()
        expected = aipo_loss_ref(xr, **flat, **kw)
        expected.backward()
        xb = logits.double().requires_grad_()
        batched_ref = aipo_loss_ref(xb, **batched, **kw)
        batched_ref.backward()
        assert batched_ref.item() == pytest.approx(expected.item(), rel=1e-12, abs=1e-15), case
        _assert_close(xb.grad[counted], xr.grad, f"reference grad {case}", rel=1e-12)
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7), case
        grad = x.grad.cpu()
        _assert_close(grad[counted], xr.grad, f"dlogits {case}")
        assert torch.count_nonzero(grad[~counted]) == 0 and torch.count_nonzero(xb.grad[~counted]) == 0, case
        clip_fractions.append(_check_batched_stats(stats, counted, logits[counted], flat_all, loss_type, case))
    if loss_type != "aipo":  # the clip acted on some tokens and not on others
        assert 0 < sum(clip_fractions) / len(clip_fractions) < 1


@pytest.mark.parametrize("device, loss_type", kernels_and_torch(LOSS_TYPES), indirect=["device"])
def test_linear_variant_batched_equals_flat_call_on_the_counted_tokens(device, loss_type):
    """linear_aipo_loss on (B, T, H) hidden states, the same cases, several chunks:
    loss, hidden and weight gradients equal the float64 flat call on the counted
    tokens; the padding's hidden gradient is exactly 0."""
    for case in BATCHED_CASES[::2]:
        gen = torch.Generator().manual_seed(2000 + case["seed"])
        hidden = torch.randn(*case["lead"], 24, generator=gen)
        weight = torch.randn(case["vocab"], 24, generator=gen) / 4
        batched, flat, counted = _batched_inputs(case, hidden @ weight.t())
        batched, flat = _without_old(batched, loss_type), _without_old(flat, loss_type)
        kw = _params(rho=2.0, temperature=0.7, loss_type=loss_type, reduction=case["reduction"])
        hx, wx = hidden.to(device).clone().requires_grad_(), weight.to(device).clone().requires_grad_()
        on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batched.items()}
        loss, stats = linear_aipo_loss(hx, wx, chunk_size=5, **on_device, **kw)
        loss.backward()
        hr, wr = hidden[counted].double().requires_grad_(), weight.double().requires_grad_()
        expected = aipo_loss_ref(hr @ wr.t(), **flat, **kw)
        expected.backward()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7), case
        _assert_close(hx.grad.cpu()[counted], hr.grad, f"hidden grad {case}")
        assert torch.count_nonzero(hx.grad.cpu()[~counted]) == 0, case
        _assert_close(wx.grad.cpu(), wr.grad, f"weight grad {case}")
        assert stats.logprobs.shape == counted.shape and torch.count_nonzero(stats.logprobs.cpu()[~counted]) == 0


def test_batched_refusals_name_the_culprit():
    """Advantages of any other shape, a counted target out of range (named by its
    (b, t) position), sequence_ids of another shape, and flat sequence_mean
    without sequence_ids: ValueError naming it."""
    gen = torch.Generator().manual_seed(7)
    b, t, v = 3, 5, 11
    logits = torch.randn(b, t, v, generator=gen, requires_grad=True)
    targets = torch.randint(0, v, (b, t), generator=gen)
    behavior, mask = -torch.rand(b, t, generator=gen) * 3, torch.ones(b, t)
    hidden, weight = torch.randn(b, t, 8, generator=gen, requires_grad=True), torch.randn(v, 8, requires_grad=True)
    calls = [lambda tg, adv, **kw: aipo_loss(logits, tg, behavior, adv, mask, **kw),
             lambda tg, adv, **kw: linear_aipo_loss(hidden, weight, tg, behavior, adv, mask, **kw)]
    for call in calls:
        for bad in (torch.randn(b, t + 1), torch.randn(b + 1), torch.randn(t), torch.randn(b, 2), torch.randn(1, b),
                    torch.randn(b * t)):
            with pytest.raises(ValueError, match=rf"advantages must have shape \(3, 5\) .*\(3,\) or \(3, 1\).*got "
                                                 rf"{re.escape(str(tuple(bad.shape)))}"):
                call(targets, bad)
        for value in (-1, v, v + 7):
            bad_targets = targets.clone()
            bad_targets[1, 2] = value
            with pytest.raises(ValueError, match=rf"targets\[1, 2\] = {value} is outside \[0, 11\)"):
                call(bad_targets, torch.randn(b))
        for ids in (torch.zeros(b * t, dtype=torch.long), torch.zeros(b, t - 1, dtype=torch.long)):
            with pytest.raises(ValueError, match=rf"sequence_ids must have shape \(3, 5\).*got "
                                                 rf"{re.escape(str(tuple(ids.shape)))}"):
                call(targets, torch.randn(b), reduction="sequence_mean", sequence_ids=ids)
    with pytest.raises(ValueError, match=r"advantages must have shape \(15,\) \(the logits' leading dims\), got \(1,\)$"):
        aipo_loss(logits.reshape(b * t, v), targets.reshape(-1), behavior.reshape(-1), torch.randn(1))
    with pytest.raises(ValueError, match=r'sequence_mean" on flat inputs needs sequence_ids'):
        aipo_loss(logits.reshape(b * t, v), targets.reshape(-1), behavior.reshape(-1), torch.randn(b * t),
                  reduction="sequence_mean")
