"""Every objective of the policy loss (ops/objectives.py) on the fused log-prob op
(ops/logprob.py) against the float64 reference written from the formulas
(aipo_loss_ref): logits and linear forms, every reduction, entropy bonus, KL
penalty, normalizers, micro-batched accumulation, vocabulary-parallel shards
over gloo ranks, statistics, torch.compile, and the refusals."""

import datetime
import math

import pytest
import torch
import torch.distributed as dist

from helpers import run_processes
from llamarl_core.ops.aipo import IGNORE_INDEX, aipo_loss, aipo_loss_ref, linear_aipo_loss
from llamarl_core.ops.aipo_inputs import REDUCTIONS
from llamarl_core.ops.logprob import linear_token_logprobs, token_logprobs, token_logprobs_ref
from llamarl_core.ops.logprob_launch import logprob_backward, logprob_forward
from llamarl_core.ops.objectives import DEFAULTS, LOSS_TYPES, OLD_POLICY_TYPES

CUDA = torch.cuda.is_available()
B, T, V, H = 5, 11, 257, 24


@pytest.fixture(params=["triton-cuda" if CUDA else "triton-interpreter", "torch"])
def device(request, monkeypatch):
    """triton-*: the kernels (on CUDA, or on CPU tensors in Triton's interpreter);
    torch: the chunked CPU path."""
    if request.param == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        return torch.device("cpu")
    return torch.device("cuda" if CUDA else "cpu")


def _batch(seed, logits=None, spread=1.0):
    """A (B, T) batch: logits (B, T, V), targets, behaviour and old log-probs around
    the learner's (ratios inside and far outside every window: log-ratios of
    spread * N(0, 1.5), some at +-6), one advantage a row, a partial mask with
    one row masked entirely (an empty sequence) and ignored targets, and packed
    sequence ids (two sequences a row)."""
    gen = torch.Generator().manual_seed(seed)
    if logits is None:
        logits = torch.randn(B, T, V, generator=gen) * 2
    targets = torch.randint(0, logits.shape[-1], (B, T), generator=gen)
    with torch.no_grad():
        logp = torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None]).squeeze(-1).float()
    offsets = torch.randn(B, T, generator=gen) * 1.5 * spread
    offsets[0, :3] = torch.tensor([6.0, -6.0, 6.0])
    behavior = logp + offsets
    old = logp + torch.randn(B, T, generator=gen) * 0.3 * spread
    ref = logp + torch.randn(B, T, generator=gen) * 0.5
    advantages = torch.randn(B, generator=gen)
    mask = (torch.rand(B, T, generator=gen) > 0.25).float()
    mask[2] = 0.0  # a sequence with no token counted
    targets[3, 4] = IGNORE_INDEX
    sequence_ids = (torch.arange(T) >= T // 2).long().expand(B, T).clone()
    return dict(logits=logits, targets=targets, behavior_logprobs=behavior, advantages=advantages, mask=mask,
                old_logprobs=old, ref_logprobs=ref, sequence_ids=sequence_ids)


def _params(loss_type, extra):
    """Per-objective parameters off their defaults, so that each window acts on
    the batch (the GSPO paper's 3e-4 would clip every sequence here)."""
    chosen = dict(aipo=dict(rho=1.5), ppo_tis=dict(rho=1.5, eps_low=0.1, eps_high=0.3), ppo=dict(eps_low=0.1),
                  icepop=dict(mask_low=0.3, mask_high=3.0), seq_tis=dict(rho=1.5), seq_mis=dict(mask_low=0.05,
                                                                                             mask_high=20.0),
                  geo_mask=dict(rho=1.5, mask_low=0.5, mask_high=2.0), gspo=dict(eps_low=0.1, eps_high=0.15),
                  cispo=dict(eps_low=0.5, eps_high=0.5))[loss_type]
    return dict(loss_type=loss_type, temperature=0.8, **chosen, **extra)


EXTRAS = {
    "plain": {},
    "entropy+kl": dict(entropy_coef=0.05, kl_coef=0.2),
    "normalizer": dict(normalizer=13.0),
}


def _on(batch, device, *names):
    return {name: batch[name].to(device) for name in names}


INPUTS = ("targets", "behavior_logprobs", "advantages", "mask", "old_logprobs", "sequence_ids")


def _old(inputs, kw):
    """old_logprobs as a keyword for the objectives that read them (the others refuse them)."""
    return {"old_logprobs": inputs["old_logprobs"]} if kw["loss_type"] in OLD_POLICY_TYPES else {}


def _rel(got, want):
    return ((got.double().cpu() - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


def _leaf(t, dtype, device="cpu"):
    """A fresh leaf copy of t that takes gradients (never t itself)."""
    return t.detach().to(device, dtype).clone().requires_grad_()


def _reference(batch, kw, cast=torch.float64, compute_dtype=torch.float64, hidden=None, weight=None):
    """(loss, grads) of aipo_loss_ref: logits' grad, or hidden's and weight's."""
    refs = {"ref_logprobs": batch["ref_logprobs"]} if kw.get("kl_coef") else {}
    if hidden is None:
        x = _leaf(batch["logits"], cast)
        leaves, logits = [x], x
    else:
        h, w = _leaf(hidden, cast), _leaf(weight, cast)
        leaves, logits = [h, w], h @ w.t()
    loss = aipo_loss_ref(logits, *(batch[n] for n in INPUTS[:4]), **_old(batch, kw),
                         sequence_ids=batch["sequence_ids"], compute_dtype=compute_dtype, **refs, **kw)
    loss.backward()
    return loss, [leaf.grad for leaf in leaves]


def _assert_within_float32(loss, grads, batch, kw, want, want_grads, **linear):
    """Loss and gradients within 1e-5 (relative) of the float64 reference, or
    within twice the error of the naive float32 torch loss where float32 itself
    is not that close (a sequence's exp(s_i) amplifies log-prob rounding; a sum
    of terms of both signs cancels)."""
    naive, naive_grads = _reference(batch, kw, cast=torch.float32, compute_dtype=None, **linear)
    loss_tol = max(1e-5 * abs(want.item()), 2 * abs(naive.item() - want.item())) + 1e-7
    assert abs(loss.item() - want.item()) <= loss_tol, (loss.item(), want.item(), naive.item())
    for got, ref, plain in zip(grads, want_grads, naive_grads):
        assert _rel(got, ref) <= max(1e-5, 2 * _rel(plain, ref)), (_rel(got, ref), _rel(plain, ref))


def _ours(batch, kw, device, dtype=torch.float32, hidden=None, weight=None, chunk_size=None):
    refs = {"ref_logprobs": batch["ref_logprobs"].to(device)} if kw.get("kl_coef") else {}
    inputs = _on(batch, device, *INPUTS)
    if hidden is None:
        x = _leaf(batch["logits"], dtype, device)
        loss, stats = aipo_loss(x, *(inputs[n] for n in INPUTS[:4]), **_old(inputs, kw),
                                sequence_ids=inputs["sequence_ids"], **refs, **kw)
        leaves = [x]
    else:
        h, w = _leaf(hidden, dtype, device), _leaf(weight, dtype, device)
        loss, stats = linear_aipo_loss(h, w, *(inputs[n] for n in INPUTS[:4]), **_old(inputs, kw),
                                       sequence_ids=inputs["sequence_ids"], chunk_size=chunk_size, **refs, **kw)
        leaves = [h, w]
    loss.backward()
    return loss, [leaf.grad for leaf in leaves], stats


# ----------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("extra", EXTRAS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_objective_matches_the_float64_reference(device, loss_type, reduction, extra):
    batch = _batch(LOSS_TYPES.index(loss_type) * 10 + REDUCTIONS.index(reduction))
    kw = _params(loss_type, dict(reduction=reduction, **EXTRAS[extra]))
    loss, (grad,), stats = _ours(batch, kw, device)
    want, (want_grad,) = _reference(batch, kw)
    _assert_within_float32(loss, [grad], batch, kw, want, [want_grad])
    assert torch.count_nonzero(grad[2]) == 0  # the masked row
    assert abs(want.item()) > 0 and torch.count_nonzero(want_grad) > 0  # the case tests something


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_objective_linear_form_matches_the_float64_reference(device, loss_type):
    """Hidden and weight gradients, chunks of 7 tokens (several a sequence) and one
    chunk; token-local objectives take the three-GEMM path, sequence-level ones the
    generic op."""
    gen = torch.Generator().manual_seed(77)
    hidden, weight = torch.randn(B, T, H, generator=gen), torch.randn(V, H, generator=gen) / 4
    batch = _batch(7 + LOSS_TYPES.index(loss_type), logits=hidden @ weight.t())
    kw = _params(loss_type, dict(reduction="sequence_mean", entropy_coef=0.05, kl_coef=0.2,
                                 normalizer=torch.tensor(3.0)))
    want, (want_h, want_w) = _reference(batch, kw, hidden=hidden, weight=weight)
    for chunk_size in (7, None):
        loss, grads, _ = _ours(batch, kw, device, hidden=hidden, weight=weight, chunk_size=chunk_size)
        _assert_within_float32(loss, grads, batch, kw, want, [want_h, want_w], hidden=hidden, weight=weight)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_bf16_within_twice_the_error_of_plain_torch_bf16(device, loss_type):
    """bf16 logits (and bf16 hidden / weight): the error against float64 within
    twice that of the naive bf16 torch loss (+ a floor for tiny errors)."""
    gen = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(B, T, H, generator=gen), torch.randn(V, H, generator=gen) / 4
    batch = _batch(50 + LOSS_TYPES.index(loss_type), logits=(hidden @ weight.t()).bfloat16().float(),
                   spread=0.3)
    kw = _params(loss_type, dict(entropy_coef=0.05))
    want, (want_grad,) = _reference(batch, kw)
    naive, (naive_grad,) = _reference(batch, kw, cast=torch.bfloat16, compute_dtype=None)
    loss, (grad,), _ = _ours(batch, kw, device, dtype=torch.bfloat16)
    assert grad.dtype == torch.bfloat16

    def err(value):
        return abs(value.item() - want.item()) / abs(want.item())

    assert err(loss) <= 2 * err(naive) + 1e-5, (err(loss), err(naive))
    assert _rel(grad, want_grad) <= 2 * _rel(naive_grad, want_grad) + 1e-5
    hb, wb = hidden.bfloat16(), weight.bfloat16()
    want_l, (want_h, want_w) = _reference(batch, kw, hidden=hb, weight=wb)
    naive_l, (naive_h, naive_w) = _reference(batch, kw, cast=torch.bfloat16, compute_dtype=None, hidden=hb,
                                             weight=wb)
    loss_l, (grad_h, grad_w), _ = _ours(batch, kw, device, dtype=torch.bfloat16, hidden=hb, weight=wb,
                                        chunk_size=16)
    assert grad_h.dtype == torch.bfloat16 and grad_w.dtype == torch.bfloat16
    assert abs(loss_l.item() - want_l.item()) <= 2 * abs(naive_l.item() - want_l.item()) + 1e-5 * abs(want_l.item())
    assert _rel(grad_h, want_h) <= 2 * _rel(naive_h, want_h) + 1e-5
    assert _rel(grad_w, want_w) <= 2 * _rel(naive_w, want_w) + 1e-5


def test_ratios_far_outside_every_window_stay_finite(device):
    """Log-ratios of +-60 against the behaviour (exp(60) = 1e26, its square past
    float32) and of +100 against the old policy, one of them on a row whose
    advantage is 0 (inf * 0 would be NaN): every objective's loss, gradient and
    stats finite, and equal to the reference (ratios clamped at exp(80))."""
    batch = _batch(3, spread=40.0)
    batch["old_logprobs"][1, 0] -= 100.0
    batch["old_logprobs"][3, 1] -= 100.0
    batch["advantages"][1] = 0.0
    for loss_type in LOSS_TYPES:
        kw = _params(loss_type, {})
        loss, (grad,), stats = _ours(batch, kw, device)
        want, (want_grad,) = _reference(batch, kw)
        assert math.isfinite(loss.item()) and torch.isfinite(grad).all(), loss_type
        _assert_within_float32(loss, [grad], batch, kw, want, [want_grad])
        assert math.isfinite(stats.mismatch_kl.item()) and math.isfinite(stats.mean_abs_log_ratio.item())


def test_the_entropy_gradient_of_the_op_matches_float64(device):
    """token_logprobs' backward for any dL/dlogp and dL/dH, logits and linear form,
    with -inf columns and an ignored token."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 9, 97, generator=gen) * 3
    logits[..., 5::7] = float("-inf")
    targets = torch.randint(0, 97, (2, 9), generator=gen)
    targets[targets % 7 == 5] -= 1
    targets[1, 3] = IGNORE_INDEX
    g_logp, g_ent = torch.randn(2, 9, generator=gen), torch.randn(2, 9, generator=gen)
    x = _leaf(logits, torch.float32, device)
    logp, ent = token_logprobs(x, targets.to(device), temperature=0.7, entropy=True)
    ((logp * g_logp.to(device)).sum() + (ent * g_ent.to(device)).sum()).backward()
    xr = _leaf(logits, torch.float64)
    logp_r, ent_r = token_logprobs_ref(xr, targets, temperature=0.7)
    ((logp_r * g_logp).sum() + (ent_r * g_ent).sum()).backward()
    assert _rel(logp, logp_r) <= 1e-5 and _rel(ent, ent_r) <= 1e-5 and _rel(x.grad, xr.grad) <= 1e-5
    assert torch.count_nonzero(x.grad[..., 5::7]) == 0
    hidden, weight = torch.randn(18, H, generator=gen), torch.randn(97, H, generator=gen) / 3
    h, w = _leaf(hidden, torch.float32, device), _leaf(weight, torch.float32, device)
    logp, ent = linear_token_logprobs(h, w, targets.reshape(-1).to(device), entropy=True, chunk_size=5)
    ((logp * g_logp.reshape(-1).to(device)).sum() + (ent * g_ent.reshape(-1).to(device)).sum()).backward()
    hr, wr = _leaf(hidden, torch.float64), _leaf(weight, torch.float64)
    logp_r, ent_r = token_logprobs_ref(hr @ wr.t(), targets.reshape(-1))
    ((logp_r * g_logp.reshape(-1)).sum() + (ent_r * g_ent.reshape(-1)).sum()).backward()
    assert _rel(h.grad, hr.grad) <= 1e-5 and _rel(w.grad, wr.grad) <= 1e-5


def test_a_target_outside_the_vocabulary_gets_a_nan_log_prob_where_the_check_cannot_wait(device):
    """The kernels alone (what runs under graph capture or torch.compile, where the
    host-side check does nothing): NaN, never a quiet read elsewhere."""
    logits = torch.randn(4, 33, device=device)
    targets = torch.tensor([3, 33, -7, IGNORE_INDEX], device=device)
    _, logp, _ = logprob_forward(logits, targets, 1.0, False)
    assert math.isfinite(logp[0].item()) and math.isnan(logp[1].item()) and math.isnan(logp[2].item())
    assert logp[3].item() == 0.0
    dlogits = logprob_backward(logits, targets, torch.logsumexp(logits, -1), torch.ones(4, device=device), 1.0)
    assert torch.isfinite(dlogits).all()


# ----------------------------------------------------------------------------- normalizers


@pytest.mark.parametrize("loss_type", ["aipo", "icepop", "cispo", "seq_mis", "gspo"])
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_micro_batches_with_the_global_normalizer_add_up_to_the_whole_batch(loss_type, reduction):
    """Three micro-batches (rows 0-1, 2, 3-4), each divided by the whole batch's
    count (tokens, or sequences with a counted token), accumulate the gradient of
    the whole-batch loss, and that equals the float64 reference's; logits and
    linear form."""
    gen = torch.Generator().manual_seed(31)
    hidden, weight = torch.randn(B, T, H, generator=gen), torch.randn(V, H, generator=gen) / 4
    batch = _batch(31, logits=hidden @ weight.t())
    counted = (batch["mask"] != 0) & (batch["targets"] != IGNORE_INDEX)
    if reduction == "token_mean":
        normalizer = counted.sum().float()
    else:  # sequences with a counted token: (row, id) pairs
        normalizer = torch.tensor(float(sum(len(set(batch["sequence_ids"][r][counted[r]].tolist()))
                                            for r in range(B))))
    kw = _params(loss_type, dict(reduction=reduction, entropy_coef=0.05))
    whole, (whole_grad,) = _reference(batch, kw)
    x = batch["logits"].clone().requires_grad_()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    total = total_linear = 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 5)):
        part = {name: value[rows] for name, value in batch.items()}
        loss, _ = aipo_loss(x[rows], *(part[n] for n in INPUTS[:4]), **_old(part, kw),
                            sequence_ids=part["sequence_ids"], normalizer=normalizer, **kw)
        loss.backward()
        total += loss.item()
        loss_l, _ = linear_aipo_loss(h[rows], w, *(part[n] for n in INPUTS[:4]), **_old(part, kw),
                                     sequence_ids=part["sequence_ids"], normalizer=normalizer, chunk_size=8, **kw)
        loss_l.backward()
        total_linear += loss_l.item()
    assert total == pytest.approx(whole.item(), rel=1e-5) and total_linear == pytest.approx(whole.item(), rel=1e-5)
    assert _rel(x.grad, whole_grad) <= 1e-5
    want_l, (want_h, want_w) = _reference(batch, kw, hidden=hidden, weight=weight)
    assert _rel(h.grad, want_h) <= 1e-5 and _rel(w.grad, want_w) <= 1e-5


def test_dr_grpo_constant_normalizer():
    """A constant normalizer (Dr.GRPO: samples x max tokens) divides the summed loss."""
    batch = _batch(8)
    kw = _params("aipo", {})
    summed, _ = aipo_loss(batch["logits"], *(batch[n] for n in INPUTS[:4]), reduction="sum", **kw)
    scaled, _ = aipo_loss(batch["logits"], *(batch[n] for n in INPUTS[:4]), normalizer=B * T, **kw)
    assert scaled.item() == pytest.approx(summed.item() / (B * T), rel=1e-6)


# ----------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_stats_are_their_definitions(loss_type):
    """Every statistic against its definition in float64 on the counted tokens."""
    batch = _batch(60 + LOSS_TYPES.index(loss_type))
    kw = _params(loss_type, dict(entropy_coef=0.01))
    _, _, stats = _ours(batch, kw, torch.device("cpu"))
    counted = (batch["mask"] != 0) & (batch["targets"] != IGNORE_INDEX)
    logp_all = torch.log_softmax(batch["logits"].double() / 0.8, -1)
    logp = logp_all.gather(-1, batch["targets"].clamp(min=0)[..., None]).squeeze(-1)
    log_r = (logp - batch["behavior_logprobs"].double())[counted]
    r = log_r.exp()
    entropy = -(logp_all.exp() * logp_all).sum(-1)[counted]
    want = dict(mean_ratio=r.mean(), mismatch_kl=(r - 1 - log_r).mean(), mismatch_k1=(-log_r).mean(),
                chi_squared=(r * r).mean() - 1, ess_fraction=r.sum() ** 2 / (len(r) * (r * r).sum()),
                mean_abs_log_ratio=log_r.abs().mean(), max_abs_log_ratio=log_r.abs().max(), entropy=entropy.mean())
    for name, value in want.items():
        assert getattr(stats, name).item() == pytest.approx(value.item(), rel=1e-4, abs=1e-6), name
    # Which tokens / sequences each window acted on, from the formulas.
    params = {**DEFAULTS[loss_type], **{k: v for k, v in kw.items() if k in DEFAULTS[loss_type]}}
    seq_key = torch.arange(B)[:, None] * 2 + batch["sequence_ids"]
    on = counted.double()

    def per_seq(values):
        return torch.zeros(2 * B, dtype=torch.float64).index_add(0, seq_key.reshape(-1), (values * on).reshape(-1))

    full_log_r = logp - batch["behavior_logprobs"].double()
    s = per_seq(full_log_r)
    n = per_seq(torch.ones_like(on))
    truncated = masked = clipped = None
    if loss_type == "aipo":
        truncated = full_log_r.exp() > params["rho"]
    elif loss_type == "ppo_tis":
        truncated = (batch["old_logprobs"].double() - batch["behavior_logprobs"].double()).exp() > params["rho"]
    elif loss_type == "icepop":
        masked = (full_log_r.exp() < params["mask_low"]) | (full_log_r.exp() > params["mask_high"])
    elif loss_type == "seq_tis":
        truncated = (s.exp() > params["rho"])[seq_key]
    elif loss_type == "seq_mis":
        masked = ((s.exp() < params["mask_low"]) | (s.exp() > params["mask_high"]))[seq_key]
    elif loss_type == "geo_mask":
        geo = (s / n.clamp(min=1)).exp()
        masked = ((geo < params["mask_low"]) | (geo > params["mask_high"]))[seq_key]
        truncated = full_log_r.exp() > params["rho"]
    if loss_type in OLD_POLICY_TYPES:
        a = batch["advantages"].double()[:, None].expand(B, T)
        q = (logp - batch["old_logprobs"].double()).exp()
        if loss_type == "gspo":
            q = (per_seq(logp - batch["old_logprobs"].double()) / n.clamp(min=1)).exp()[seq_key]
        low, high = 1 - params["eps_low"], 1 + params["eps_high"]
        clipped = (q < low) | (q > high) if loss_type == "cispo" else q.clamp(low, high) * a < q * a
    for name, flags in (("truncated_fraction", truncated), ("masked_fraction", masked),
                        ("clip_fraction", clipped)):
        got = getattr(stats, name)
        if flags is None:
            assert got is None or got.item() == 0.0, name
        else:
            assert got.item() == pytest.approx(flags[counted].double().mean().item(), abs=1e-6), name
    present = n > 0
    for name, flags in (("sequence_truncated_fraction", truncated), ("sequence_masked_fraction", masked)):
        expected = 0.0 if flags is None else ((per_seq(flags.double()) > 0) & present).sum() / present.sum()
        assert getattr(stats, name).item() == pytest.approx(float(expected), abs=1e-6), name
    assert stats.clip_fraction is None or (loss_type in OLD_POLICY_TYPES)


# ----------------------------------------------------------------------------- refusals


def test_refusals_name_the_culprit():
    batch = _batch(1)
    args = (batch["logits"], *(batch[n] for n in INPUTS[:4]))
    with pytest.raises(ValueError, match=r'loss_type="icepop" does not read rho \(it reads mask_low, mask_high\)'):
        aipo_loss(*args, loss_type="icepop", rho=2.0)
    with pytest.raises(ValueError, match=r'loss_type="ppo" does not read mask_high'):
        aipo_loss(*args, loss_type="ppo", old_logprobs=batch["old_logprobs"], mask_high=2.0)
    with pytest.raises(ValueError, match=r'loss_type="gspo" needs old_logprobs'):
        aipo_loss(*args, loss_type="gspo")
    with pytest.raises(ValueError, match=r'loss_type="icepop" does not read old_logprobs'):
        aipo_loss(*args, loss_type="icepop", old_logprobs=batch["old_logprobs"])
    with pytest.raises(ValueError, match=r"mask_low and mask_high must satisfy"):
        aipo_loss(*args, loss_type="icepop", mask_low=2.0, mask_high=1.0)
    with pytest.raises(ValueError, match=r"eps_low must be <= 1"):
        aipo_loss(*args, loss_type="cispo", old_logprobs=batch["old_logprobs"], eps_low=1.5)
    with pytest.raises(ValueError, match=r"entropy_coef must be finite and >= 0"):
        aipo_loss(*args, entropy_coef=-0.1)
    for bad in (0, -3.0, float("nan"), "12", True):
        with pytest.raises(ValueError, match=r"normalizer must be"):
            aipo_loss(*args, normalizer=bad)
    with pytest.raises(ValueError, match=r"normalizer must be a number or a one-element tensor"):
        aipo_loss(*args, normalizer=torch.ones(2))
    flat = [t.reshape(-1) for t in (batch["targets"], batch["behavior_logprobs"], batch["mask"])]
    with pytest.raises(ValueError, match=r'loss_type="seq_tis" on flat inputs needs sequence_ids'):
        aipo_loss(batch["logits"].reshape(-1, V), flat[0], flat[1], torch.zeros(B * T), flat[2], loss_type="seq_tis")
    with pytest.raises(ValueError, match=r"targets must be integer token ids"):
        token_logprobs(batch["logits"], batch["targets"].float())


# ----------------------------------------------------------------------------- torch.compile


def test_the_op_and_an_objective_of_yours_compile_whole():
    """token_logprobs (custom ops inside) and an objective of your own in one graph
    (fullgraph=True: no break anywhere); forward and backward equal eager's."""
    batch = _batch(12)

    def loss_fn(logits, targets, behavior, advantages):
        logp, entropy = token_logprobs(logits, targets, temperature=0.8, entropy=True)
        w = torch.exp(logp.detach() - behavior).clamp(max=2.0)
        return (-(w * advantages[:, None] * logp) - 0.01 * entropy).mean()

    args = [batch[n] for n in ("targets", "behavior_logprobs", "advantages")]
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    x, y = batch["logits"].clone().requires_grad_(), batch["logits"].clone().requires_grad_()
    compiled(x, *args).backward()
    eager = loss_fn(y, *args)
    eager.backward()
    assert torch.equal(x.grad, y.grad)


# ----------------------------------------------------------------------------- vocabulary-parallel


def _vocab_parallel_rank(rank, world, port):
    """Rank `rank` of `world` gloo ranks: the sharded op (logits and linear form)
    against the whole-vocabulary op on the same inputs, its shard of the
    gradients compared; returns the worst relative error. The Store is the
    parent's, so no rank's exit takes it away from a rank still tearing down."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        gen = torch.Generator().manual_seed(4)
        vocab = 64
        hidden, weight = torch.randn(B, T, H, generator=gen), torch.randn(vocab, H, generator=gen) / 3
        batch = _batch(4, logits=hidden @ weight.t())
        batch["logits"][..., 7::9] = float("-inf")
        shard = slice(rank * vocab // world, (rank + 1) * vocab // world)
        worst = 0.0
        for loss_type in ("aipo", "gspo", "icepop"):
            kw = _params(loss_type, dict(entropy_coef=0.05, kl_coef=0.1, entropy=True))
            whole, (grad,), stats = _ours(batch, kw, torch.device("cpu"))
            sharded_batch = {**batch, "logits": batch["logits"][..., shard].contiguous()}
            part, (part_grad,), part_stats = _ours(sharded_batch, {**kw, "process_group": dist.group.WORLD},
                                                   torch.device("cpu"))
            worst = max(worst, abs(part.item() - whole.item()) / abs(whole.item()), _rel(part_grad, grad[..., shard]),
                        abs(part_stats.entropy.item() - stats.entropy.item()) / stats.entropy.item())
            whole_l, (gh, gw), _ = _ours(batch, kw, torch.device("cpu"), hidden=hidden, weight=weight, chunk_size=8)
            part_l, (ph, pw), _ = _ours(batch, {**kw, "process_group": dist.group.WORLD}, torch.device("cpu"),
                                        hidden=hidden, weight=weight[shard].contiguous(), chunk_size=8)
            worst = max(worst, abs(part_l.item() - whole_l.item()) / abs(whole_l.item()), _rel(ph, gh),
                        _rel(pw, gw[shard]))
        logp, _ = token_logprobs(batch["logits"][..., shard].contiguous(), batch["targets"],
                                 process_group=dist.group.WORLD)
        want, _ = token_logprobs_ref(batch["logits"], batch["targets"])
        worst = max(worst, _rel(logp, want))
        # Shards of unequal sizes: refused on every rank (none left waiting), before any kernel.
        uneven = batch["logits"][..., : vocab // world + (rank == 0)].contiguous()
        try:
            token_logprobs(uneven, batch["targets"], process_group=dist.group.WORLD)
            refused = False
        except ValueError as error:
            refused = "one size on every rank" in str(error)
        dist.barrier()  # every rank done with its sends before any tears the group down
        return worst if refused else float("inf")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_vocabulary_parallel_equals_the_single_rank_op(world, monkeypatch):
    """Logits (and lm-head rows) sharded over the vocabulary on `world` gloo ranks:
    loss, entropy and every gradient equal the single-rank op's."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the spawned ranks read it: the torch path, whole-vocabulary and sharded
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    errors = run_processes([(_vocab_parallel_rank, dict(rank=r, world=world, port=store.port)) for r in range(world)],
                           timeout=120)
    assert max(errors) <= 1e-5, errors


@pytest.mark.gpu
def test_the_op_and_an_objective_capture_into_a_cuda_graph():
    """Forward and backward of token_logprobs and a loss on it captured into one
    CUDA graph (no host sync anywhere: a sync would fail the capture), replayed
    on new inputs copied into the static ones: loss and gradient equal eager's."""
    static = {k: v.cuda() for k, v in _batch(13).items()}
    x = static["logits"].clone().requires_grad_()

    def step():
        logp, entropy = token_logprobs(x, static["targets"], temperature=0.8, entropy=True)
        w = torch.exp(logp.detach() - static["behavior_logprobs"]).clamp(max=2.0)
        loss = (-(w * static["advantages"][:, None] * logp) - 0.01 * entropy).mean()
        loss.backward()
        return loss

    side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graphs prescribes
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    x.grad = None
    with torch.cuda.graph(graph):
        loss = step()
    fresh = _batch(14)
    with torch.no_grad():
        x.copy_(fresh["logits"].cuda())
        for name in ("targets", "behavior_logprobs", "advantages"):
            static[name].copy_(fresh[name].cuda())
    graph.replay()
    torch.cuda.synchronize()
    y = fresh["logits"].cuda().requires_grad_()
    logp, entropy = token_logprobs(y, static["targets"], temperature=0.8, entropy=True)
    w = torch.exp(logp.detach() - static["behavior_logprobs"]).clamp(max=2.0)
    eager = (-(w * static["advantages"][:, None] * logp) - 0.01 * entropy).mean()
    eager.backward()
    assert torch.equal(loss, eager.detach()) and torch.equal(x.grad, y.grad)
