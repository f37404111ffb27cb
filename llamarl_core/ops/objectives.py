"""The policy objectives of aipo_loss / linear_aipo_loss on the per-token vectors
of the fused log-prob op (ops/logprob.py), in torch, their parameters with
defaults and sources, and their detached statistics. On a GPU aipo_loss runs
the same functions in one kernel (kernels/objective.py, ops/objective_launch.py;
tests/test_objective_kernel.py holds the two to each other).

Notation, per counted token t (mask not 0, target not IGNORE_INDEX) of sequence
i: logp_t the learner's log-prob (differentiable), b_t the behaviour
(generator's) log-prob, old_t the trainer's old policy's, A_t the advantage,
r_t = exp(logp_t - b_t), q_t = exp(logp_t - old_t), s_i = sum over the counted
tokens of i of (logp_t - b_t), n_i their count, sg = no gradient.

    aipo      l_t = -sg(min(r_t, rho)) A_t logp_t                      (LlamaRL)
    ppo       l_t = -min(q_t A_t, clip(q_t, 1 - eps_low, 1 + eps_high) A_t)
    ppo_tis   l_t = min(exp(old_t - b_t), rho) * ppo's l_t   (decoupled PPO, the behaviour
              weight truncated)
    icepop    l_t = -sg(r_t 1[mask_low <= r_t <= mask_high]) A_t logp_t
    seq_tis   l_t = -sg(min(exp(s_i), rho)) A_t logp_t
    seq_mis   l_t = -sg(exp(s_i) 1[mask_low <= exp(s_i) <= mask_high]) A_t logp_t
    geo_mask  l_t = -sg(min(r_t, rho) 1[mask_low <= exp(s_i / n_i) <= mask_high]) A_t logp_t
    gspo      g_i = exp(sum over counted t of i of (logp_t - old_t) / n_i), the gradient
              flowing through g_i; l_t = -min(g_i A_t, clip(g_i, 1 - eps_low, 1 + eps_high) A_t)
              on each token of i (l_i when A is per sequence, as GRPO's is)
    cispo     l_t = -sg(clip(q_t, 1 - eps_low, 1 + eps_high)) A_t logp_t
    sapo      l_t = -(4 / tau_t) sigmoid(tau_t (q_t - 1)) A_t, tau_t = tau_pos where A_t > 0,
              else tau_neg (a soft gate in place of the clip; its gradient at q_t = 1 is
              the policy gradient's)
    vespo     v_i = clamp(sum over counted t of i of clamp(logp_t - b_t, -20, 20),
              log 1e-8, 20), w_i = exp(v_i); l_t = -sg(phi_i) A_t logp_t with the gamma
              weight phi_i = exp(lambda + k v_i - lambda w_i) (phi(1) = 1), k, lambda =
              k_pos, lambda_pos where A_t >= 0, else k_neg, lambda_neg; phi_i 0 where
              it is not finite

An IS weight w = 0 gives l_t = 0 (not 0 * logp, which is NaN at logp = -inf).
Every ratio (r_t, q_t, exp(old_t - b_t), exp(s_i), g_i) is evaluated with its
log clamped at MAX_LOG_RATIO (80), so it stays finite (a ratio of inf times an
advantage of 0 would be NaN); one that carries a gradient (q_t in ppo, g_i) has
none where it is clamped. Around every
objective: + kl_coef * k3(ref_t - logp_t) (reference_kl) - entropy_coef * H_t.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

LOSS_TYPES = ("aipo", "ppo", "ppo_tis", "icepop", "seq_tis", "seq_mis", "geo_mask", "gspo", "cispo", "sapo", "vespo")
SEQUENCE_TYPES = ("seq_tis", "seq_mis", "geo_mask", "gspo", "vespo")  # need each token's sequence
OLD_POLICY_TYPES = ("ppo", "ppo_tis", "gspo", "cispo", "sapo")  # need old_logprobs
CLIP_TYPES = ("ppo", "ppo_tis", "gspo", "cispo")  # have a clip fraction
TRUNCATING_TYPES = ("aipo", "ppo_tis", "seq_tis", "geo_mask")  # have a truncated fraction
MASKING_TYPES = ("icepop", "seq_mis", "geo_mask")  # have a masked fraction

# The parameters each objective reads, with their defaults and sources. A
# parameter an objective does not read, passed to it, raises ValueError: it
# would do nothing.
DEFAULTS = {
    # LlamaRL (arXiv 2505.24034): rho, the truncation of the importance weight.
    "aipo": dict(rho=4.0),
    # PPO (Schulman et al. 2017): clip 0.2 on both sides.
    "ppo": dict(eps_low=0.2, eps_high=0.2),
    # rho as aipo's (this release's default since ppo_tis came; AReaL's
    # behave_imp_weight_cap is 5.0, and AReaL masks the tokens above it where
    # ppo_tis truncates them); the clip as PPO's.
    "ppo_tis": dict(rho=4.0, eps_low=0.2, eps_high=0.2),
    # verl's token IcePop presets (RolloutCorrectionConfig: threshold_lower 0.5,
    # threshold 5.0), as OpenRLHF's and NeMo-RL's (prorlv2.yaml).
    "icepop": dict(mask_low=0.5, mask_high=5.0),
    # verl, rollout_is="sequence": rollout_is_threshold 2.0.
    "seq_tis": dict(rho=2.0),
    # TRL's default correction, vllm_importance_sampling_mode="sequence_mask":
    # clip_max 3.0, no lower bound.
    "seq_mis": dict(mask_low=0.0, mask_high=3.0),
    # verl's geometric rejection presets (rollout_rs="seq_mean_k1"): rs_threshold
    # "0.999_1.001", token IS at rollout_is_threshold 2.0.
    "geo_mask": dict(rho=2.0, mask_low=0.999, mask_high=1.001),
    # GSPO (arXiv 2507.18071, section 5.1): 3e-4 and 4e-4.
    "gspo": dict(eps_low=3e-4, eps_high=4e-4),
    # CISPO (MiniMax-M1, arXiv 2506.13585): no lower bound (eps_low large), the
    # upper tuned; slime's recommended --eps-clip 1.0 --eps-clip-high 4.0, i.e.
    # weights in [0, 5] (TRL's docs: a cap of 5.0, after ScaleRL).
    "cispo": dict(eps_low=1.0, eps_high=4.0),
    # SAPO (Qwen, arXiv 2511.20347): the gate's temperatures, steeper for negative
    # advantages; TRL's sapo_temperature_pos / _neg defaults.
    "sapo": dict(tau_pos=1.0, tau_neg=1.05),
    # VESPO (arXiv 2602.10693): the gamma weight's shape by the advantage's sign; TRL's
    # vespo_k_pos / vespo_lambda_pos / vespo_k_neg / vespo_lambda_neg defaults.
    "vespo": dict(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0),
}
# Every objective parameter, in the order the functions take them.
PARAMETERS = ("rho", "eps_low", "eps_high", "mask_low", "mask_high", "tau_pos", "tau_neg", "k_pos", "lambda_pos",
              "k_neg", "lambda_neg")
# VESPO's clamps of each token's log-ratio and of a sequence's (TRL's, from the paper's code).
VESPO_TOKEN_LOG_RATIO = 20.0
VESPO_LOG_W = (math.log(1e-8), 20.0)

# exp(80) = 5.5e34: clamping log-ratios there keeps ratios, k3 and their products
# with weights and advantages finite in float32 (max 3.4e38).
MAX_LOG_RATIO = 80.0


@dataclass(frozen=True)
class Objective:
    """A policy objective as a value (Liger-Kernel's pattern): its kind
    (`loss_type`, one of LOSS_TYPES), the parameters it reads, and what goes around
    every objective (the temperature the log-probs are taken at, the KL penalty's
    and the entropy bonus's weights). Checked when made: ValueError naming a
    parameter out of range or one the kind does not read (it would do nothing).
    A parameter the kind reads and is not given takes its default (DEFAULTS); the
    others stay None. Equal and hashable by value: `Objective("ppo", eps_high=0.28)`.

    aipo_loss, linear_aipo_loss and aipo_loss_ref take one as `objective=`, or
    build it from `loss_type=` and the same keywords (the shorthand)."""

    loss_type: str = "aipo"
    rho: float | None = None
    eps_low: float | None = None
    eps_high: float | None = None
    mask_low: float | None = None
    mask_high: float | None = None
    tau_pos: float | None = None
    tau_neg: float | None = None
    k_pos: float | None = None
    lambda_pos: float | None = None
    k_neg: float | None = None
    lambda_neg: float | None = None
    temperature: float = 1.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        reads = DEFAULTS[self.loss_type]
        unread = [name for name in PARAMETERS if getattr(self, name) is not None and name not in reads]
        if unread:
            raise ValueError(f'loss_type="{self.loss_type}" does not read {", ".join(unread)} (it reads '
                             f'{", ".join(reads)})')
        for name in (*reads, "temperature", "kl_coef", "entropy_coef"):
            given = getattr(self, name)
            if given is not None and (isinstance(given, bool) or not isinstance(given, numbers.Real)):
                raise ValueError(f"{name} must be a number, got {given!r} ({type(given).__name__})")
        values = {name: default if getattr(self, name) is None else float(getattr(self, name))
                  for name, default in reads.items()}
        for name, value in values.items():
            if math.isnan(value):
                raise ValueError(f"{name} must be a number, got {value}")
        if values.get("rho", 1.0) <= 0 or math.isinf(values.get("rho", 1.0)):
            raise ValueError(f"rho must be positive and finite, got {values['rho']}")
        for name in ("eps_low", "eps_high", "k_pos", "k_neg"):
            if name in values and not 0 <= values[name] < math.inf:
                raise ValueError(f"{name} must be >= 0 and finite, got {values[name]}")
        for name in ("tau_pos", "tau_neg", "lambda_pos", "lambda_neg"):
            if name in values and not 0 < values[name] < math.inf:
                raise ValueError(f"{name} must be positive and finite, got {values[name]}")
        if "eps_low" in values and values["eps_low"] > 1:
            raise ValueError(f"eps_low must be <= 1 (the clip's lower end 1 - eps_low >= 0), got {values['eps_low']}")
        if "mask_low" in values and not 0 <= values["mask_low"] <= values["mask_high"]:
            raise ValueError(f"mask_low and mask_high must satisfy 0 <= mask_low <= mask_high, got "
                             f"{values['mask_low']} and {values['mask_high']}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        for name in ("kl_coef", "entropy_coef"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        resolved = {**values, "loss_type": str(self.loss_type), "temperature": float(self.temperature),
                    "kl_coef": float(self.kl_coef),
                    "entropy_coef": float(self.entropy_coef)}
        for name, value in resolved.items():  # a frozen value: set once, here
            object.__setattr__(self, name, value)

    @property
    def parameters(self) -> dict:
        """The parameters this objective reads, with their values."""
        return {name: getattr(self, name) for name in DEFAULTS[self.loss_type]}


class _Unset:
    """A loss keyword's default as the value itself (it computes as that value) that
    resolve_objective tells from the same value given: the shorthand's defaults."""

    def __repr__(self) -> str:
        return repr(type(self).__mro__[2](self))


class _UnsetFloat(_Unset, float):
    pass


class _UnsetStr(_Unset, str):
    pass


# The shorthand keywords' defaults (aipo_loss, linear_aipo_loss, aipo_loss_ref).
LOSS_TYPE, TEMPERATURE, NO_COEF = _UnsetStr("aipo"), _UnsetFloat(1.0), _UnsetFloat(0.0)


def resolve_objective(objective: Objective | None, loss_type: str = LOSS_TYPE, *, temperature: float = TEMPERATURE,
                      kl_coef: float = NO_COEF, entropy_coef: float = NO_COEF, **parameters) -> Objective:
    """The Objective a loss call computes: `objective` when given (then none of the
    shorthand's keywords may be: ValueError naming those given too, even at their
    default values), else the one `loss_type` and the keywords describe."""
    if objective is None:
        return Objective(str(loss_type), **parameters, temperature=temperature, kl_coef=kl_coef,
                         entropy_coef=entropy_coef)
    if not isinstance(objective, Objective):
        raise ValueError(f"objective must be an ops.Objective, got {type(objective).__name__}")
    given = [name for name, value in (("loss_type", loss_type), ("temperature", temperature), ("kl_coef", kl_coef),
                                      ("entropy_coef", entropy_coef)) if not isinstance(value, _Unset)]
    given += [name for name, value in parameters.items() if value is not None]
    if given:
        raise ValueError(f"objective= and {', '.join(f'{name}=' for name in given)} both describe the objective: give "
                         f"one (objective={objective!r})")
    return objective


def reference_kl(logp: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token k3 = exp(ref - logp) - (ref - logp) - 1, the estimator of
    KL(pi || ref) on tokens sampled from (nearly) pi, and its derivative dk3 /
    dlogp = 1 - exp(ref - logp), with ref - logp clamped at MAX_LOG_RATIO. The
    derivative is taken at the clamped value rather than zeroed beyond it: a
    token the learner made e^80 times less likely than the reference keeps a
    (bounded) pull back towards it."""
    x = (ref - logp).clamp(max=MAX_LOG_RATIO)
    r = torch.exp(x)
    return r - x - 1, 1 - r


def _kl_penalty(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k3 of reference_kl, differentiable through logp with reference_kl's derivative."""
    k3, dk3 = reference_kl(logp.detach(), ref)
    return k3 + dk3 * (logp - logp.detach())


def _exp_clamped(log_value: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_value.clamp(max=MAX_LOG_RATIO))


def _weighted_pg(w: torch.Tensor, advantages: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """-w A logp with w a constant; 0 where w is (logp may be -inf there)."""
    return torch.where(w == 0, 0.0, -w.detach() * advantages * logp)


def _truncate(ratio: torch.Tensor, rho: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(where ratio > rho, the weight min(ratio, rho))."""
    return ratio > rho, torch.clamp(ratio, max=rho)


def _window(ratio: torch.Tensor, cfg: Objective) -> tuple[torch.Tensor, torch.Tensor]:
    """(where ratio is outside [mask_low, mask_high], the weight: ratio inside, 0 outside)."""
    masked = (ratio < cfg.mask_low) | (ratio > cfg.mask_high)
    return masked, torch.where(masked, 0.0, ratio)


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, cfg: Objective):
    """(-min(ratio A, clip(ratio) A), where the clipped term is strictly the smaller:
    the clip active, no gradient through the ratio there)."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


@dataclass
class Sequences:
    """Each token's sequence: index (num_tokens,) int64 in [0, count). count may
    exceed the sequences (an upper bound known without a host sync): a slot no
    token points to sums to 0, and counts of sequences count those with a token."""

    index: torch.Tensor
    count: int

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """(count,) per-sequence sums of per-token values (differentiable)."""
        return torch.zeros(self.count, dtype=values.dtype, device=values.device).index_add(0, self.index, values)


@dataclass
class ObjectiveTerms:
    """Per-token (num_tokens,) loss terms and what the statistics need, detached."""

    terms: torch.Tensor  # l_t (+ KL penalty, - entropy bonus), differentiable
    truncated: torch.Tensor | None  # bool: the token's IS weight was truncated at rho
    masked: torch.Tensor | None  # bool: the token's IS weight was masked to 0
    clipped: torch.Tensor | None  # bool: the clip acted (no gradient from the ratio; CISPO: the weight clipped)


def on_policy(logprobs: torch.Tensor | None, logp: torch.Tensor) -> torch.Tensor:
    """Given behaviour or old log-probs, or, for None (the tokens sampled by the
    learner itself, no optimizer step since), the learner's own, detached."""
    return logp.detach() if logprobs is None else logprobs


def objective_terms(logp: torch.Tensor, entropy: torch.Tensor | None, behavior: torch.Tensor | None,
                    advantages: torch.Tensor, old: torch.Tensor | None, ref: torch.Tensor | None,
                    counted: torch.Tensor, sequences: Sequences | None, cfg: Objective) -> ObjectiveTerms:
    """The per-token terms of cfg's objective (module docstring), float32. Inputs
    flat (num_tokens,); behaviour, advantages, old and ref hold finite values
    (0) where a token does not count (`counted` False), so that no NaN leaks
    into a gradient through them; behaviour and old None: on_policy;
    sequences: required by SEQUENCE_TYPES."""
    kind, a = cfg.loss_type, advantages
    behavior, old = on_policy(behavior, logp), on_policy(old, logp)
    log_r = (logp - behavior).detach()
    truncated = masked = clipped = None
    on = counted.to(logp.dtype)
    if kind == "sapo":
        tau = torch.where(a > 0, cfg.tau_pos, cfg.tau_neg)
        terms = -(4 / tau) * torch.sigmoid(tau * (_exp_clamped(logp - old) - 1)) * a
    elif kind == "vespo":
        v = sequences.sum(log_r.clamp(-VESPO_TOKEN_LOG_RATIO, VESPO_TOKEN_LOG_RATIO) * on)
        phi = vespo_weight(v[sequences.index], a, cfg)
        terms = _weighted_pg(phi, a, logp)
    elif kind == "gspo":
        n = sequences.sum(on).clamp(min=1.0)
        g = _exp_clamped(sequences.sum((logp - old) * on) / n)[sequences.index]
        terms, clipped = _clipped_surrogate(g, a, cfg)
    elif kind == "cispo":
        q = _exp_clamped((logp - old).detach())
        clipped = (q < 1 - cfg.eps_low) | (q > 1 + cfg.eps_high)
        terms = _weighted_pg(torch.clamp(q, 1 - cfg.eps_low, 1 + cfg.eps_high), a, logp)
    elif kind in ("ppo", "ppo_tis"):
        terms, clipped = _clipped_surrogate(_exp_clamped(logp - old), a, cfg)
        if kind == "ppo_tis":
            truncated, tis = _truncate(_exp_clamped(old - behavior), cfg.rho)
            terms = tis * terms
    else:  # an IS weight w on the policy gradient: -sg(w) A logp
        r = _exp_clamped(log_r)
        if kind == "aipo":
            truncated, w = _truncate(r, cfg.rho)
        elif kind == "icepop":
            masked, w = _window(r, cfg)
        else:  # from each sequence's sum of log-ratios s_i
            s = sequences.sum(log_r * on)
            if kind == "seq_tis":
                truncated, w = _truncate(_exp_clamped(s)[sequences.index], cfg.rho)
            elif kind == "seq_mis":
                masked, w = _window(_exp_clamped(s)[sequences.index], cfg)
            else:  # geo_mask: the token's truncated weight, 0 where its sequence's geometric mean is outside
                truncated, w = _truncate(r, cfg.rho)
                masked, _ = _window(torch.exp(s / sequences.sum(on).clamp(min=1.0))[sequences.index], cfg)
                w = torch.where(masked, 0.0, w)
        terms = _weighted_pg(w, a, logp)
    if ref is not None and cfg.kl_coef > 0:
        terms = terms + cfg.kl_coef * _kl_penalty(logp, ref)
    if cfg.entropy_coef > 0:
        terms = terms - cfg.entropy_coef * entropy
    return ObjectiveTerms(terms, truncated, masked, clipped)


def vespo_weight(log_ratio_sum: torch.Tensor, advantages: torch.Tensor, cfg: Objective) -> torch.Tensor:
    """VESPO's gamma weight phi = exp(lambda + k v - lambda e^v) of a sequence's summed
    log-ratio (v clamped to VESPO_LOG_W), its shape by the advantage's sign; 0 where
    not finite. Detached."""
    v = log_ratio_sum.detach().clamp(*VESPO_LOG_W)
    k = torch.where(advantages >= 0, cfg.k_pos, cfg.k_neg)
    lam = torch.where(advantages >= 0, cfg.lambda_pos, cfg.lambda_neg)
    return torch.exp(lam + k * v - lam * torch.exp(v)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@dataclass
class AIPOStats:
    """Detached diagnostics over the tokens that count (mask not 0, target not
    IGNORE_INDEX), means weighted by the mask (plain means for a 0 / 1 mask),
    computed on the device with no host sync. r_t = exp(logp_t - b_t), the
    learner over the behaviour policy mu that sampled the tokens (log r clamped
    at MAX_LOG_RATIO). None: not defined for this objective or these inputs."""

    logprobs: torch.Tensor  # learner log-probs, float32, in the targets' shape; 0 where a token does not count
    mean_ratio: torch.Tensor  # mean r
    # fraction of tokens whose IS weight was truncated at rho (aipo: r > rho; ppo_tis:
    # exp(old - b) > rho; seq_tis: their sequence's; geo_mask: r > rho); 0 for objectives without one
    truncated_fraction: torch.Tensor
    mismatch_kl: torch.Tensor  # k3 estimate of KL(mu || learner): mean(r - 1 - log r), never negative
    entropy: torch.Tensor | None = None  # mean entropy of the learner's distribution, if computed
    ref_kl: torch.Tensor | None = None  # mean k3 estimate of KL(learner || reference), with ref_logprobs
    # Fraction of tokens where the clip acted: ppo / ppo_tis / gspo, the clipped surrogate
    # strictly the smaller (no gradient from the ratio; verl's pg_clipfrac; gspo's per
    # sequence, counted on its tokens); cispo, the weight clipped. None without a clip.
    clip_fraction: torch.Tensor | None = None
    mismatch_k1: torch.Tensor | None = None  # k1 estimate of KL(mu || learner): mean(-log r)
    chi_squared: torch.Tensor | None = None  # chi-squared divergence estimate: mean(r^2) - 1
    # Effective sample size of the weights r over the counted tokens, as a fraction of
    # them: (sum m r)^2 / (sum m * sum m r^2), 1 when every r is equal, 0 when nothing counts
    ess_fraction: torch.Tensor | None = None
    mean_abs_log_ratio: torch.Tensor | None = None  # mean |log r|
    max_abs_log_ratio: torch.Tensor | None = None  # max |log r| over the counted tokens (0 without one)
    masked_fraction: torch.Tensor | None = None  # tokens whose IS weight was masked to 0 (icepop, seq_mis, geo_mask)
    # Fractions of the sequences with a counted token that had a token truncated / masked
    # (a sequence-level decision is all its tokens'); None where tokens have no sequences
    # (flat inputs without sequence_ids)
    sequence_truncated_fraction: torch.Tensor | None = None
    sequence_masked_fraction: torch.Tensor | None = None


def objective_stats(logp: torch.Tensor, entropy: torch.Tensor | None, behavior: torch.Tensor | None,
                    mask: torch.Tensor, ref: torch.Tensor | None, sequences: Sequences | None, terms: ObjectiveTerms,
                    shape: torch.Size) -> AIPOStats:
    """AIPOStats of one call: flat (num_tokens,) inputs, mask 0 where a token does
    not count; mask-weighted means whatever the values elsewhere (padding) are;
    behaviour None: on_policy."""
    logp = logp.detach()
    behavior = on_policy(behavior, logp)
    counted = mask != 0
    total = mask.sum()
    count = torch.where(total > 0, total, 1.0)

    def mean(per_token: torch.Tensor) -> torch.Tensor:
        return torch.where(counted, per_token * mask, 0.0).sum() / count

    def fraction(flags: torch.Tensor | None) -> torch.Tensor:
        return torch.zeros((), device=mask.device) if flags is None else mean(flags.to(torch.float32))

    def sequence_fraction(flags: torch.Tensor | None) -> torch.Tensor | None:
        if sequences is None:
            return None
        present = sequences.sum(counted.to(torch.float32)) > 0
        if flags is None:
            return torch.zeros((), device=mask.device)
        hit = sequences.sum((flags & counted).to(torch.float32)) > 0
        return hit.sum() / present.sum().clamp(min=1)

    log_r = (logp - behavior).clamp(max=MAX_LOG_RATIO)
    r = torch.exp(log_r)
    weighted_r = torch.where(counted, r * mask, 0.0).sum()
    weighted_r2 = torch.where(counted, r * r * mask, 0.0).sum()
    abs_log_r = torch.where(counted, log_r.abs(), 0.0)
    return AIPOStats(
        logprobs=logp.view(shape),
        mean_ratio=mean(r),
        truncated_fraction=fraction(terms.truncated),
        mismatch_kl=mean(r - 1 - log_r),
        entropy=None if entropy is None else mean(entropy.detach()),
        ref_kl=None if ref is None else mean(reference_kl(logp, ref)[0]),
        clip_fraction=None if terms.clipped is None else fraction(terms.clipped),
        mismatch_k1=mean(-log_r),
        chi_squared=torch.where(total > 0, mean(r * r) - 1, 0.0),  # 0, not -1, when nothing counts
        ess_fraction=torch.where(weighted_r2 > 0, weighted_r**2 / (count * weighted_r2), 0.0),
        mean_abs_log_ratio=mean(log_r.abs()),
        max_abs_log_ratio=abs_log_r.max() if abs_log_r.numel() else torch.zeros((), device=mask.device),
        masked_fraction=None if terms.masked is None else fraction(terms.masked),
        sequence_truncated_fraction=sequence_fraction(terms.truncated),
        sequence_masked_fraction=sequence_fraction(terms.masked),
    )
