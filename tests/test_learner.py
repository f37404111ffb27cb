"""The trainer: its start-up check that packed rows keep their samples apart,
train_step (micro-batches, KL penalty, clipping, truncation masking, autocast)
and the learning-rate schedule."""

import copy
import dataclasses
import datetime
import functools
import math

import pytest
import torch
import torch.distributed as dist
import transformers

from helpers import run_processes
from llamarl_core.ops.objectives import CLIP_TYPES, DEFAULTS, LOSS_TYPES, OLD_POLICY_TYPES
from llamarl_core.pipeline import learner
from llamarl_core.pipeline.rollout import Sample


def _model():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=50))


def test_installed_transformers_keeps_packed_samples_apart():
    learner.check_packed_rows_attend_within_samples(_model())


def test_check_fails_when_packed_samples_attend_to_each_other(monkeypatch):
    """Given an explicit all-ones attention mask, transformers no longer detects
    packing from the position ids (as versions before 4.53.1 never did): the
    samples of a row attend to each other, and the check must say so."""
    def unmasked_logits(model, input_ids, position_ids):
        return model(input_ids=input_ids, position_ids=position_ids, attention_mask=torch.ones_like(input_ids),
                     use_cache=False).logits[:, :-1]

    monkeypatch.setattr(learner, "_logits", unmasked_logits)
    with pytest.raises(RuntimeError, match=r"lets packed samples attend to each other .* transformers>=4\.56"):
        learner.check_packed_rows_attend_within_samples(_model())


def test_check_leaves_the_callers_random_stream_alone():
    """The trainer seeds, builds its model, then checks: what it draws next must
    not depend on the check."""
    torch.manual_seed(3)
    _model()
    expected = torch.rand(4)
    torch.manual_seed(3)
    learner.check_packed_rows_attend_within_samples(_model())
    assert torch.equal(torch.rand(4), expected)


# ----------------------------------------------------------------------------- train_step


@pytest.fixture
def torch_loss_path(monkeypatch):
    """The loss on its torch CPU path: test_aipo checks the Triton kernels against
    the same reference, and here their interpreter would take most of the time
    (the micro-batch test: 30 s in it, 2.5 s without). The KL test keeps the
    interpreter: the reference log-probs go through the kernel there."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


class _RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it steps on (train_step zeroes them after)."""

    def step(self, closure=None):
        self.grads = [p.grad.clone() for group in self.param_groups for p in group["params"]]
        return super().step(closure)


def _tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False))


def _samples(seed: int, num_groups: int = 4, per_group: int = 3) -> list[Sample]:
    """Random scored samples: prompts of 2-6 tokens shared by each group, 1-8
    completion tokens, behaviour log-probs around the tiny model's (about -2.8),
    about a third truncated (finished False)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(low, high, n=None):
        return torch.randint(low, high, (n,) if n else (), generator=gen)

    samples = []
    for group in range(num_groups):
        prompt = [1] + draw(3, 16, int(draw(1, 6))).tolist()
        for _ in range(per_group):
            n = int(draw(1, 9))
            logprobs = (-1 - 3 * torch.rand(n, generator=gen)).tolist()
            samples.append(Sample(group, prompt, draw(2, 16, n).tolist(), logprobs, [0] * n,
                                  finished=bool(torch.rand((), generator=gen) > 0.35),
                                  reward=float(torch.rand((), generator=gen))))
    return samples


PLAIN = dict(pad_token_id=0, temperature=0.9)
STEP = dict(PLAIN, rho=2.0)  # AIPO's


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-30)).item()


def _assert_grads_close(got: list[torch.Tensor], want: list[torch.Tensor], rel: float = 1e-5) -> None:
    errors = [_relative_error(g, w) for g, w in zip(got, want)]
    assert len(got) == len(want) and max(errors) <= rel, max(errors)


# Every StepStats figure that AIPOStats has too (ess_fraction is combined from mean_ratio and chi_squared).
STATS = ("mismatch_kl", "truncated_fraction", "mean_ratio", "clip_fraction", "entropy", "mismatch_k1", "chi_squared",
         "ess_fraction", "mean_abs_log_ratio", "max_abs_log_ratio", "masked_fraction", "sequence_truncated_fraction",
         "sequence_masked_fraction")


@pytest.mark.usefixtures("torch_loss_path")
@pytest.mark.parametrize("loss, parameters", [("aipo", dict(rho=2.0)),
                                              ("geo_mask", dict(rho=1.5, mask_low=0.7, mask_high=1.2)),
                                              ("gspo", {})])
def test_micro_batches_accumulate_the_whole_batch_gradient(loss, parameters):
    """Micro-batches of 1, 2 and 3 samples give the gradient, loss and stats of one
    batch, and those are policy_loss's token mean over the whole collated batch
    (the per-sequence fractions over its sequences, the maximum |log r| its
    maximum). Groups of 3 samples straddle micro-batches of 2: advantages centred
    per micro-batch would differ. lr 0 keeps the model as it is between the runs.
    geo_mask: tokens truncated and sequences masked, some not; gspo: the gradient
    through each sequence's ratio, and its own reduction, the sequence mean."""
    samples = _samples(1)
    model = _tiny_llama()
    batch = learner.collate(samples, 0)
    old = learner._reference_logprobs(model, batch, 0.9, None) if loss == "gspo" else None
    whole, stats = learner.policy_loss(model, batch, temperature=0.9, loss=loss, old_logprobs=old,
                                       reduction="sequence_mean" if loss == "gspo" else "token_mean", **parameters)
    whole.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    expected_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in expected])).item()
    if loss == "geo_mask":
        assert 0 < stats.truncated_fraction < 1 and 0 < stats.sequence_masked_fraction < 1, stats
    optimizer = _RecordingSGD(model.parameters(), lr=0.1)
    for size in (None, 1, 2, 3):
        step = learner.train_step(model, optimizer, samples, lr=0.0, micro_batch_size=size, loss=loss, **PLAIN,
                                  **parameters)
        _assert_grads_close(optimizer.grads, expected)
        assert step.loss == pytest.approx(whole.item(), rel=1e-5, abs=1e-7)  # the advantages' sum cancels: a small loss
        assert step.grad_norm == pytest.approx(expected_norm, rel=1e-5)
        for name in STATS:
            want = getattr(stats, name)
            if want is None:
                assert getattr(step, name) is None, (size, name)
            else:
                assert getattr(step, name) == pytest.approx(want.item(), rel=1e-5, abs=1e-6), (size, name)
        assert step.ref_kl is None and step.lr == 0.0
        assert step.truncated_samples == sum(not s.finished for s in samples)
        assert all(p.grad is None for p in model.parameters())  # zeroed after the step


@pytest.mark.usefixtures("torch_loss_path")
def test_step_sets_the_learning_rate_and_updates_by_it():
    samples = _samples(2)
    model = _tiny_llama()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = _RecordingSGD([{"params": list(model.parameters())[:3]}, {"params": list(model.parameters())[3:]}],
                              lr=0.1)
    step = learner.train_step(model, optimizer, samples, lr=0.25, micro_batch_size=4, **STEP)
    assert step.lr == 0.25 and [g["lr"] for g in optimizer.param_groups] == [0.25, 0.25]
    for p, p0, g in zip(model.parameters(), before, optimizer.grads):
        assert torch.allclose(p.detach(), p0 - 0.25 * g, rtol=0, atol=1e-7)


@pytest.mark.usefixtures("torch_loss_path")
def test_leftover_gradients_do_not_join_the_step():
    """The supervised warm-up leaves its last gradients behind."""
    samples = _samples(3)
    model = _tiny_llama()
    optimizer = _RecordingSGD(model.parameters(), lr=0.1)
    learner.train_step(model, optimizer, samples, lr=0.0, **STEP)
    clean = optimizer.grads
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    learner.train_step(model, optimizer, samples, lr=0.0, **STEP)
    _assert_grads_close(optimizer.grads, clean, rel=1e-6)


def test_kl_penalty_against_a_reference_copy():
    """reference_model = a copy of the model: ref_kl is 0 and the penalty adds no
    gradient (dk3 / dlogp = 0 at ref = logp); after a step has moved the model,
    ref_kl > 0 and the penalty changes the gradient. The reference stays as it was."""
    samples = _samples(4)
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    frozen = [p.detach().clone() for p in reference.parameters()]
    optimizer = _RecordingSGD(model.parameters(), lr=0.1)
    plain = learner.train_step(model, optimizer, samples, lr=0.0, **STEP)
    plain_grads = optimizer.grads
    first = learner.train_step(model, optimizer, samples, lr=2.0, micro_batch_size=5, kl_coef=0.5,
                               reference_model=reference, **STEP)
    assert abs(first.ref_kl) <= 1e-10
    assert first.loss == pytest.approx(plain.loss, rel=1e-5)
    _assert_grads_close(optimizer.grads, plain_grads)
    kl_step = learner.train_step(model, optimizer, samples, lr=0.0, kl_coef=0.5, reference_model=reference, **STEP)
    kl_grads = optimizer.grads
    no_kl_step = learner.train_step(model, optimizer, samples, lr=0.0, **STEP)
    assert kl_step.ref_kl > 1e-4 and no_kl_step.ref_kl is None
    assert kl_step.loss > no_kl_step.loss  # k3 >= 0, so the penalty only adds
    assert max(_relative_error(a, b) for a, b in zip(kl_grads, optimizer.grads)) > 1e-3
    assert all(torch.equal(p, p0) and p.grad is None for p, p0 in zip(reference.parameters(), frozen))


@pytest.mark.usefixtures("torch_loss_path")
def _plain_step(seed: int):
    """(samples, model, optimizer, StepStats, gradients) of one plain AIPO step at lr 0 on random samples."""
    samples = _samples(seed)
    model = _tiny_llama()
    optimizer = _RecordingSGD(model.parameters(), lr=0.1)
    stats = learner.train_step(model, optimizer, samples, lr=0.0, **STEP)
    return samples, model, optimizer, stats, optimizer.grads


def test_clipping_caps_the_norm_and_reports_the_norm_before():
    samples, model, optimizer, free, unclipped = _plain_step(5)
    assert free.grad_norm == pytest.approx(torch.linalg.vector_norm(torch.cat([g.flatten() for g in unclipped])).item(),
                                           rel=1e-5)
    cap = free.grad_norm / 4
    clipped = learner.train_step(model, optimizer, samples, lr=0.0, max_grad_norm=cap, **STEP)
    assert clipped.grad_norm == pytest.approx(free.grad_norm, rel=1e-6)
    assert torch.linalg.vector_norm(torch.cat([g.flatten() for g in optimizer.grads])).item() <= cap * (1 + 1e-5)
    _assert_grads_close(optimizer.grads, [g / 4 for g in unclipped])  # the direction kept
    learner.train_step(model, optimizer, samples, lr=0.0, max_grad_norm=free.grad_norm * 2, **STEP)
    _assert_grads_close(optimizer.grads, unclipped, rel=1e-6)  # under the cap: untouched


@pytest.mark.usefixtures("torch_loss_path")
def test_mask_truncated_drops_truncated_tokens_but_keeps_their_rewards():
    samples = _samples(6)
    truncated = [s for s in samples if not s.finished]
    assert 0 < len(truncated) < len(samples)
    plain, masked = learner.collate(samples, 0), learner.collate(samples, 0, mask_truncated=True)
    assert plain.truncated == masked.truncated == len(truncated)
    assert torch.equal(masked.advantages, plain.advantages)  # truncated rewards still in the group means
    kept = masked.targets != learner.IGNORE_INDEX
    assert int(kept.sum()) == sum(len(s.tokens) for s in samples if s.finished)
    assert torch.equal(masked.targets[kept], plain.targets[kept])

    # Other tokens and behaviour log-probs for the truncated samples (same lengths, so
    # the same packing): no effect on the step with mask_truncated, an effect without.
    gen = torch.Generator().manual_seed(7)
    changed = [copy.copy(s) for s in samples]
    for s in changed:
        if not s.finished:
            s.tokens = torch.randint(2, 16, (len(s.tokens),), generator=gen).tolist()
            s.logprobs = (-1 - 3 * torch.rand(len(s.tokens), generator=gen)).tolist()
    model = _tiny_llama()
    optimizer = _RecordingSGD(model.parameters(), lr=0.1)
    grads = {}
    for mask in (True, False):
        for name, batch in (("original", samples), ("changed", changed)):
            step = learner.train_step(model, optimizer, batch, lr=0.0, micro_batch_size=5, mask_truncated=mask, **STEP)
            assert step.truncated_samples == len(truncated)
            grads[mask, name] = optimizer.grads
    _assert_grads_close(grads[True, "changed"], grads[True, "original"], rel=1e-6)
    assert max(_relative_error(a, b) for a, b in zip(grads[False, "changed"], grads[False, "original"])) > 1e-3


@pytest.mark.usefixtures("torch_loss_path")
def test_a_nan_behaviour_logprob_raises_or_leaves_its_token_out():
    """A generator's NaN or inf log-prob on a counted token: train_step raises
    naming behavior_logprobs (nonfinite_logprobs="raise", the default), or with
    "mask" leaves that token out: the gradients are finite, the same for NaN and
    inf there, and differ from a step where that log-prob is finite (the token
    counts then)."""
    samples = _samples(4)
    model = _tiny_llama()
    optimizer = _RecordingSGD(model.parameters(), lr=0.1)
    poisoned = [copy.copy(s) for s in samples]
    poisoned[1].logprobs = [float("nan")] + list(poisoned[1].logprobs[1:])
    with pytest.raises(ValueError, match="behavior_logprobs"):
        learner.train_step(model, optimizer, poisoned, lr=0.0, **STEP)
    grads = []
    for first in (float("nan"), float("inf"), -0.5):
        poisoned[1].logprobs = [first] + list(samples[1].logprobs[1:])
        learner.train_step(model, optimizer, poisoned, lr=0.0, nonfinite_logprobs="mask", **STEP)
        grads.append(optimizer.grads)
    assert all(torch.isfinite(g).all() for g in grads[0])
    _assert_grads_close(grads[1], grads[0], rel=0)  # nan and inf: the same token left out
    assert max(_relative_error(a, b) for a, b in zip(grads[2], grads[0])) > 1e-6  # a finite one counts


@pytest.mark.usefixtures("torch_loss_path")
def test_a_step_where_no_token_counts_leaves_the_weights_alone():
    """Every sample truncated and masked: zero gradients, and AdamW (momentum from
    an earlier step, weight decay) must not step on them."""
    samples = _samples(8)
    model = _tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    first = learner.train_step(model, optimizer, samples, lr=1e-3, **STEP)  # momentum to move weights with
    assert first.counted_tokens == sum(len(s.tokens) for s in samples)
    before = [p.detach().clone() for p in model.parameters()]
    steps_taken = [optimizer.state[p]["step"].clone() for p in model.parameters()]
    truncated = [dataclasses.replace(s, finished=False) for s in samples]
    step = learner.train_step(model, optimizer, truncated, lr=1e-3, mask_truncated=True, **STEP)
    assert step.counted_tokens == 0 and step.grad_norm == 0.0 and step.truncated_samples == len(samples)
    assert all(torch.equal(p.detach(), p0) for p, p0 in zip(model.parameters(), before))
    assert all(torch.equal(optimizer.state[p]["step"], n) for p, n in zip(model.parameters(), steps_taken))
    assert all(p.grad is None for p in model.parameters())
    learner.train_step(model, optimizer, truncated, lr=1e-3, **STEP)  # unmasked, they count: it steps
    assert not all(torch.equal(p.detach(), p0) for p, p0 in zip(model.parameters(), before))


@pytest.mark.usefixtures("torch_loss_path")
def test_autocast_keeps_float32_masters():
    """bfloat16 autocast: the forward in bf16 (a loss near, not equal to, the float32
    one), the parameters and their gradients float32."""
    samples = _samples(8)
    model = _tiny_llama()
    optimizer = _RecordingSGD(model.parameters(), lr=0.1)
    full = learner.train_step(model, optimizer, samples, lr=0.0, **STEP)
    full_grads = optimizer.grads
    low = learner.train_step(model, optimizer, samples, lr=0.0, autocast_dtype=torch.bfloat16, **STEP)
    assert low.loss != full.loss and low.loss == pytest.approx(full.loss, rel=5e-2, abs=1e-2)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in optimizer.grads)
    assert max(_relative_error(a, b) for a, b in zip(optimizer.grads, full_grads)) < 0.2


@pytest.mark.parametrize("kwargs, match", [
    (dict(micro_batch_size=0), "micro_batch_size must be >= 1"),
    (dict(kl_coef=0.1), "kl_coef=0.1 needs reference_model"),
    (dict(kl_coef=-0.1), "kl_coef must be finite and >= 0"),
    (dict(max_grad_norm=0.0), "max_grad_norm must be > 0"),
    (dict(lr=-1.0), "lr must be finite and >= 0"),
    (dict(samples=[]), "no samples"),
    (dict(loss="ppo"), 'loss_type="ppo" does not read rho'),  # STEP's rho, AIPO's
    (dict(loss="aipo", eps_high=0.3), 'loss_type="aipo" does not read eps_high'),
    (dict(loss=lambda logp, batch: -logp), "a function of yours, is given .* reads none of rho"),
    (dict(loss="icepop", rho=None, mask_low=2.0, mask_high=1.0), "mask_low and mask_high must satisfy"),
    (dict(entropy_coef=-0.1), "entropy_coef must be finite and >= 0"),
])
def test_bad_train_step_arguments_raise_before_acting(kwargs, match):
    model = _tiny_llama()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    args = dict(samples=_samples(9), lr=0.1, **STEP) | kwargs
    with pytest.raises(ValueError, match=match):
        learner.train_step(model, optimizer, **args)
    assert all(torch.equal(p, p0) and p.grad is None for p, p0 in zip(model.parameters(), before))


# ----------------------------------------------------------------------------- every loss type


def _plain_policy_gradient(logprobs, batch):
    """-A logp: the gradient of ppo, gspo, cispo and sapo at ratio 1 (old log-probs the policy's own)."""
    return -batch.advantages * logprobs


@pytest.mark.usefixtures("torch_loss_path")
@pytest.mark.parametrize("loss", LOSS_TYPES)
def test_every_loss_type_trains_a_step_with_its_statistics(loss):
    """One real step of each built-in loss (micro-batches, the entropy bonus, an
    SGD update): finite loss and gradient norm, the weights moved, every
    statistic in its range and None exactly where the loss has no such thing.
    The losses that ignore the behaviour log-probs (ppo, gspo, cispo, sapo) take the
    plain policy gradient (with the same entropy bonus and reduction, a loss of
    yours) at ratio 1: their old log-probs are the policy's own."""
    samples = _samples(10)
    model = _tiny_llama()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = _RecordingSGD(model.parameters(), lr=0.1)
    step = learner.train_step(model, optimizer, samples, lr=0.1, micro_batch_size=5, loss=loss, entropy_coef=0.01,
                              **PLAIN)
    assert math.isfinite(step.loss) and math.isfinite(step.grad_norm) and step.grad_norm > 0, step
    assert any(not torch.equal(p.detach(), p0) for p, p0 in zip(model.parameters(), before))
    assert step.counted_tokens == sum(len(s.tokens) for s in samples) and step.ref_kl is None
    assert (step.clip_fraction is None) == (loss not in CLIP_TYPES)
    assert (step.masked_fraction is None) == (loss not in ("icepop", "seq_mis", "geo_mask"))
    fractions = ("truncated_fraction", "clip_fraction", "masked_fraction", "sequence_truncated_fraction",
                 "sequence_masked_fraction", "ess_fraction")
    assert all(0 <= getattr(step, name) <= 1 for name in fractions if getattr(step, name) is not None), step
    assert step.mismatch_kl > 0 and step.mean_ratio > 0 and step.chi_squared >= -1 and step.ess_fraction > 0, step
    assert 0 < step.mean_abs_log_ratio <= step.max_abs_log_ratio and step.mismatch_k1 <= step.mean_abs_log_ratio
    assert 0 < step.entropy <= math.log(16)  # the tiny model's vocabulary
    if loss in ("ppo", "gspo", "cispo", "sapo"):
        assert step.clip_fraction in (0.0, None)  # sapo has no clip: its gate at ratio 1 is the plain gradient
        fresh = _tiny_llama()  # the same weights as the model before its step
        plain = _RecordingSGD(fresh.parameters(), lr=0.1)
        learner.train_step(fresh, plain, samples, lr=0.0, micro_batch_size=5, loss=_plain_policy_gradient,
                           entropy_coef=0.01, reduction="sequence_mean" if loss == "gspo" else None, **PLAIN)
        _assert_grads_close(optimizer.grads, plain.grads, rel=1e-4)


def test_a_parameter_the_loss_does_not_read_is_refused_naming_both():
    """Set explicitly, a parameter the loss does not read would do nothing: the
    config (so the CLI, before any executor starts) and train_step refuse it,
    naming it and the loss; a loss of yours reads none of them."""
    from llamarl_core.pipeline import TrainConfig
    from llamarl_core.ops.objectives import PARAMETERS

    model = _tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for loss in LOSS_TYPES:
        reads = DEFAULTS[loss]
        assert TrainConfig(loss=loss, **reads).loss.parameters == {**dict.fromkeys(PARAMETERS), **reads}
        for name in set(PARAMETERS) - set(reads):
            match = f'loss_type="{loss}" does not read {name} \\(it reads {", ".join(reads)}\\)'
            with pytest.raises(ValueError, match=match):
                TrainConfig(loss=loss, **{name: 0.5})
            with pytest.raises(ValueError, match=match):
                learner.train_step(model, optimizer, _samples(9), lr=0.1, loss=loss, **PLAIN, **{name: 0.5})
    with pytest.raises(ValueError, match="'tests:mine', a function of yours, .* reads none of rho, mask_high"):
        TrainConfig(loss="tests:mine", rho=4.0, mask_high=2.0)
    assert TrainConfig().loss.rho is None  # aipo's 4.0 by default, ops.objectives.DEFAULTS


# ----------------------------------------------------------------------------- learning_rate


def test_warmup_then_constant():
    lr = functools.partial(learner.learning_rate, base_lr=1e-3, warmup_steps=4, total_steps=10, schedule="constant",
                           min_lr_ratio=0.1)
    assert [lr(s) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3], rel=1e-15)
    assert [lr(s) for s in (4, 9, 10, 1000)] == [1e-3] * 4


def test_warmup_then_cosine_closed_form():
    lr = functools.partial(learner.learning_rate, base_lr=1e-3, warmup_steps=4, total_steps=10, schedule="cosine",
                           min_lr_ratio=0.1)
    assert [lr(s) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3], rel=1e-15)
    # From base_lr at the last warm-up step (3) down to 0.1 * base_lr at step 9.
    expected = [1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 3) / 6))) for s in range(4, 10)]
    assert [lr(s) for s in range(4, 10)] == pytest.approx(expected, rel=1e-15)
    assert lr(9) == pytest.approx(1e-4, rel=1e-15) and lr(10) == lr(9) and lr(10**6) == lr(9)
    assert all(a > b for a, b in zip([lr(s) for s in range(3, 9)], [lr(s) for s in range(4, 10)]))


def test_schedule_edges():
    def lr(step, **kw):
        return learner.learning_rate(step, **{"base_lr": 2.0, "schedule": "cosine", "min_lr_ratio": 0.0, **kw})

    # No warm-up: base_lr at step 0, the minimum at the last step.
    assert lr(0, warmup_steps=0, total_steps=5) == 2.0
    assert lr(2, warmup_steps=0, total_steps=5) == pytest.approx(1.0, rel=1e-15)
    assert lr(4, warmup_steps=0, total_steps=5) == pytest.approx(0.0, abs=1e-15)
    # One step in all: base_lr (with or without a one-step warm-up).
    assert lr(0, warmup_steps=0, total_steps=1) == 2.0 and lr(5, warmup_steps=0, total_steps=1) == 2.0
    assert lr(0, warmup_steps=1, total_steps=1) == 2.0
    # Warm-up as long as the run: it ends at base_lr, and later steps stay there.
    assert [lr(s, warmup_steps=4, total_steps=4) for s in (0, 3, 4, 99)] == [0.5, 2.0, 2.0, 2.0]
    # Warm-up ending one step before the last: the last step is at the minimum.
    assert [lr(s, warmup_steps=3, total_steps=4) for s in (2, 3)] == pytest.approx([2.0, 0.0], abs=1e-15)


@pytest.mark.parametrize("kwargs, match", [
    (dict(step=-1), "step must be >= 0"),
    (dict(base_lr=0.0), "base_lr must be finite and > 0"),
    (dict(base_lr=float("nan")), "base_lr must be finite and > 0"),
    (dict(total_steps=0), "total_steps must be >= 1"),
    (dict(warmup_steps=-1), "warmup_steps must be in"),
    (dict(warmup_steps=11), "warmup_steps must be in"),
    (dict(schedule="linear"), "schedule must be one of"),
    (dict(min_lr_ratio=1.5), "min_lr_ratio must be in"),
    (dict(min_lr_ratio=-0.1), "min_lr_ratio must be in"),
])
def test_bad_schedule_arguments_raise(kwargs, match):
    args = dict(step=0, base_lr=1e-3, warmup_steps=2, total_steps=10, schedule="cosine", min_lr_ratio=0.1) | kwargs
    with pytest.raises(ValueError, match=match):
        learner.learning_rate(args.pop("step"), **args)


# ----------------------------------------------------------------------------- plug-ins: advantages, losses, hooks


def _advantages_float64(name: str, rewards: list[float], groups: list[int]) -> list[float]:
    """The estimators from their definitions, one group at a time, in float64."""
    out = []
    for r, g in zip(rewards, groups):
        mine = [x for x, h in zip(rewards, groups) if h == g]
        n, mean = len(mine), math.fsum(mine) / len(mine)
        if name == "group_mean":
            out.append(r - mean)
        elif name == "group_mean_std":
            std = math.sqrt(math.fsum((x - mean) ** 2 for x in mine) / (n - 1))
            out.append((r - mean) / (std + 1e-6))
        else:  # rloo: the mean of the others
            out.append(r - (math.fsum(mine) - r) / (n - 1))
    return out


@pytest.mark.parametrize("name", ["group_mean", "group_mean_std", "rloo"])
def test_advantage_estimators_equal_their_float64_definitions(name):
    from llamarl_core.pipeline.advantages import ADVANTAGES

    gen = torch.Generator().manual_seed(7)
    for trial in range(200):
        sizes = torch.randint(2, 9, (int(torch.randint(1, 6, (), generator=gen)),), generator=gen).tolist()
        groups = [g * 13 + 5 for g, n in enumerate(sizes) for _ in range(n)]  # any ids, not 0..G-1
        order = torch.randperm(len(groups), generator=gen).tolist()  # samples of a group need not be adjacent
        groups = [groups[i] for i in order]
        rewards = (torch.rand(len(groups), generator=gen, dtype=torch.float64) * 4 - 2)
        if trial % 10 == 0:
            rewards = rewards.round()  # ties, and groups with all rewards equal
        got = ADVANTAGES[name](rewards.float(), torch.tensor(groups))
        want = torch.tensor(_advantages_float64(name, rewards.float().double().tolist(), groups), dtype=torch.float64)
        if name == "group_mean_std":  # a group of equal rewards: 0 / (0 + eps) = 0
            assert torch.isfinite(got).all()
        assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5), (name, trial)


def test_an_advantage_function_of_yours_drives_the_step_and_bad_ones_are_refused():
    from llamarl_core.pipeline.advantages import compute_advantages

    samples, model, optimizer, _, once = _plain_step(2)
    twice = lambda rewards, groups: 2 * learner.group_mean(rewards, groups)  # noqa: E731
    learner.train_step(model, optimizer, samples, lr=0.0, advantage=twice, **STEP)  # the loss is linear in A
    _assert_grads_close(optimizer.grads, [2 * g for g in once])
    rewards, groups = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    for bad, match in ((lambda r, g: r.tolist(), "returned a list"), (lambda r, g: r[:1], r"shape \(1,\)"),
                       (lambda r, g: r / 0 * 0, "non-finite"), (lambda r, g: g, "int64")):
        with pytest.raises(ValueError, match=match):
            compute_advantages(bad, rewards, groups, "mine")


def _aipo_by_hand(logprobs, batch):
    """AIPO written in torch by a user: -min(exp(logp - b), rho) A logp, the weight a constant."""
    weight = torch.exp(logprobs.detach() - batch.behavior_logprobs).clamp(max=STEP["rho"])
    return -weight * batch.advantages * logprobs


@pytest.mark.usefixtures("torch_loss_path")
@pytest.mark.parametrize("micro_batch_size", [None, 2])
def test_a_loss_function_of_yours_drives_the_trainer_like_the_built_in_one(micro_batch_size):
    """A user's AIPO on the per-token log-probs gives the built-in AIPO's loss,
    gradients and stats (micro-batches and the entropy bonus included); PPO (old
    log-probs from the policy itself: ratio 1) gives the plain policy gradient
    -A dlogp. What a loss of yours truncates, masks or clips is None: the trainer
    cannot see it."""
    samples = _samples(3)
    model = _tiny_llama()
    optimizer = _RecordingSGD(model.parameters(), lr=0.1)
    # PPO at ratio 1: the value -A, the gradient -A dlogp.
    ppo_at_one = lambda logp, batch: -batch.advantages * torch.exp(logp - logp.detach())  # noqa: E731
    for builtin, mine, parameters, entropy_coef in (("aipo", _aipo_by_hand, dict(rho=STEP["rho"]), 0.05),
                                                    ("ppo", ppo_at_one, {}, 0.0)):
        want = learner.train_step(model, optimizer, samples, lr=0.0, micro_batch_size=micro_batch_size, loss=builtin,
                                  entropy_coef=entropy_coef, **PLAIN, **parameters)
        expected = optimizer.grads
        got = learner.train_step(model, optimizer, samples, lr=0.0, micro_batch_size=micro_batch_size, loss=mine,
                                 entropy_coef=entropy_coef, **PLAIN)
        _assert_grads_close(optimizer.grads, expected, rel=1e-4)
        assert got.loss == pytest.approx(want.loss, rel=1e-4, abs=1e-6)
        for name in ("mismatch_kl", "mean_ratio", "entropy", "mismatch_k1", "chi_squared", "ess_fraction",
                     "mean_abs_log_ratio", "max_abs_log_ratio"):
            assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-4, abs=1e-7), name
        assert all(getattr(got, name) is None for name in ("truncated_fraction", "clip_fraction", "masked_fraction",
                                                           "sequence_truncated_fraction", "sequence_masked_fraction"))
        assert (want.clip_fraction is None) == (builtin == "aipo")
        assert want.clip_fraction in (None, 0.0)  # PPO at ratio 1 clips nothing
    for bad, match in ((lambda logp, batch: (logp * batch.mask).sum(), "per-token losses"),
                       (lambda logp, batch: batch.advantages.clone(), "no gradient")):
        with pytest.raises(ValueError, match=match):
            learner.train_step(model, optimizer, samples, lr=0.0, loss=bad, **PLAIN)


@pytest.mark.usefixtures("torch_loss_path")
def test_dr_grpo_normaliser_divides_the_summed_loss_by_a_constant():
    samples, model, optimizer, mean, per_token = _plain_step(4)
    tokens = sum(len(s.tokens) for s in samples)
    constant = learner.train_step(model, optimizer, samples, lr=0.0, normalizer=len(samples) * 8.0, **STEP)
    _assert_grads_close(optimizer.grads, [g * tokens / (len(samples) * 8.0) for g in per_token])
    assert constant.loss == pytest.approx(mean.loss * tokens / (len(samples) * 8.0), rel=1e-5)
    with pytest.raises(ValueError, match="normalizer must be finite and > 0"):
        learner.train_step(model, optimizer, samples, lr=0.0, normalizer=0.0, **STEP)


def _float64_step_grads(model, samples, loss: str, reduction: str, parameters: dict) -> list[torch.Tensor]:
    """The gradient of the step's loss written directly: a float64 copy of the
    model on the whole collated batch, the float64 reference loss
    (aipo_loss_ref: per-sequence means by Python loops) with the reduction
    given, old log-probs the copy's own."""
    from llamarl_core.ops.aipo import aipo_loss_ref
    from llamarl_core.ops.logprob import token_logprobs_ref

    model64 = copy.deepcopy(model).double()
    batch = learner.collate(samples, 0)
    logits = learner._logits(model64, batch.input_ids, batch.position_ids)
    old = None
    if loss in OLD_POLICY_TYPES:
        old = token_logprobs_ref(logits.detach(), batch.targets, temperature=PLAIN["temperature"])[0]
    value = aipo_loss_ref(logits, batch.targets, batch.behavior_logprobs, batch.advantages, loss_type=loss,
                          old_logprobs=old, sequence_ids=batch.sequence_ids, reduction=reduction,
                          temperature=PLAIN["temperature"], **parameters)
    value.backward()
    return [p.grad for p in model64.parameters()]


@pytest.mark.usefixtures("torch_loss_path")
@pytest.mark.parametrize("loss, reduction, natural", [("gspo", None, "sequence_mean"),
                                                      ("aipo", "sequence_mean", "sequence_mean"),
                                                      ("aipo", None, "token_mean")])
def test_the_step_reduces_over_every_micro_batchs_tokens_or_sequences(loss, reduction, natural):
    """The step's reduction (gspo's own: the mean over the completions of each
    one's token mean; the others': the token mean; or the one asked for), with
    micro-batches of 2 (a group of 3 straddles two) or none: its gradient that
    of the float64 loss written directly on the whole batch (a float32 model
    against a float64 one: within 1e-4)."""
    samples = _samples(21)
    model = _tiny_llama()
    want = _float64_step_grads(model, samples, loss, natural, {})
    optimizer = _RecordingSGD(model.parameters(), lr=0.1)
    for size in (None, 2):
        learner.train_step(model, optimizer, samples, lr=0.0, micro_batch_size=size, loss=loss, reduction=reduction,
                           **PLAIN)
        _assert_grads_close(optimizer.grads, want, rel=1e-4)
    with pytest.raises(ValueError, match="loss_reduction 'sequence_mean' and a constant normalizer"):
        learner.train_step(model, optimizer, samples, lr=0.0, loss=loss, reduction="sequence_mean", normalizer=64.0,
                           **PLAIN)
    with pytest.raises(ValueError, match="loss_reduction must be one of"):
        learner.train_step(model, optimizer, samples, lr=0.0, loss=loss, reduction="sum", **PLAIN)


def _data_parallel_rank(rank: int, world: int, port: int, groups: list[list[int]]) -> dict:
    """Rank `rank` of `world` gloo ranks: the tiny model sharded by FSDP2, one
    step (micro-batches of 2) of each loss on this rank's prompt groups; returns
    each step's full gradient, loss and token count."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        samples = [s for s in _samples(22) if s.group in groups[rank]]
        out = {}
        for loss in DATA_PARALLEL_LOSSES:
            model = _tiny_llama()
            mesh = init_device_mesh("cpu", (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optimizer = _FullGradSGD(model.parameters(), lr=0.1)
            step = learner.train_step(model, optimizer, samples, lr=0.1, micro_batch_size=2, loss=loss,
                                      mask_truncated=True, **PLAIN)
            out[loss] = dict(grads=[g.numpy() for g in optimizer.grads], loss=step.loss,
                             tokens=sum(len(s.tokens) for s in samples if s.finished), counted=step.counted_tokens,
                             sequences=sum(s.finished for s in samples))
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


class _FullGradSGD(torch.optim.SGD):
    """SGD that keeps a full copy of the (FSDP2-sharded) gradients it steps on."""

    def step(self, closure=None):
        self.grads = [p.grad.full_tensor().clone() for group in self.param_groups for p in group["params"]]
        return super().step(closure)


DATA_PARALLEL_LOSSES = ("aipo", "gspo")  # the token mean and gspo's sequence mean


def test_data_parallel_ranks_with_unequal_token_counts_step_as_one_rank_with_every_sample(monkeypatch):
    """Two FSDP2 ranks (gloo) holding different numbers of tokens take the step
    of one rank holding every sample: the global token mean (aipo) and sequence
    mean (gspo), not the mean of the ranks' means; the ranks' mean loss is the
    step's. Whole groups per rank, so advantages are the same; as many samples
    on each (as the pipeline splits them), so as many micro-batches, each an
    FSDP2 all-gather every rank must join. Truncated completions left out
    (mask_truncated), so the ranks count different tokens and different sequences
    (18 and 21, 4 and 6): a rank dividing by its own count fails either loss."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the spawned ranks read it: the torch path
    samples = _samples(22)
    groups = [[0, 1], [2, 3]]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    ranks = run_processes([(_data_parallel_rank, dict(rank=r, world=2, port=store.port, groups=groups))
                           for r in range(2)], timeout=180)
    for loss in DATA_PARALLEL_LOSSES:
        model = _tiny_llama()
        optimizer = _RecordingSGD(model.parameters(), lr=0.1)
        whole = learner.train_step(model, optimizer, samples, lr=0.1, loss=loss, mask_truncated=True, **PLAIN)
        tokens, sequences = [r[loss]["tokens"] for r in ranks], [r[loss]["sequences"] for r in ranks]
        assert tokens[0] != tokens[1] and sequences[0] != sequences[1] and all(r[loss]["counted"] == sum(tokens) == whole.counted_tokens
                                              for r in ranks), tokens
        for r in ranks:
            _assert_grads_close([torch.from_numpy(g) for g in r[loss]["grads"]], optimizer.grads)
        assert sum(r[loss]["loss"] for r in ranks) / 2 == pytest.approx(whole.loss, rel=1e-5, abs=1e-7), loss


def test_step_hook_runs_around_the_step_once_and_its_numbers_come_back():
    context = learner.StepContext(3, None, None, [], 0, 1, 0.1)
    stats = learner.StepStats(1.0, 2.0, 0.0, 0.0, 1.0, None, 0, 0.1)
    seen = []

    def hook(ctx, step):
        seen.append(("before", ctx.step))
        result = step()
        seen.append(("after", result.loss))
        return {"grad_norm_x2": 2 * result.grad_norm}

    assert learner.run_with_hook(hook, context, lambda: stats) == (stats, {"grad_norm_x2": 4.0})
    assert seen == [("before", 3), ("after", 1.0)]
    assert learner.run_with_hook(None, context, lambda: stats) == (stats, {})
    with pytest.raises(ValueError, match="without running the step"):
        learner.run_with_hook(lambda ctx, step: None, context, lambda: stats)
    with pytest.raises(RuntimeError, match="ran the step twice"):
        learner.run_with_hook(lambda ctx, step: (step(), step()), context, lambda: stats)
    with pytest.raises(ValueError, match="dict of finite numbers"):
        learner.run_with_hook(lambda ctx, step: step() and {"x": float("nan")}, context, lambda: stats)


def test_batch_sequence_ids_name_each_completion_tokens_sample():
    samples = _samples(6)
    batch = learner.collate(samples, 0)
    for i, sample in enumerate(samples):  # a sample's completion lies in one row, in order
        assert batch.targets[batch.sequence_ids == i].tolist() == sample.tokens
    assert bool((batch.targets[batch.sequence_ids == -1] == learner.IGNORE_INDEX).all())
