"""The objective kernel (kernels/objective.py, ops/objective_launch.py) computes
what the torch path computes (ops/objectives.py: objective_terms,
objective_stats): the loss, its gradients in the log-probs and the entropies,
and every AIPOStats figure, for every objective and option, on fresh random
inputs, in Triton's interpreter (aipo_loss takes the kernel on a GPU only; the
torch path meets the float64 references in test_objectives.py, the kernel on a
GPU in its gpu test)."""

import dataclasses
import zlib

import pytest
import torch

from llamarl_core.ops.aipo import torch_policy_loss
from llamarl_core.ops.aipo_inputs import prepare_inputs
from llamarl_core.ops.objective_launch import fused_policy_loss
from llamarl_core.ops.objectives import LOSS_TYPES, OLD_POLICY_TYPES, SEQUENCE_TYPES, Objective

# What each case gives besides the log-probs: behaviour (not "on-policy", not "old only"), old (the objectives that
# read it, not "on-policy"), reference log-probs (with the penalty, or for the statistics alone), the bonus.
OPTIONS = {"plain": {}, "kl and entropy bonus": {"kl_coef": 0.1, "entropy_coef": 0.02}, "on-policy": {},
           "reference for the statistics": {}, "old only": {}}
# geo_mask's default window (0.999, 1.001) masks nearly every sequence of these random cases: a wider one too
WINDOWS = {"geo_mask": {"mask_low": 0.8, "mask_high": 1.25}}


def _inputs(gen, loss_type, option, shape, flat_sequences):
    """(per-token log-probs, entropies, checked TokenInputs, config) of one case:
    behaviour / old log-probs near the learner's, a fifth of the tokens masked
    and the others weighted, with flat_sequences flat tokens in sequences of
    random ids."""
    logp = -torch.rand(shape, generator=gen) * 3
    entropy = torch.rand(shape, generator=gen) * 2
    on_policy = option == "on-policy"
    behavior = None if on_policy or option == "old only" else logp + torch.randn(shape, generator=gen) * 0.4
    old = logp + torch.randn(shape, generator=gen) * 0.2 if loss_type in OLD_POLICY_TYPES and not on_policy else None
    kw = {**OPTIONS[option], **WINDOWS.get(loss_type, {})}
    with_ref = kw.get("kl_coef") or option == "reference for the statistics"
    ref = logp + torch.randn(shape, generator=gen) * 0.3 if with_ref else None
    advantages = torch.randn(shape if flat_sequences else shape[:-1], generator=gen)
    # a fifth of the tokens masked, the others weighted 0.25 to 1.75 (a mask's value weighs a token's statistics)
    mask = (torch.rand(shape, generator=gen) > 0.2) * (0.25 + 1.5 * torch.rand(shape, generator=gen))
    sequence_ids = torch.randint(0, 7, shape, generator=gen) if flat_sequences else None
    reduction = "sequence_mean" if flat_sequences or loss_type == "gspo" else "token_mean"
    cfg = Objective(loss_type, **kw)
    inputs = prepare_inputs(torch.Size(shape), torch.device("cpu"), torch.zeros(shape, dtype=torch.int64), behavior,
                            advantages, mask, old, ref, sequence_ids, cfg, reduction, None, "raise")
    return logp, entropy, inputs, cfg


def _run(fn, logp, entropy, inputs, cfg):
    logp, entropy = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    loss, stats = fn(logp, entropy, inputs, cfg)
    loss.backward()
    return loss.detach(), logp.grad, entropy.grad, stats


def _assert_same(kernel, torch_path, what):
    for name, a, b in [("loss", kernel[0], torch_path[0]), ("dlogp", kernel[1], torch_path[1]),
                       ("dentropy", kernel[2], torch_path[2])] + [
            (f.name, getattr(kernel[3], f.name), getattr(torch_path[3], f.name)) for f in dataclasses.fields(kernel[3])]:
        if a is None or b is None:
            assert a is None and b is None, (what, name, a, b)
            continue
        scale = max(1.0, b.double().abs().max().item()) if b.numel() else 1.0
        assert a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=0, atol=2e-6 * scale), (what, name, a, b)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_kernel_computes_what_the_torch_path_computes(loss_type, option):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{loss_type} {option}".encode()))
    cases = [((5, 11), False), ((130,), True)]  # batched rows; flat tokens in sequences (sequence_mean)
    for shape, flat in cases:
        if loss_type in SEQUENCE_TYPES and len(shape) == 1 and not flat:
            continue
        case = _inputs(gen, loss_type, option, shape, flat)
        _assert_same(_run(fused_policy_loss, *case), _run(torch_policy_loss, *case), (loss_type, option, shape))


def test_many_programs_nothing_counted_and_no_tokens():
    """Tokens over three of the kernel's programs (their partial sums and maxima
    combined); a batch whose every token is masked (the means 0, not NaN); none."""
    gen = torch.Generator().manual_seed(5)
    for loss_type in ("aipo", "gspo", "geo_mask"):
        case = _inputs(gen, loss_type, "plain", (3, 900), False)
        _assert_same(_run(fused_policy_loss, *case), _run(torch_policy_loss, *case), (loss_type, "3 programs"))
        logp, entropy, inputs, cfg = case
        nothing = dataclasses.replace(inputs, mask=torch.zeros_like(inputs.mask),
                                      weights=torch.zeros_like(inputs.weights))
        kernel = _run(fused_policy_loss, logp, entropy, nothing, cfg)
        _assert_same(kernel, _run(torch_policy_loss, logp, entropy, nothing, cfg), (loss_type, "nothing counted"))
        assert kernel[0].item() == 0 and not kernel[1].any() and torch.isfinite(kernel[3].mean_ratio)
    empty = _inputs(gen, "aipo", "plain", (0, 4), False)
    _assert_same(_run(fused_policy_loss, *empty), _run(torch_policy_loss, *empty), ("aipo", "no tokens"))


def test_the_kernels_path_compiles_whole():
    """The kernel sits behind a custom op (llamarl::objective): the loss and its
    statistics trace into one graph (fullgraph=True), forward and backward equal
    eager's."""
    gen = torch.Generator().manual_seed(9)
    logp, entropy, inputs, cfg = _inputs(gen, "ppo", "kl and entropy bonus", (4, 16), False)

    def loss_and_ratio(logp, entropy):
        loss, stats = fused_policy_loss(logp, entropy, inputs, cfg)
        return loss, stats.mean_ratio

    compiled = torch.compile(loss_and_ratio, fullgraph=True, backend="aot_eager")
    runs = []
    for fn in (compiled, loss_and_ratio):
        x, h = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
        loss, ratio = fn(x, h)
        loss.backward()
        runs.append((loss.detach(), ratio, x.grad, h.grad))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_nan_and_infinite_log_probs_and_ratios_at_the_clamp(loss_type):
    """What the torch path does with a counted NaN log-prob (a NaN logit row), a
    counted -inf one and log-ratios at MAX_LOG_RATIO and beyond: the kernel does
    too (its min and max keep NaN, as torch's)."""
    gen = torch.Generator().manual_seed(zlib.crc32(loss_type.encode()))
    logp, entropy, inputs, cfg = _inputs(gen, loss_type, "plain", (3, 8), False)
    counted = inputs.mask.reshape(logp.shape) != 0
    first = [tuple(i) for i in counted.nonzero()[:5].tolist()]
    logp[first[0]] = float("nan")
    logp[first[1]] = float("-inf")
    for (row, col), log_ratio in zip(first[2:], (80.0, 81.0, 79.0)):
        logp[row, col] = -1.0
        flat = row * logp.shape[1] + col
        for given in (inputs.behavior, inputs.old):
            if given is not None:
                given[flat] = -1.0 - log_ratio
    kernel, torch_path = _run(fused_policy_loss, logp, entropy, inputs, cfg), _run(torch_policy_loss, logp, entropy,
                                                                                   inputs, cfg)
    # A token that does not count gets no gradient (aipo_inputs' rule); the torch path's torch.where lets a NaN
    # sequence weight leak into it (0 * NaN in the backward), the kernel does not: compared on counted tokens.
    assert not kernel[1][~counted].any()
    for name, a, b in [("loss", kernel[0], torch_path[0]), ("dlogp", kernel[1][counted], torch_path[1][counted])] + [
            (f.name, getattr(kernel[3], f.name), getattr(torch_path[3], f.name)) for f in dataclasses.fields(kernel[3])]:
        if a is None or b is None:
            assert a is None and b is None, name
            continue
        assert torch.equal(a.isnan(), b.isnan()), (loss_type, name, a, b)
        finite = ~a.isnan()
        scale = max(1.0, b[finite].double().abs().max().item()) if finite.any() else 1.0
        assert torch.allclose(a[finite].double(), b[finite].double(), rtol=1e-6, atol=2e-6 * scale), (name, a, b)
