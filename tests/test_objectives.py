"""Every objective of the policy loss (ops/objectives.py) on the fused log-prob op
(ops/logprob.py) against the float64 reference written from the formulas
(aipo_loss_ref): logits and linear forms, every reduction, entropy bonus, KL
penalty, normalizers, micro-batched accumulation, vocabulary-parallel shards
over gloo ranks, statistics, torch.compile, and the refusals."""

import datetime
import math
import os
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from helpers import run_processes
from llamarl_core.ops.aipo import IGNORE_INDEX, aipo_loss, aipo_loss_ref, linear_aipo_loss
from llamarl_core.ops.aipo_inputs import REDUCTIONS, prepare_inputs, sequence_index
from llamarl_core.ops.logprob import linear_token_logprobs, token_logprobs, token_logprobs_ref
from llamarl_core.ops.logprob_launch import logprob_backward, logprob_forward
from llamarl_core.ops.objectives import (CLIP_TYPES, DEFAULTS, LOSS_TYPES, OLD_POLICY_TYPES, Objective, objective_stats,
                                         objective_terms)

CUDA = torch.cuda.is_available()
B, T, V, H = 5, 11, 257, 24
TEMPERATURE = 0.8  # the objectives' (_params)
# Fresh inputs every run (STYLE.md): one seed a run, from os.urandom unless
# LLAMARL_TEST_SEED gives it; each case draws from it and its own name, and a
# failure's message names it (REPRO) so that the run can be repeated exactly.
RUN_SEED = int(os.environ.get("LLAMARL_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
REPRO = f"reproduce with LLAMARL_TEST_SEED={RUN_SEED}"


def _seed(*case) -> int:
    """This run's seed for one case (a test's name and parameters)."""
    return (RUN_SEED + zlib.crc32(repr(case).encode())) % 2**31


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
    the learner's at TEMPERATURE (ratios inside and far outside every window:
    log-ratios of spread * N(0, 1.5), some at +-6; row 1's first sequence at
    ratio 1), one advantage a row, a partial mask with one row masked entirely
    (an empty sequence) and ignored targets, and packed sequence ids (two
    sequences a row)."""
    gen = torch.Generator().manual_seed(seed)
    if logits is None:
        logits = torch.randn(B, T, V, generator=gen) * 2
    targets = torch.randint(0, logits.shape[-1], (B, T), generator=gen)
    with torch.no_grad():
        logp = torch.log_softmax(logits.double() / TEMPERATURE, -1).gather(-1, targets[..., None]).squeeze(-1).float()
    offsets = torch.randn(B, T, generator=gen) * 1.5 * spread
    offsets[0, :3] = torch.tensor([6.0, -6.0, 6.0])
    # Log-probabilities, so at most 0 (the loss refuses more).
    behavior = (logp + offsets).clamp(max=0.0)
    old = (logp + torch.randn(B, T, generator=gen) * 0.3 * spread).clamp(max=0.0)
    ref = (logp + torch.randn(B, T, generator=gen) * 0.5).clamp(max=0.0)
    advantages = torch.randn(B, generator=gen)
    mask = (torch.rand(B, T, generator=gen) > 0.25).float()
    mask[2] = 0.0  # a sequence with no token counted
    targets[3, 4] = IGNORE_INDEX
    # One sequence on-policy (ratios 1, inside every window), counted whole: whatever
    # the draw, no objective masks or clips everything away.
    behavior[1, : T // 2], old[1, : T // 2], mask[1, : T // 2] = logp[1, : T // 2], logp[1, : T // 2], 1.0
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
                  cispo=dict(eps_low=0.5, eps_high=0.5), sapo=dict(tau_pos=0.8, tau_neg=1.6),
                  vespo=dict(k_pos=1.5, lambda_pos=2.5, k_neg=2.5, lambda_neg=1.2))[loss_type]
    return dict(loss_type=loss_type, temperature=TEMPERATURE, **chosen, **extra)


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


@torch.no_grad()
def _magnitude(batch, kw, hidden=None, weight=None) -> float:
    """The float64 reference's reduction of every token's |term|: the scale of
    the loss's rounding error."""
    refs = {"ref_logprobs": batch["ref_logprobs"]} if kw.get("kl_coef") else {}
    logits = batch["logits"].double() if hidden is None else hidden.double() @ weight.double().t()
    return aipo_loss_ref(logits, *(batch[n] for n in INPUTS[:4]), **_old(batch, kw),
                         sequence_ids=batch["sequence_ids"], magnitude=True, **refs, **kw).item()


@dataclass
class Expected:
    """What a case's results are held to: the float64 reference's loss and
    gradients, the naive float32 loss's (torch in float32, compute_dtype=None)
    and the sum of the loss's terms' magnitudes."""

    loss: torch.Tensor
    grads: list
    naive: torch.Tensor
    naive_grads: list
    magnitude: float


_EXPECTED: dict = {}


def _expected(batch, kw, key=None, **linear) -> Expected:
    """The case's Expected; with `key` (the case's seed and parameters) computed
    once a run, for both device paths of a parametrized test."""
    if key is not None and key in _EXPECTED:
        return _EXPECTED[key]
    want, want_grads = _reference(batch, kw, **linear)
    naive, naive_grads = _reference(batch, kw, cast=torch.float32, compute_dtype=None, **linear)
    expected = Expected(want, want_grads, naive, naive_grads, _magnitude(batch, kw, **linear))
    if key is not None:
        _EXPECTED[key] = expected
    return expected


def _assert_within_float32(loss, grads, expected: Expected):
    """Loss and gradients within 1e-5 (relative) of the float64 reference, or
    within twice the error of the naive float32 torch loss where float32 itself
    is not that close (a sequence's exp(s_i) amplifies log-prob rounding); the
    loss also within 1e-5 of the sum of its terms' magnitudes, where terms of
    both signs cancel: float32 rounds each term (a weight exp(s_i) by the
    rounding of the sequence's every log-prob, seen at 1.2e-6 of it), and a
    single draw of the naive loss's error may be smaller by luck. A wrong term
    would be off by about its own size, that sum over the tokens."""
    want, naive = expected.loss.item(), expected.naive.item()
    loss_tol = max(1e-5 * abs(want), 2 * abs(naive - want), 1e-5 * expected.magnitude) + 1e-7
    assert abs(loss.item() - want) <= loss_tol, (loss.item(), want, naive, REPRO)
    for got, ref, plain in zip(grads, expected.grads, expected.naive_grads):
        assert _rel(got, ref) <= max(1e-5, 2 * _rel(plain, ref)), (_rel(got, ref), _rel(plain, ref), REPRO)


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
    key = ("every", loss_type, reduction, extra)
    batch = _batch(_seed(*key))
    kw = _params(loss_type, dict(reduction=reduction, **EXTRAS[extra]))
    loss, (grad,), stats = _ours(batch, kw, device)
    expected = _expected(batch, kw, key)
    _assert_within_float32(loss, [grad], expected)
    assert torch.count_nonzero(grad[2]) == 0, REPRO  # the masked row
    # The case tests something.
    assert abs(expected.loss.item()) > 0 and torch.count_nonzero(expected.grads[0]) > 0, REPRO


# The linear form's cases: every reduction, and entropy bonus, KL penalty and
# normalizer each on and off, for every objective, without the full product; the
# chunk sizes (7 tokens: several chunks a sequence; None: one chunk) alternate.
LINEAR_CASES = {
    "token_mean": (dict(reduction="token_mean"), (7,)),
    "token_mean+entropy": (dict(reduction="token_mean", entropy_coef=0.05), (None,)),
    "sum+kl+normalizer": (dict(reduction="sum", kl_coef=0.2, normalizer=13.0), (7,)),
    "sequence_mean+entropy+kl+normalizer": (dict(reduction="sequence_mean", entropy_coef=0.05, kl_coef=0.2,
                                                 normalizer=torch.tensor(3.0)), (7, None)),
}


@pytest.mark.parametrize("case", LINEAR_CASES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_objective_linear_form_matches_the_float64_reference(device, loss_type, case):
    """Loss and the hidden and weight gradients; token-local objectives take the
    three-GEMM path, sequence-level ones the generic op."""
    extra, chunk_sizes = LINEAR_CASES[case]
    gen = torch.Generator().manual_seed(_seed("linear", loss_type, case))
    hidden, weight = torch.randn(B, T, H, generator=gen), torch.randn(V, H, generator=gen) / 4
    batch = _batch(_seed("linear batch", loss_type, case), logits=hidden @ weight.t())
    kw = _params(loss_type, extra)
    expected = _expected(batch, kw, ("linear", loss_type, case), hidden=hidden, weight=weight)
    # The case tests something.
    assert abs(expected.loss.item()) > 0 and torch.count_nonzero(expected.grads[1]) > 0, REPRO
    for chunk_size in chunk_sizes:
        loss, grads, _ = _ours(batch, kw, device, hidden=hidden, weight=weight, chunk_size=chunk_size)
        _assert_within_float32(loss, grads, expected)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_bf16_within_twice_the_error_of_plain_torch_bf16(device, loss_type):
    """bf16 logits (and bf16 hidden / weight): the error against float64 within
    twice that of the naive bf16 torch loss (+ a floor for tiny errors)."""
    gen = torch.Generator().manual_seed(_seed("bf16", loss_type))
    # Hidden states in {-1, 0, 1} and weights in {-3/8, ..., 3/8}: every logit a
    # multiple of 1/8 below 9 in size, exact in bf16, so that the bf16 GEMM's
    # rounding (which every bf16 implementation has, blocked its own way, and a
    # sequence's ratio amplifies) decides nothing here: the loss's own does.
    hidden = torch.randint(-1, 2, (B, T, H), generator=gen).float()
    weight = torch.randint(-3, 4, (V, H), generator=gen).float() / 8
    assert torch.equal((hidden.bfloat16() @ weight.bfloat16().t()).float(), hidden @ weight.t())
    batch = _batch(_seed("bf16 batch", loss_type), logits=hidden @ weight.t(), spread=0.3)
    kw = _params(loss_type, dict(entropy_coef=0.05))
    want, (want_grad,) = _reference(batch, kw)
    naive, (naive_grad,) = _reference(batch, kw, cast=torch.bfloat16, compute_dtype=None)
    loss, (grad,), _ = _ours(batch, kw, device, dtype=torch.bfloat16)
    assert grad.dtype == torch.bfloat16

    def err(value):
        return abs(value.item() - want.item()) / abs(want.item())

    assert err(loss) <= 2 * err(naive) + 1e-5, (err(loss), err(naive), REPRO)
    assert _rel(grad, want_grad) <= 2 * _rel(naive_grad, want_grad) + 1e-5, REPRO
    hb, wb = hidden.bfloat16(), weight.bfloat16()
    want_l, (want_h, want_w) = _reference(batch, kw, hidden=hb, weight=wb)
    naive_l, (naive_h, naive_w) = _reference(batch, kw, cast=torch.bfloat16, compute_dtype=None, hidden=hb,
                                             weight=wb)
    loss_l, (grad_h, grad_w), _ = _ours(batch, kw, device, dtype=torch.bfloat16, hidden=hb, weight=wb,
                                        chunk_size=16)
    assert grad_h.dtype == torch.bfloat16 and grad_w.dtype == torch.bfloat16
    assert abs(loss_l.item() - want_l.item()) <= 2 * abs(naive_l.item() - want_l.item()) + 1e-5 * abs(want_l.item()), \
        REPRO
    assert _rel(grad_h, want_h) <= 2 * _rel(naive_h, want_h) + 1e-5, REPRO
    assert _rel(grad_w, want_w) <= 2 * _rel(naive_w, want_w) + 1e-5, REPRO


def test_ratios_far_outside_every_window_stay_finite(device):
    """Log-ratios of +-60 against the behaviour (exp(60) = 1e26, its square past
    float32) and of +100 against the old policy, one of them on a row whose
    advantage is 0 (inf * 0 would be NaN): every objective's loss, gradient and
    stats finite, and equal to the reference (ratios clamped at exp(80))."""
    batch = _batch(_seed("far"), spread=40.0)
    batch["old_logprobs"][1, 0] -= 100.0
    batch["old_logprobs"][3, 1] -= 100.0
    batch["advantages"][1] = 0.0
    for loss_type in LOSS_TYPES:
        kw = _params(loss_type, {})
        loss, (grad,), stats = _ours(batch, kw, device)
        assert math.isfinite(loss.item()) and torch.isfinite(grad).all(), (loss_type, REPRO)
        expected = _expected(batch, kw, ("far", loss_type))
        if loss_type == "vespo":
            # Its weight exp(lambda + k v - lambda e^v) turns the float32 rounding of a
            # sequence's log-ratio sum v (about 1e-6 here, any float32 code's) into a
            # relative error |k - lambda e^v| times larger: 60 at e^v = 25, where the
            # weight is e^-55. The draws of two float32 codes differ by luck there.
            assert abs(loss.item() - expected.loss.item()) <= 1e-3 * abs(expected.loss.item()) + 1e-7, REPRO
            assert _rel(grad, expected.grads[0]) <= 1e-3, (_rel(grad, expected.grads[0]), REPRO)
        else:
            _assert_within_float32(loss, [grad], expected)
        assert math.isfinite(stats.mismatch_kl.item()) and math.isfinite(stats.mean_abs_log_ratio.item()), REPRO


def test_the_entropy_gradient_of_the_op_matches_float64(device):
    """token_logprobs' backward for any dL/dlogp and dL/dH, logits and linear form,
    with -inf columns and an ignored token."""
    gen = torch.Generator().manual_seed(_seed("entropy gradient"))
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
    assert _rel(logp, logp_r) <= 1e-5 and _rel(ent, ent_r) <= 1e-5 and _rel(x.grad, xr.grad) <= 1e-5, REPRO
    assert torch.count_nonzero(x.grad[..., 5::7]) == 0
    hidden, weight = torch.randn(18, H, generator=gen), torch.randn(97, H, generator=gen) / 3
    h, w = _leaf(hidden, torch.float32, device), _leaf(weight, torch.float32, device)
    logp, ent = linear_token_logprobs(h, w, targets.reshape(-1).to(device), entropy=True, chunk_size=5)
    ((logp * g_logp.reshape(-1).to(device)).sum() + (ent * g_ent.reshape(-1).to(device)).sum()).backward()
    hr, wr = _leaf(hidden, torch.float64), _leaf(weight, torch.float64)
    logp_r, ent_r = token_logprobs_ref(hr @ wr.t(), targets.reshape(-1))
    ((logp_r * g_logp.reshape(-1)).sum() + (ent_r * g_ent.reshape(-1)).sum()).backward()
    assert _rel(h.grad, hr.grad) <= 1e-5 and _rel(w.grad, wr.grad) <= 1e-5, REPRO


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


MICRO_BATCHES = (slice(0, 2), slice(2, 3), slice(3, 5))  # row 2 has no token counted: an empty micro-batch


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_with_the_global_normalizer_add_up_to_the_whole_batch(loss_type, reduction, monkeypatch):
    """Three micro-batches, each divided by the whole batch's count (tokens, or
    sequences with a counted token; "sum": Dr.GRPO's constant, B x T),
    accumulate the whole-batch loss and gradient: exactly in float64 (the
    reference on each micro-batch within 1e-12 of the reference on the whole
    batch, the loss of its terms' magnitudes: the normalizer composes), and the
    op's, logits and linear form, within float32's error of it. Without a GPU the
    op runs in Triton's interpreter for the first objective of each reduction and
    on the torch path for the others: the kernels never see the objective."""
    if not CUDA and loss_type != LOSS_TYPES[0]:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(_seed("micro", loss_type, reduction))
    hidden, weight = torch.randn(B, T, H, generator=gen), torch.randn(V, H, generator=gen) / 4
    batch = _batch(_seed("micro batch", loss_type, reduction), logits=hidden @ weight.t())
    counted = (batch["mask"] != 0) & (batch["targets"] != IGNORE_INDEX)
    if reduction == "token_mean":
        normalizer = counted.sum().float()
    elif reduction == "sequence_mean":  # sequences with a counted token: (row, id) pairs
        normalizer = torch.tensor(float(sum(len(set(batch["sequence_ids"][r][counted[r]].tolist()))
                                            for r in range(B))))
    else:
        normalizer = float(B * T)
    kw = _params(loss_type, dict(reduction=reduction, entropy_coef=0.05))
    whole_kw = {**kw, "normalizer": normalizer} if reduction == "sum" else kw
    expected = _expected(batch, whole_kw)
    whole, (whole_grad,) = expected.loss, expected.grads
    x64 = _leaf(batch["logits"], torch.float64)
    x, h, w = (_leaf(t, torch.float32) for t in (batch["logits"], hidden, weight))
    total64 = total = total_linear = 0.0
    for rows in MICRO_BATCHES:
        part = {name: value[rows] for name, value in batch.items()}
        args = [part[n] for n in INPUTS[:4]]
        common = dict(**_old(part, kw), sequence_ids=part["sequence_ids"], normalizer=normalizer, **kw)
        loss64 = aipo_loss_ref(x64[rows], *args, **common)
        loss64.backward()
        total64 += loss64.item()
        loss, _ = aipo_loss(x[rows], *args, **common)
        loss.backward()
        total += loss.item()
        loss_l, _ = linear_aipo_loss(h[rows], w, *args, chunk_size=8, **common)
        loss_l.backward()
        total_linear += loss_l.item()
    assert abs(whole.item()) > 0, REPRO  # the case tests something
    assert abs(total64 - whole.item()) <= 1e-12 * expected.magnitude, (total64, whole.item(), REPRO)
    assert _rel(x64.grad, whole_grad) <= 1e-12, REPRO
    _assert_within_float32(torch.tensor(total), [x.grad], expected)
    _assert_within_float32(torch.tensor(total_linear), [h.grad, w.grad],
                           _expected(batch, whole_kw, hidden=hidden, weight=weight))


def test_dr_grpo_constant_normalizer():
    """A constant normalizer (Dr.GRPO: samples x max tokens) divides the summed
    loss (within 1e-6 of its terms' magnitudes: the two sums round apart)."""
    batch = _batch(_seed("dr grpo"))
    kw = _params("aipo", {})
    summed, _ = aipo_loss(batch["logits"], *(batch[n] for n in INPUTS[:4]), reduction="sum", **kw)
    scaled, _ = aipo_loss(batch["logits"], *(batch[n] for n in INPUTS[:4]), normalizer=B * T, **kw)
    magnitude = _magnitude(batch, {**kw, "normalizer": B * T})
    assert abs(scaled.item() - summed.item() / (B * T)) <= 1e-6 * magnitude, (scaled.item(), summed.item(), REPRO)


# ----------------------------------------------------------------------------- sequences


def test_sequences_are_grouped_on_the_device_as_torch_unique_groups_them():
    """Each token's sequence index equals torch.unique's inverse (flat: by id;
    batched: by (row, id)), ids of any sign and size; no token, no sequence.
    Everything between the inputs and the kernels, the grouping
    included, runs for every objective on the meta device, where any op that
    needs data on the host (torch.unique, nonzero, .item()) raises: none is left
    there to sync a GPU."""
    gen = torch.Generator().manual_seed(_seed("sequences"))
    ids = torch.randint(-3, 4, (4, 13), generator=gen) * 10**12
    flat = sequence_index(ids.reshape(-1), torch.Size((52,)), None, "cpu")
    _, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
    assert torch.equal(flat.index, inverse) and flat.count >= int(inverse.max()) + 1, REPRO
    batched = sequence_index(ids, ids.shape, None, "cpu")
    rows = torch.arange(4).repeat_interleave(13)
    _, inverse = torch.unique(torch.stack((rows, ids.reshape(-1)), 1), dim=0, return_inverse=True)
    assert torch.equal(batched.index, inverse) and batched.count >= int(inverse.max()) + 1, REPRO
    empty = sequence_index(torch.zeros(0, dtype=torch.long), torch.Size((0,)), None, "cpu")
    assert empty.index.numel() == 0 and empty.count == 0
    batch = {name: value.to("meta") for name, value in _batch(_seed("sequences batch")).items()}
    logp = torch.zeros(B * T, device="meta")
    for loss_type in LOSS_TYPES:
        for flat_inputs in (False, True):
            shape = torch.Size((B * T,) if flat_inputs else (B, T))
            per_token = {name: batch[name].reshape(shape) for name in (*INPUTS, "ref_logprobs") if name != "advantages"}
            advantages = batch["advantages"][:, None].expand(B, T).reshape(shape)
            cfg = Objective(loss_type, kl_coef=0.1, entropy_coef=0.01)
            inputs = prepare_inputs(shape, "meta", per_token["targets"], per_token["behavior_logprobs"], advantages,
                                    per_token["mask"], per_token["old_logprobs"] if loss_type in OLD_POLICY_TYPES
                                    else None, per_token["ref_logprobs"], per_token["sequence_ids"], cfg,
                                    "sequence_mean")
            terms = objective_terms(logp, logp, inputs.behavior, inputs.advantages, inputs.old, inputs.ref,
                                    inputs.counted, inputs.sequences, cfg)
            stats = objective_stats(logp, logp, inputs.behavior, inputs.mask, inputs.ref, inputs.sequences, terms,
                                    shape)
            assert terms.terms.shape == (B * T,) and stats.sequence_masked_fraction.device.type == "meta"


# ----------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_stats_are_their_definitions(loss_type):
    """Every statistic against its definition in float64 on the counted tokens."""
    batch = _batch(_seed("stats", loss_type))
    kw = _params(loss_type, dict(entropy_coef=0.01))
    _, _, stats = _ours(batch, kw, torch.device("cpu"))
    counted = (batch["mask"] != 0) & (batch["targets"] != IGNORE_INDEX)
    logp_all = torch.log_softmax(batch["logits"].double() / TEMPERATURE, -1)
    logp = logp_all.gather(-1, batch["targets"].clamp(min=0)[..., None]).squeeze(-1)
    log_r = (logp - batch["behavior_logprobs"].double())[counted]
    r = log_r.exp()
    entropy = -(logp_all.exp() * logp_all).sum(-1)[counted]
    want = dict(mean_ratio=r.mean(), mismatch_kl=(r - 1 - log_r).mean(), mismatch_k1=(-log_r).mean(),
                chi_squared=(r * r).mean() - 1, ess_fraction=r.sum() ** 2 / (len(r) * (r * r).sum()),
                mean_abs_log_ratio=log_r.abs().mean(), max_abs_log_ratio=log_r.abs().max(), entropy=entropy.mean())
    for name, value in want.items():
        assert getattr(stats, name).item() == pytest.approx(value.item(), rel=1e-4, abs=1e-6), (name, REPRO)
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
    if loss_type in CLIP_TYPES:
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
            assert got is None or got.item() == 0.0, (name, REPRO)
        else:
            assert got.item() == pytest.approx(flags[counted].double().mean().item(), abs=1e-6), (name, REPRO)
    present = n > 0
    for name, flags in (("sequence_truncated_fraction", truncated), ("sequence_masked_fraction", masked)):
        expected = 0.0 if flags is None else ((per_seq(flags.double()) > 0) & present).sum() / present.sum()
        assert getattr(stats, name).item() == pytest.approx(float(expected), abs=1e-6), (name, REPRO)
    assert (stats.clip_fraction is not None) == (loss_type in CLIP_TYPES)


# ----------------------------------------------------------------------------- refusals


def test_refusals_name_the_culprit():
    batch = _batch(1)
    args = (batch["logits"], *(batch[n] for n in INPUTS[:4]))
    with pytest.raises(ValueError, match=r'loss_type="icepop" does not read rho \(it reads mask_low, mask_high\)'):
        aipo_loss(*args, loss_type="icepop", rho=2.0)
    with pytest.raises(ValueError, match=r'loss_type="ppo" does not read mask_high'):
        aipo_loss(*args, loss_type="ppo", old_logprobs=batch["old_logprobs"], mask_high=2.0)
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
    batch = _batch(_seed("compile"))

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


VOCAB = 64  # the vocabulary-parallel test's


def _vocab_parallel_inputs(seed):
    """(batch, hidden, weight) of the vocabulary-parallel test: logits with -inf
    columns (masked vocabulary), no target on one."""
    gen = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(B, T, H, generator=gen), torch.randn(VOCAB, H, generator=gen) / 3
    batch = _batch(seed + 1, logits=hidden @ weight.t())
    batch["logits"][..., 7::9] = float("-inf")
    batch["targets"][batch["targets"] % 9 == 7] -= 1  # a target's column holds a finite logit
    return batch, hidden, weight


def _vocab_parallel_kw(loss_type):
    return _params(loss_type, dict(entropy_coef=0.05, kl_coef=0.1, entropy=True))


def _vocab_parallel_rank(rank, world, port, seed):
    """Rank `rank` of `world` gloo ranks: for every objective, the sharded op on
    this rank's shard of the vocabulary (logits and lm-head rows) of the inputs
    drawn from `seed` (the parent's: every rank's alike); returns, by objective,
    the loss, the entropy's mean and this rank's gradients (numpy), for the
    parent to compare with the whole-vocabulary op. The Store is the parent's,
    so no rank's exit takes it away from a rank still tearing down."""
    torch.set_num_threads(1)  # up to 4 ranks on 2 cores: a collective waits for the slowest rank to be scheduled
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        batch, hidden, weight = _vocab_parallel_inputs(seed)
        shard = slice(rank * VOCAB // world, (rank + 1) * VOCAB // world)
        sharded_batch = {**batch, "logits": batch["logits"][..., shard].contiguous()}
        out = {}
        for loss_type in LOSS_TYPES:
            kw = {**_vocab_parallel_kw(loss_type), "process_group": dist.group.WORLD}
            loss, (grad,), stats = _ours(sharded_batch, kw, torch.device("cpu"))
            loss_l, (grad_h, grad_w), _ = _ours(batch, kw, torch.device("cpu"), hidden=hidden,
                                                weight=weight[shard].contiguous(), chunk_size=8)
            out[loss_type] = dict(loss=loss.item(), entropy=stats.entropy.item(), grad=grad.numpy(),
                                  loss_l=loss_l.item(), grad_h=grad_h.numpy(), grad_w=grad_w.numpy())
        logp, _ = token_logprobs(sharded_batch["logits"], batch["targets"], process_group=dist.group.WORLD)
        out["token_logprobs"] = logp.numpy()
        # Shards of unequal sizes: refused on every rank (none left waiting), before any kernel.
        uneven = batch["logits"][..., : VOCAB // world + (rank == 0)].contiguous()
        try:
            token_logprobs(uneven, batch["targets"], process_group=dist.group.WORLD)
            out["unequal shards refused"] = False
        except ValueError as error:
            out["unequal shards refused"] = "one size on every rank" in str(error)
        dist.barrier()  # every rank done with its sends before any tears the group down
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_vocabulary_parallel_equals_the_single_rank_op(world, monkeypatch):
    """Logits (and lm-head rows) sharded over the vocabulary on `world` gloo ranks:
    for every objective, loss, entropy and every gradient equal the single-rank
    op's (computed here, once; a loss within 1e-5 of the sum of its terms'
    magnitudes: one whose terms cancel is only as accurate as that), and
    token_logprobs the float64 reference's; shards of unequal sizes refused on
    every rank."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the spawned ranks read it: the torch path, whole-vocabulary and sharded
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    seed = _seed("vocabulary parallel", world)
    ranks = run_processes([(_vocab_parallel_rank, dict(rank=r, world=world, port=store.port, seed=seed))
                           for r in range(world)], timeout=120)
    batch, hidden, weight = _vocab_parallel_inputs(seed)
    errors = {}
    for loss_type in LOSS_TYPES:
        kw = _vocab_parallel_kw(loss_type)
        reference_kw = {k: v for k, v in kw.items() if k != "entropy"}
        scale, scale_l = _magnitude(batch, reference_kw), _magnitude(batch, reference_kw, hidden, weight)
        whole, (grad,), stats = _ours(batch, kw, torch.device("cpu"))
        whole_l, (grad_h, grad_w), _ = _ours(batch, kw, torch.device("cpu"), hidden=hidden, weight=weight, chunk_size=8)
        for rank, out in enumerate(ranks):
            got, shard = out[loss_type], slice(rank * VOCAB // world, (rank + 1) * VOCAB // world)
            errors[rank, loss_type] = max(
                abs(got["loss"] - whole.item()) / scale, abs(got["loss_l"] - whole_l.item()) / scale_l,
                abs(got["entropy"] - stats.entropy.item()) / stats.entropy.item(),
                _rel(torch.from_numpy(got["grad"]), grad[..., shard]), _rel(torch.from_numpy(got["grad_h"]), grad_h),
                _rel(torch.from_numpy(got["grad_w"]), grad_w[shard]))
    want, _ = token_logprobs_ref(batch["logits"], batch["targets"])
    for rank, out in enumerate(ranks):
        errors[rank, "token_logprobs"] = _rel(torch.from_numpy(out["token_logprobs"]), want)
        errors[rank, "unequal shards refused"] = 0.0 if out["unequal shards refused"] else float("inf")
    bad = {key: error for key, error in errors.items() if not error <= 1e-5}
    assert not bad, (bad, REPRO)


@pytest.mark.gpu(seconds=6)
def test_every_objective_on_cuda_matches_the_float64_reference():
    """The compiled kernels on a GPU, the objective kernel among them (the CPU
    tests run them in Triton's interpreter): each objective once in the logits
    form (a reduction each, in turn, with the entropy bonus and KL penalty) and
    once in the linear form, loss and gradients against the float64 reference."""
    cuda = torch.device("cuda")
    for i, loss_type in enumerate(LOSS_TYPES):
        reduction = REDUCTIONS[i % len(REDUCTIONS)]
        key = ("cuda", loss_type, reduction)
        batch = _batch(_seed(*key))
        kw = _params(loss_type, dict(reduction=reduction, **EXTRAS["entropy+kl"]))
        loss, grads, _ = _ours(batch, kw, cuda)
        _assert_within_float32(loss.cpu(), [g.cpu() for g in grads], _expected(batch, kw, key))
        gen = torch.Generator().manual_seed(_seed("cuda linear", loss_type))
        hidden, weight = torch.randn(B, T, H, generator=gen), torch.randn(V, H, generator=gen) / 4
        batch = _batch(_seed("cuda linear batch", loss_type), logits=hidden @ weight.t())
        kw = _params(loss_type, dict(reduction="token_mean"))
        loss, grads, _ = _ours(batch, kw, cuda, hidden=hidden, weight=weight, chunk_size=7)
        _assert_within_float32(loss.cpu(), [g.cpu() for g in grads],
                               _expected(batch, kw, hidden=hidden, weight=weight))


@pytest.mark.gpu
def test_the_op_and_an_objective_capture_into_a_cuda_graph():
    """Forward and backward of token_logprobs and a loss on it captured into one
    CUDA graph (no host sync anywhere: a sync would fail the capture), replayed
    on new inputs copied into the static ones: loss and gradient equal eager's."""
    static = {k: v.cuda() for k, v in _batch(_seed("graph")).items()}
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
    fresh = _batch(_seed("graph replay"))
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


# ----------------------------------------------------------------------------- log-prob rules


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_log_probs_left_out_are_the_learners_own(loss_type):
    """behavior_logprobs=None, and old_logprobs=None where the objective reads
    them: on-policy, exactly the call given the learner's own log-probs (computed
    first, detached): loss, gradients and stats, from logits and from hidden
    states, and the float64 reference's the same way."""
    batch = _batch(5)
    hidden = torch.randn(*batch["logits"].shape[:2], 16, generator=torch.Generator().manual_seed(6))
    weight = torch.randn(batch["logits"].shape[-1], 16, generator=torch.Generator().manual_seed(7))
    kw = dict(loss_type=loss_type, sequence_ids=batch["sequence_ids"], mask=batch["mask"], temperature=TEMPERATURE)
    for make in ("logits", "linear", "reference"):
        results = []
        for given in (False, True):
            x = batch["logits"].clone().requires_grad_() if make != "linear" else hidden.clone().requires_grad_()
            logits = x if make != "linear" else x @ weight.t()
            own = token_logprobs_ref(logits.detach(), batch["targets"], temperature=TEMPERATURE)[0].float()
            logprobs = dict(behavior_logprobs=own if given else None)
            if loss_type in OLD_POLICY_TYPES:
                logprobs["old_logprobs"] = own if given else None
            if make == "reference":
                loss = aipo_loss_ref(x.double(), batch["targets"], advantages=batch["advantages"], **logprobs, **kw)
                stats = None
            elif make == "linear":
                loss, stats = linear_aipo_loss(x, weight, batch["targets"], advantages=batch["advantages"],
                                               **logprobs, **kw)
            else:
                loss, stats = aipo_loss(x, batch["targets"], advantages=batch["advantages"], **logprobs, **kw)
            loss.backward()
            results.append((loss.detach(), x.grad, stats))
        (loss, grad, stats), (expected, expected_grad, expected_stats) = results
        assert torch.allclose(loss.double(), expected.double(), rtol=1e-5, atol=1e-7), (make, loss, expected)
        assert torch.allclose(grad, expected_grad, rtol=1e-4, atol=1e-6 * float(expected_grad.abs().max())), make
        if stats is not None:
            assert stats.mean_ratio.item() == pytest.approx(1.0, abs=1e-5)
            assert stats.mean_ratio.item() == pytest.approx(expected_stats.mean_ratio.item(), abs=1e-5)


def _with_bad(batch: dict, name: str, value: float, where=(0, 1)) -> dict:
    bad = dict(batch)
    bad[name] = batch[name].clone()
    bad[name][where] = value
    return bad


@pytest.mark.parametrize("name", ["behavior_logprobs", "old_logprobs", "ref_logprobs"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_nonfinite_log_prob_is_refused_by_name_or_masked_as_asked(name, value):
    """A NaN / inf log-prob of a counted token: ValueError naming the argument and
    position (never a NaN loss); with nonfinite_logprobs="mask" the token leaves
    the loss exactly as mask 0 leaves it, gradients too. On a token that does
    not count it changes nothing either way."""
    batch = _batch(8)
    assert batch["mask"][0, 1] == 1 and batch["targets"][0, 1] != IGNORE_INDEX
    kw = dict(loss_type="ppo_tis", kl_coef=0.1, sequence_ids=batch["sequence_ids"], temperature=TEMPERATURE)
    args = lambda b: (b["targets"], b["behavior_logprobs"], b["advantages"], b["mask"])  # noqa: E731
    logprobs = lambda b: dict(old_logprobs=b["old_logprobs"], ref_logprobs=b["ref_logprobs"])  # noqa: E731
    bad = _with_bad(batch, name, value)
    for call in (lambda b, **extra: aipo_loss(b["logits"], *args(b), **logprobs(b), **kw, **extra),
                 lambda b, **extra: linear_aipo_loss(b["hidden"], b["weight"], *args(b), **logprobs(b), **kw, **extra)):
        for b in (batch, bad):
            gen = torch.Generator().manual_seed(9)
            b["hidden"] = torch.randn(*b["logits"].shape[:2], 16, generator=gen)
            b["weight"] = torch.randn(b["logits"].shape[-1], 16, generator=gen)
        with pytest.raises(ValueError, match=rf"{name}\[0, 1\] = {value} on a token that counts"):
            call(bad)
        masked, grads = [], []
        for b, extra in ((bad, dict(nonfinite_logprobs="mask")), (_with_bad(batch, "mask", 0.0), {})):
            x = b["logits"].clone().requires_grad_()
            loss, _ = aipo_loss(x, *args(b), **logprobs(b), **kw, **extra)
            loss.backward()
            masked.append(loss.detach())
            grads.append(x.grad)
        assert torch.isfinite(masked[0]) and torch.equal(masked[0], masked[1])
        assert torch.equal(grads[0], grads[1])
    uncounted = _with_bad(_with_bad(batch, "mask", 0.0), name, value)
    assert torch.equal(aipo_loss(uncounted["logits"], *args(uncounted), **logprobs(uncounted), **kw)[0],
                       aipo_loss(uncounted["logits"], *args(uncounted), **logprobs(uncounted), **kw,
                                 nonfinite_logprobs="mask")[0])


def test_a_bad_advantage_mask_or_sequence_id_is_refused_naming_it():
    """A counted token's advantage that is not finite, a mask value that is NaN,
    inf or negative (a weight, never a sign), float sequence_ids: ValueError
    naming the argument and position (never a NaN or sign-flipped loss). The
    same values where the token does not count (mask 0, IGNORE_INDEX target)
    change nothing."""
    batch = _batch(8)
    assert batch["mask"][0, 1] == 1 and batch["targets"][0, 1] != IGNORE_INDEX
    kw = dict(loss_type="ppo_tis", sequence_ids=batch["sequence_ids"], temperature=TEMPERATURE,
              old_logprobs=batch["old_logprobs"])

    def loss(b):
        return aipo_loss(b["logits"], b["targets"], b["behavior_logprobs"], b["advantages"], b["mask"], **kw)[0]

    assert batch["advantages"].shape == (batch["targets"].shape[0],)  # one a row: named by its row
    for value in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=rf"advantages\[0\] = {value}: an advantage must be finite"):
            loss(_with_bad(batch, "advantages", value, where=(0,)))
    per_token = dict(batch, advantages=batch["advantages"][:, None].expand_as(batch["mask"]).clone())
    with pytest.raises(ValueError, match=r"advantages\[0, 1\] = nan: an advantage must be finite"):
        loss(_with_bad(per_token, "advantages", float("nan")))
    for value in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match=rf"mask\[0, 1\] = {value}: a token's weight must be finite and >= 0"):
            loss(_with_bad(batch, "mask", value))
    masked_row = _with_bad(_with_bad(batch, "mask", 0.0, where=(2,)), "advantages", float("nan"), where=(2,))
    assert torch.equal(loss(masked_row), loss(batch))  # row 2 counts no token: its advantage is never read
    ignored = _with_bad(_with_bad(batch, "targets", IGNORE_INDEX), "mask", float("nan"))
    assert torch.equal(loss(ignored), loss(_with_bad(batch, "targets", IGNORE_INDEX)))
    with pytest.raises(ValueError, match=r"vocab >= 1, got shape \(4, 0\)"):
        aipo_loss(torch.zeros(4, 0), torch.zeros(4, dtype=torch.long), torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match="chunk_size must be a positive integer, got 2.5"):
        linear_aipo_loss(torch.randn(4, 8), torch.randn(5, 8), torch.zeros(4, dtype=torch.long), torch.zeros(4) - 1,
                         torch.zeros(4), chunk_size=2.5)
    with pytest.raises(ValueError, match="sequence_ids must be integer ids, got torch.float32"):
        aipo_loss(batch["logits"], batch["targets"], batch["behavior_logprobs"], batch["advantages"], batch["mask"],
                  **{**kw, "sequence_ids": batch["sequence_ids"].float() + 0.5})


def test_an_objective_parameter_that_is_not_a_number_is_refused_naming_it():
    """rho="4" or rho=True was read as 4.0 / 1.0 by float(): refused, as a
    normalizer that is a bool is."""
    from llamarl_core.ops.objectives import Objective

    for name, bad in (("rho", "4"), ("rho", True), ("temperature", "1.0"), ("kl_coef", "0.1")):
        with pytest.raises(ValueError, match=f"{name} must be a number, got"):
            Objective("aipo", **{name: bad})
    assert Objective("aipo", rho=4).rho == 4  # an int is a number


def test_probabilities_passed_as_log_probs_are_refused():
    """A counted log-prob above 1e-3 (a probability, say) raises naming the
    argument and position, whichever rule for non-finite values; 1e-4 above 0
    (rounding) and the same value on a token that does not count are taken."""
    batch = _batch(10)
    args = lambda b: (b["logits"], b["targets"], b["behavior_logprobs"], b["advantages"], b["mask"])  # noqa: E731
    for name in ("behavior_logprobs", "old_logprobs", "ref_logprobs"):
        bad = _with_bad(batch, name, 0.37, (3, 2))
        assert bad["mask"][3, 2] == 1 and bad["targets"][3, 2] != IGNORE_INDEX
        for rule in ("raise", "mask"):
            with pytest.raises(ValueError, match=rf"{name}\[3, 2\] = 0.37\d*: a log-probability is <= 0 "
                                                 r"\(probabilities passed as log-probs\?\)"):
                aipo_loss(*args(bad), loss_type="ppo", old_logprobs=bad["old_logprobs"],
                          ref_logprobs=bad["ref_logprobs"], kl_coef=0.1, nonfinite_logprobs=rule)
        rounded = _with_bad(batch, name, 1e-4, (3, 2))
        aipo_loss(*args(rounded), loss_type="ppo", old_logprobs=rounded["old_logprobs"],
                  ref_logprobs=rounded["ref_logprobs"], kl_coef=0.1)
        uncounted = _with_bad(_with_bad(batch, "mask", 0.0, (3, 2)), name, 0.37, (3, 2))
        aipo_loss(*args(uncounted), loss_type="ppo", old_logprobs=uncounted["old_logprobs"],
                  ref_logprobs=uncounted["ref_logprobs"], kl_coef=0.1)
    with pytest.raises(ValueError, match=r"nonfinite_logprobs must be one of \('raise', 'mask'\), got 'zero'"):
        aipo_loss(*args(batch), nonfinite_logprobs="zero")


def test_an_objective_value_computes_what_its_shorthand_does_and_refuses_both():
    """Objective, the frozen value: its defaults resolved (equal to the value with
    them given), hashable, unchangeable; every objective passed as `objective=` to
    aipo_loss, linear_aipo_loss and aipo_loss_ref gives, bit for bit, the loss and
    gradients of the same call with loss_type= and keywords, on fresh inputs; the
    two ways at once are refused naming what doubles."""
    import dataclasses

    assert Objective("aipo") == Objective("aipo", rho=4.0) and hash(Objective("aipo")) == hash(Objective(rho=4))
    assert Objective("ppo").parameters == {"eps_low": 0.2, "eps_high": 0.2} and Objective("ppo").rho is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        Objective().rho = 2.0
    with pytest.raises(ValueError, match='loss_type="ppo" does not read rho'):
        Objective("ppo", rho=2.0)
    with pytest.raises(ValueError, match="eps_low must be <= 1"):
        Objective("cispo", eps_low=1.5)
    batch = _batch(_seed("objective value"))
    hidden = torch.randn(B, T, H, generator=torch.Generator().manual_seed(_seed("objective value", "h")))
    weight = torch.randn(V, H, generator=torch.Generator().manual_seed(_seed("objective value", "w"))) * 0.3
    for loss_type in LOSS_TYPES:
        kw = _params(loss_type, EXTRAS["entropy+kl"])
        value = Objective(**kw)
        args = (*(batch[n] for n in INPUTS[:4]),)
        common = dict(**_old(batch, kw), sequence_ids=batch["sequence_ids"], ref_logprobs=batch["ref_logprobs"],
                      reduction="sequence_mean")
        for fn, leaves in ((aipo_loss, (batch["logits"],)), (linear_aipo_loss, (hidden, weight)),
                           (aipo_loss_ref, (batch["logits"],))):
            results = []
            for way in ({"objective": value}, kw):
                xs = [_leaf(x, torch.float32) for x in leaves]
                out = fn(*xs, *args, **common, **way)
                loss = out[0] if isinstance(out, tuple) else out
                loss.backward()
                results.append([loss.detach(), *(x.grad for x in xs)])
            assert all(torch.equal(a, b) for a, b in zip(*results)), (loss_type, fn.__name__, REPRO)
    with pytest.raises(ValueError, match=r"objective= and loss_type=, kl_coef=, rho= both describe"):
        aipo_loss(batch["logits"], *(batch[n] for n in INPUTS[:4]), objective=Objective(), loss_type="seq_tis",
                  rho=2.0, kl_coef=0.1)
    # A shorthand keyword given at its default value is given too: refused, never overridden in silence.
    with pytest.raises(ValueError, match=r"objective= and temperature= both describe"):
        linear_aipo_loss(hidden, weight, *(batch[n] for n in INPUTS[:4]), objective=Objective(temperature=0.7),
                         temperature=1.0)
    with pytest.raises(ValueError, match=r"objective= and loss_type= both describe"):
        aipo_loss_ref(batch["logits"], *(batch[n] for n in INPUTS[:4]), objective=Objective("ppo"), loss_type="aipo")
