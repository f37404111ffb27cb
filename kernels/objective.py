"""Triton kernel for a policy loss's per-token objective, its gradient and its
statistics, in one pass over the tokens.

Device code only: pointers, sizes and scalars; llamarl_core/ops/objective_launch.py
launches it. Each program takes BLOCK tokens of flat float32 vectors (the fused
log-prob op's log-probs and entropies, and the loss's checked inputs) and writes:
- dlogp_t = w_t * d(term_t)/d(logp_t) and dent_t = w_t * d(term_t)/d(H_t) (the
  loss is sum_t w_t term_t, linear in the terms); for gspo, whose term depends on
  its sequence's mean log-ratio m_i, also dseq_t = w_t * d(term_t)/d(m_i), which
  the launcher spreads over the sequence's tokens (dm_i/dlogp_s = 1 / n_i);
- its row of `partial_ptr` (16 floats): the loss's partial sum, then the sums
  and the max that AIPOStats reads (slots 0-12, named in the launcher: LOSS,
  COUNT, R, ...), 13-15 zero;
- with WRITE_FLAGS, each token's truncated (bit 0) and masked (bit 1) flags, for
  the per-sequence fractions.
KIND is the objective (ops/objectives.LOSS_TYPES' index). Per-sequence inputs
come gathered per token in seq_ptr (the launcher computes them): seq_tis /
seq_mis the sum of log-ratios s_i, geo_mask s_i / n_i, gspo the mean log-ratio
to the old policy, vespo the clamped sum. Optional inputs (behaviour, old and
reference log-probs, entropies) are read only where their HAS_ flag is set; a
missing behaviour or old log-prob is the learner's own (on-policy: ratio 1).
Derivatives follow torch autograd's conventions on the same formulas: clamp
passes the gradient inside its bounds, bounds included; minimum splits it in
half at a tie; every min and max keeps a NaN, as torch's do.
"""

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _min(x, y):
    """min as torch's clamp / minimum: NaN in, NaN out (Triton's default drops it)."""
    return tl.minimum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max(x, y):
    return tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _exp_clamped(x, max_log_ratio):
    """(exp(min(x, max)), d/dx: exp where x <= max, else 0)."""
    e = tl.exp(_min(x, max_log_ratio))
    return e, tl.where(x <= max_log_ratio, e, 0.0)


@triton.jit
def _pg(w, a, logp):
    """-sg(w) A logp and its derivative in logp; 0 where w is 0 (logp may be -inf there)."""
    return tl.where(w == 0, 0.0, -w * a * logp), tl.where(w == 0, 0.0, -w * a)


@triton.jit
def _clipped_min(q, dq, a, eps_low, eps_high):
    """(-min(q A, clip(q) A), its derivative in q's argument by dq, clipped strictly smaller)."""
    lo = 1.0 - eps_low
    hi = 1.0 + eps_high
    unclipped = q * a
    clipped = _min(_max(q, lo), hi) * a
    d_unclipped = dq * a
    d_clipped = tl.where((q >= lo) & (q <= hi), dq * a, 0.0)
    d = tl.where(unclipped < clipped, d_unclipped,
                 tl.where(clipped < unclipped, d_clipped, 0.5 * (d_unclipped + d_clipped)))
    return -_min(unclipped, clipped), -d, clipped < unclipped


@triton.jit
def objective_kernel(logp_ptr, entropy_ptr, behavior_ptr, old_ptr, ref_ptr, adv_ptr, weight_ptr, mask_ptr, seq_ptr,
                     dlogp_ptr, dentropy_ptr, dseq_ptr, flags_ptr, partial_ptr, n, has_entropy, has_behavior, has_old,
                     has_ref, rho, eps_low, eps_high, mask_low, mask_high, tau_pos, tau_neg, k_pos, lambda_pos, k_neg,
                     lambda_neg, kl_coef, entropy_coef, max_log_ratio, vespo_low, vespo_high,
                     KIND: tl.constexpr, WRITE_FLAGS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    logp = tl.load(logp_ptr + offs, mask=inb, other=0.0)
    a = tl.load(adv_ptr + offs, mask=inb, other=0.0)
    w = tl.load(weight_ptr + offs, mask=inb, other=0.0)
    m = tl.load(mask_ptr + offs, mask=inb, other=0.0)
    lanes = tl.zeros([BLOCK], dtype=tl.int32)  # run-time flags as lanes: a mask of a scalar flag is not portable
    behavior_on = (lanes + has_behavior) != 0
    old_on = (lanes + has_old) != 0
    entropy_on = inb & ((lanes + has_entropy) != 0)
    b = tl.where(behavior_on, tl.load(behavior_ptr + offs, mask=inb & behavior_on, other=0.0), logp)
    old = tl.where(old_on, tl.load(old_ptr + offs, mask=inb & old_on, other=0.0), logp)
    ent = tl.load(entropy_ptr + offs, mask=entropy_on, other=0.0)
    counted = m != 0.0
    log_r = logp - b
    r, _ = _exp_clamped(log_r, max_log_ratio)
    zero = tl.zeros([BLOCK], dtype=tl.float32)
    truncated = zero != 0.0
    masked = zero != 0.0
    clipped = zero != 0.0
    if KIND == 0:  # aipo
        truncated = r > rho
        term, dterm = _pg(_min(r, rho), a, logp)
    elif KIND == 1 or KIND == 2:  # ppo, ppo_tis
        q, dq = _exp_clamped(logp - old, max_log_ratio)
        term, dterm, clipped = _clipped_min(q, dq, a, eps_low, eps_high)
        if KIND == 2:
            tis, _ = _exp_clamped(old - b, max_log_ratio)
            truncated = tis > rho
            tis = _min(tis, rho)
            term = tis * term
            dterm = tis * dterm
    elif KIND == 3:  # icepop
        masked = (r < mask_low) | (r > mask_high)
        term, dterm = _pg(tl.where(masked, 0.0, r), a, logp)
    elif KIND == 4 or KIND == 5:  # seq_tis, seq_mis: the sequence's exp(s_i)
        s, _ = _exp_clamped(tl.load(seq_ptr + offs, mask=inb, other=0.0), max_log_ratio)
        if KIND == 4:
            truncated = s > rho
            term, dterm = _pg(_min(s, rho), a, logp)
        else:
            masked = (s < mask_low) | (s > mask_high)
            term, dterm = _pg(tl.where(masked, 0.0, s), a, logp)
    elif KIND == 6:  # geo_mask: the token's truncated weight, 0 outside the sequence's geometric window
        geo = tl.exp(tl.load(seq_ptr + offs, mask=inb, other=0.0))
        truncated = r > rho
        masked = (geo < mask_low) | (geo > mask_high)
        term, dterm = _pg(tl.where(masked, 0.0, _min(r, rho)), a, logp)
    elif KIND == 7:  # gspo: d(term)/d(the sequence's mean log-ratio) to dseq, spread by the launcher
        g, dg = _exp_clamped(tl.load(seq_ptr + offs, mask=inb, other=0.0), max_log_ratio)
        term, dseq, clipped = _clipped_min(g, dg, a, eps_low, eps_high)
        dterm = zero
        tl.store(dseq_ptr + offs, tl.where(w != 0.0, w * dseq, 0.0), mask=inb)
    elif KIND == 8:  # cispo
        q, _ = _exp_clamped(logp - old, max_log_ratio)
        lo = 1.0 - eps_low
        hi = 1.0 + eps_high
        clipped = (q < lo) | (q > hi)
        term, dterm = _pg(_min(_max(q, lo), hi), a, logp)
    elif KIND == 9:  # sapo
        q, _ = _exp_clamped(logp - old, max_log_ratio)
        tau = tl.where(a > 0, tau_pos, tau_neg)
        gate = tl.sigmoid(tau * (q - 1.0))
        term = -(4.0 / tau) * gate * a
        # 0 outside the clamp whatever the rest holds (NaN included), as torch's clamp passes it
        dterm = tl.where(logp - old <= max_log_ratio, -4.0 * gate * (1.0 - gate) * q * a, 0.0)
    else:  # vespo
        v = _min(_max(tl.load(seq_ptr + offs, mask=inb, other=0.0), vespo_low), vespo_high)
        k = tl.where(a >= 0, k_pos, k_neg)
        lam = tl.where(a >= 0, lambda_pos, lambda_neg)
        phi = tl.exp(lam + k * v - lam * tl.exp(v))
        phi = tl.where(phi <= FLT_MAX, phi, 0.0)  # nan_to_num: NaN and inf to 0 (phi >= 0; NaN fails <=)
        term, dterm = _pg(phi, a, logp)
    ref_k3 = zero
    if has_ref != 0:
        ref = tl.load(ref_ptr + offs, mask=inb, other=0.0)
        x = _min(ref - logp, max_log_ratio)
        rr = tl.exp(x)
        ref_k3 = rr - x - 1.0
        if kl_coef > 0:
            term = term + kl_coef * ref_k3
            dterm = dterm + kl_coef * (1.0 - rr)
    dent = zero
    if entropy_coef > 0:
        term = term - entropy_coef * ent
        dent = zero - entropy_coef
    weighted = w != 0.0
    tl.store(dlogp_ptr + offs, tl.where(weighted, w * dterm, 0.0), mask=inb)
    tl.store(dentropy_ptr + offs, tl.where(weighted, w * dent, 0.0), mask=entropy_on)
    if WRITE_FLAGS:
        flags = (truncated & counted).to(tl.int32) + 2 * (masked & counted).to(tl.int32)
        tl.store(flags_ptr + offs, flags.to(tl.int8), mask=inb)
    stat_log_r = _min(log_r, max_log_ratio)
    keep = counted & inb
    mw = tl.where(keep, m, 0.0)
    row = partial_ptr + pid * 16
    tl.store(row + 0, tl.sum(tl.where(weighted & inb, w * term, 0.0), axis=0))
    tl.store(row + 1, tl.sum(mw, axis=0))
    tl.store(row + 2, tl.sum(tl.where(keep, r * m, 0.0), axis=0))
    tl.store(row + 3, tl.sum(tl.where(keep, r * r * m, 0.0), axis=0))
    tl.store(row + 4, tl.sum(tl.where(keep, (r - 1.0 - stat_log_r) * m, 0.0), axis=0))
    tl.store(row + 5, tl.sum(tl.where(keep, -stat_log_r * m, 0.0), axis=0))
    abs_sum = tl.sum(tl.where(keep, tl.abs(stat_log_r) * m, 0.0), axis=0)
    tl.store(row + 6, abs_sum)
    # tl.max drops NaN where torch's max keeps it: a counted NaN made the sum NaN too
    abs_max = tl.max(tl.where(keep, tl.abs(stat_log_r), 0.0), axis=0)
    tl.store(row + 7, tl.where(abs_sum != abs_sum, abs_sum, abs_max))
    tl.store(row + 8, tl.sum(tl.where(keep & truncated, m, 0.0), axis=0))
    tl.store(row + 9, tl.sum(tl.where(keep & clipped, m, 0.0), axis=0))
    tl.store(row + 10, tl.sum(tl.where(keep & masked, m, 0.0), axis=0))
    tl.store(row + 11, tl.sum(tl.where(keep, ent * m, 0.0), axis=0))
    tl.store(row + 12, tl.sum(tl.where(keep, ref_k3 * m, 0.0), axis=0))
    tl.store(row + 13, 0.0)  # the row's unused slots, written: the launcher sums whole rows
    tl.store(row + 14, 0.0)
    tl.store(row + 15, 0.0)
