"""The inputs of the AIPO losses (ops/aipo.py): their rules, checked before any
kernel runs, and what they become: flat per-token tensors and the weight of each
token in the reduced loss.

Shapes. The targets have the leading shape of the logits (or hidden states):
- flat, (num_tokens,): a token list;
- batched, (..., T) with two or more dims, typically (B, T): each row (an index
  of the dims before T) is one sample, padded to T tokens.
behavior_logprobs, mask, old_logprobs, ref_logprobs and sequence_ids are per
token, in the targets' shape. advantages too, or, batched, one per row: shape
(B,) or (B, 1) (in general lead[:-1] or (*lead[:-1], 1)), broadcast over the
row's tokens. Any other shape raises ValueError naming it.

Which tokens count. A token counts where its mask is not 0 and its target is
not IGNORE_INDEX. Elsewhere its target is never checked nor read (any integer,
out of range included: the pad id of another vocabulary, -1), its log-prob is
0, and whatever its behaviour, old and reference log-probs and advantage hold
(NaN and inf included) it adds nothing to the loss, the gradients or the stats:
its dlogits are exactly 0 wherever its logits are finite or -inf. A counted
token's target outside [0, vocab) raises ValueError naming its position.

Sequences, for reduction="sequence_mean" and the sequence-level objectives
(seq_tis, seq_mis, geo_mask, gspo): flat inputs need sequence_ids (tokens with
one id are one sequence); batched inputs without sequence_ids have one sequence
a row; batched sequence_ids (packed rows) make a sequence of the tokens of one
row with one id (ids need only be unique within a row; a sequence never spans
rows). A sequence's sums (s_i, n_i) run over its counted tokens; the mask's
value weighs a token in the reduction only.

Log-probs (behavior_logprobs, old_logprobs, ref_logprobs). behavior_logprobs
None: the tokens were sampled by the learner itself (on-policy): its own
log-probs, detached, take their place, so every ratio to them is 1 and no pass
computes them. old_logprobs None, for the objectives that read them: the same
(one optimizer step per batch; a second step on the same batch needs the old
policy's). A counted token's log-prob that is not finite (NaN, +-inf: a
generator that could not score it) raises ValueError naming the argument and
position with nonfinite_logprobs="raise" (the default); with "mask" the token
does not count, as if its mask were 0. A counted log-prob above
LOGPROB_SLACK (1e-3, far beyond float rounding) raises ValueError: a
log-probability is <= 0 (probabilities passed as log-probs?).

Advantages and mask. A counted token's advantage that is not finite raises
ValueError naming its position; so does a mask value that is not finite or is
negative on a token whose target is not IGNORE_INDEX (a weight, never a sign).
sequence_ids must be integers (float ids would be truncated into one sequence).

Normalizer: None (the reduction's own denominator), a positive number
(Dr.GRPO's constant) or a one-element tensor (a token or sequence count of the
whole batch, across micro-batches and data-parallel ranks), replacing the token
count of "token_mean" / "sum" and the sequence count of "sequence_mean".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy
import torch

from .objectives import OLD_POLICY_TYPES, SEQUENCE_TYPES, Objective, Sequences

IGNORE_INDEX = -100
REDUCTIONS = ("token_mean", "sequence_mean", "sum")
NONFINITE = ("raise", "mask")
# The most a log-prob may exceed 0 by: float32 rounding of log_softmax is ~1e-7, a
# probability in (0, 1] passed as a log-prob is mostly far above.
LOGPROB_SLACK = 1e-3


def check_kl(kl_coef: float, ref_logprobs: torch.Tensor | None) -> None:
    if not (math.isfinite(kl_coef) and kl_coef >= 0):
        raise ValueError(f"kl_coef must be finite and >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs (the reference policy's log-probs, per token)")


def check_old(loss_type: str, old: torch.Tensor | None) -> None:
    """old_logprobs only for the objectives that read them (None there: on-policy,
    module docstring): an objective whose weights come from the behaviour
    log-probs alone would ignore them (verl and TRL users port weights computed
    from old / rollout)."""
    if loss_type not in OLD_POLICY_TYPES and old is not None:
        raise ValueError(f'loss_type="{loss_type}" does not read old_logprobs (its weights come from the learner '
                         f"and behaviour log-probs; {', '.join(OLD_POLICY_TYPES)} read them)")


def check_normalizer(normalizer, device) -> torch.Tensor | float | None:
    """normalizer as the reductions take it: None, a positive finite number, or a
    0-dim tensor (moved to `device`; its value is not checked, which would cost a
    host sync: a global token count all-reduced on the GPU stays there)."""
    if normalizer is None:
        return None
    if isinstance(normalizer, torch.Tensor):
        if normalizer.numel() != 1 or normalizer.dtype == torch.bool:
            raise ValueError(f"normalizer must be a number or a one-element tensor, got shape "
                             f"{tuple(normalizer.shape)} {normalizer.dtype}")
        return normalizer.reshape(()).to(device=device, dtype=torch.float32)
    if isinstance(normalizer, bool) or not isinstance(normalizer, (int, float)) or \
            not (math.isfinite(normalizer) and normalizer > 0):
        raise ValueError(f"normalizer must be a positive finite number or a tensor, got {normalizer!r}")
    return float(normalizer)


def check_target_ids(targets: torch.Tensor) -> None:
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")


def check_logits(logits: torch.Tensor) -> None:
    """ValueError unless logits are (num_tokens, vocab) or (..., vocab) in a float dtype the kernels take."""
    if logits.dim() < 2 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be (num_tokens, vocab) or (..., vocab) with vocab >= 1, got shape "
                         f"{tuple(logits.shape)}")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"logits dtype must be bfloat16, float16 or float32, got {logits.dtype}")


def flat_logits(logits: torch.Tensor) -> torch.Tensor:
    """logits (num_tokens, vocab) or (..., vocab) as 2-D rows with unit column
    stride (a copy only where no such view exists, e.g. logits[:, :-1] of (B, T, V))."""
    check_logits(logits)
    flat = logits.reshape(-1, logits.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _per_token(t: torch.Tensor | None, what: str, shape: torch.Size, device, dtype=torch.float32):
    """t (of the targets' shape) as a flat (num_tokens,) tensor of `dtype` on `device`,
    detached (gradients flow to the logits only, on every path); None stays None."""
    if t is None:
        return None
    if t.shape != shape:
        raise ValueError(f"{what} must have shape {tuple(shape)} (the logits' leading dims), got {tuple(t.shape)}")
    return t.detach().reshape(shape.numel()).to(device=device, dtype=dtype)


def per_token_advantages(advantages: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """advantages in the targets' shape: as given when they have it; batched
    (shape (..., T), 2+ dims), one per row, of shape shape[:-1] or
    (*shape[:-1], 1), expanded over the row's T tokens. ValueError otherwise."""
    if advantages.shape == shape:
        return advantages
    rows = shape[:-1]
    if len(shape) >= 2 and advantages.shape in (rows, (*rows, 1)):
        return advantages.reshape(*rows, 1).expand(shape)
    per_row = f", {tuple(rows)} or {(*rows, 1)} (one per row)" if len(shape) >= 2 else ""
    raise ValueError(f"advantages must have shape {tuple(shape)} (the logits' leading dims){per_row}, "
                     f"got {tuple(advantages.shape)}")


def _dense_sequences(ids: torch.Tensor, row: torch.Tensor | None) -> Sequences:
    """Tokens with one key (their id, or (row, id)) as one sequence, on the
    device: the tokens sorted by key (stable sorts, by id then by row), a new
    sequence where the key changes (a cumulative sum of those flags), the dense
    indices scattered back to the tokens. count is the number of tokens, an upper
    bound on the sequences (the slots past the last one stay empty): torch.unique
    would count them exactly, but its output's size is data-dependent, read on
    the host, a sync on a GPU."""
    n = ids.numel()
    order = torch.argsort(ids, stable=True)
    if row is not None:
        order = order[torch.argsort(row[order], stable=True)]
    sorted_ids = ids[order]
    new = sorted_ids[1:] != sorted_ids[:-1]
    if row is not None:
        sorted_rows = row[order]
        new = new | (sorted_rows[1:] != sorted_rows[:-1])
    dense = torch.cat((new.new_zeros(min(n, 1)), new)).to(torch.int64).cumsum(0)
    return Sequences(torch.empty_like(dense).scatter_(0, order, dense), n)


def sequence_index(sequence_ids: torch.Tensor | None, shape: torch.Size, needed: str | None,
                   device) -> Sequences | None:
    """Each token's sequence (ops/objectives.Sequences), or None where it cannot
    be known without sequence_ids (flat inputs) and `needed` is None; `needed`
    names what needs them, for the error. sequence_ids, when given, must have
    the targets' shape. Flat: tokens with one id are one sequence. Batched (...,
    T): one sequence a row without sequence_ids; with them, the tokens of one
    row with one id. No host sync either way (_dense_sequences)."""
    if sequence_ids is not None and (sequence_ids.dtype.is_floating_point or sequence_ids.dtype.is_complex):
        raise ValueError(f"sequence_ids must be integer ids, got {sequence_ids.dtype}")
    ids = _per_token(sequence_ids, "sequence_ids", shape, device, torch.int64)
    if len(shape) < 2:
        if ids is None:
            if needed is None:
                return None
            raise ValueError(f"{needed} on flat inputs needs sequence_ids (num_tokens,); batched (B, T) inputs "
                             "have one sequence a row")
        return _dense_sequences(ids, None)
    num_rows, length = shape[:-1].numel(), shape[-1]
    row = torch.arange(num_rows, device=device).repeat_interleave(length)
    if ids is None:
        return Sequences(row, num_rows)
    return _dense_sequences(ids, row)


def reduction_weights(m: torch.Tensor, reduction: str, sequences: Sequences | None,
                      normalizer: torch.Tensor | float | None = None) -> torch.Tensor:
    """Per-token weights (num_tokens,) turning per-token losses into the reduced
    loss: m ("sum"), m / sum(m) ("token_mean"), m / (the mask's sum over the
    token's sequence * the number of sequences with a token counted)
    ("sequence_mean"). A normalizer replaces the denominator that is not the
    sequence's own: m / normalizer ("token_mean", "sum"), m / (the sequence's
    sum * normalizer) ("sequence_mean"), so that micro-batches each divided by
    the whole batch's count add up to the whole batch's loss. 0 where no token
    counts."""
    if reduction == "sum" and normalizer is None:
        return m
    # Selected on the device (0 / 0 where no token counts), not by a host-side `if`: no host sync.
    if reduction in ("token_mean", "sum"):
        total = m.sum() if normalizer is None else normalizer
        return torch.where(m != 0, m / total, 0.0)
    counts = sequences.sum(m)
    per_token = counts[sequences.index]
    counted = per_token > 0
    denominator = (counts > 0).sum() if normalizer is None else normalizer
    return torch.where(counted, m / (torch.where(counted, per_token, 1.0) * denominator), 0.0)


def check_shard_sizes(sizes: list[int]) -> None:
    """ValueError unless every rank of a vocabulary group holds one shard size
    (`sizes`: the columns of each rank, by rank)."""
    if len(set(sizes)) > 1:
        raise ValueError(f"vocabulary shards must have one size on every rank of process_group (Megatron pads the "
                         f"vocabulary to a multiple of the group's size), got {sizes} columns by rank")


def check_nonfinite(nonfinite_logprobs: str) -> None:
    if nonfinite_logprobs not in NONFINITE:
        raise ValueError(f"nonfinite_logprobs must be one of {NONFINITE}, got {nonfinite_logprobs!r}")


class _DeferredRead:
    """int64 numbers computed on the device, read on the host: on CPU at once; on
    a GPU copied to pinned memory without blocking, read by get() after the
    caller has queued its kernels (one wait, for that copy alone)."""

    def __init__(self, info: torch.Tensor):
        self.event = None
        if info.device.type != "cuda":
            self.info = info
            return
        self.info = torch.empty(info.numel(), dtype=torch.int64, pin_memory=True)
        self.info.copy_(info, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(info.device))  # the copy's stream

    def get(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.info.tolist()


def _skipped(t: torch.Tensor) -> bool:
    """Whether a host read must not happen: under torch.compile or CUDA graph capture."""
    return (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()) or torch.compiler.is_compiling()


def _first_bad(bad: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
    """[whether any is bad, the first bad one's index, its value], one-element
    tensors computed without a host sync: argmax returns the first maximum, and
    gather, not values[first] (indexing with a tensor reads the index on the host)."""
    first = bad.to(torch.uint8).argmax().view(1)
    return [bad.any().to(torch.int64).view(1), first, values.gather(0, first)]


def _position(index: int, shape: tuple) -> str:
    return ", ".join(str(int(i)) for i in numpy.unravel_index(index, shape))


class ValueCheck:
    """The value rules of the module docstring, read after the op as
    TargetCheck's on a GPU (queued first, one wait after the kernels), on CPU
    too, so that a bad target is named first everywhere; skipped under
    torch.compile or graph capture, where a NaN then reaches the loss: a counted
    token's log-probs (finite unless nonfinite_logprobs="mask", <= LOGPROB_SLACK)
    and advantage (finite); the mask of a token whose target is not IGNORE_INDEX
    (finite, >= 0). wait() raises ValueError naming the first argument and
    position that breaks one."""

    def __init__(self, logprobs: dict[str, torch.Tensor | None], advantages: torch.Tensor,
                 mask: torch.Tensor | None, counted: torch.Tensor, targeted: torch.Tensor, shape: torch.Size,
                 nonfinite_logprobs: str, advantages_shape: torch.Size | None = None):
        self.checks, self.shape, self.read = [], tuple(shape), None
        if counted.numel() == 0 or _skipped(counted):
            return
        parts = []

        def add(name: str, bad: torch.Tensor, x: torch.Tensor, rule, given_shape=None) -> None:
            is_bad, first, value = _first_bad(bad, x)
            parts.extend([is_bad, first, value.to(torch.float64).view(torch.int64)])  # the value's bits, read back
            self.checks.append((name, rule, given_shape))

        if mask is not None:
            add("mask", targeted & ~(torch.isfinite(mask) & (mask >= 0)), mask,
                lambda value: ": a token's weight must be finite and >= 0")
        add("advantages", counted & ~torch.isfinite(advantages), advantages,
            lambda value: ": an advantage must be finite on a token that counts", advantages_shape)
        for name, x in logprobs.items():
            if x is None:
                continue
            bad = counted & torch.isfinite(x) & (x > LOGPROB_SLACK)
            if nonfinite_logprobs == "raise":
                bad = bad | (counted & ~torch.isfinite(x))
            add(name, bad, x, lambda value: ": a log-probability is <= 0 (probabilities passed as log-probs?)"
                if math.isfinite(value) else " on a token that counts (nonfinite_logprobs=\"mask\" leaves such "
                                             "tokens out)")
        self.read = _DeferredRead(torch.cat(parts))

    def wait(self) -> None:
        if self.read is None:
            return
        info = self.read.get()
        for i, (name, rule, given_shape) in enumerate(self.checks):
            is_bad, index, bits = info[3 * i : 3 * i + 3]
            if not is_bad:
                continue
            value = float(numpy.array(bits, dtype=numpy.int64).view(numpy.float64))
            if given_shape is None or tuple(given_shape) == self.shape:
                position = _position(index, self.shape)
            else:  # one a row: the row, as given ((..., B) or (..., B, 1))
                row = _position(index // self.shape[-1], self.shape[:-1])
                position = row if len(given_shape) == len(self.shape) - 1 else f"{row}, 0"
            raise ValueError(f"{name}[{position}] = {value}{rule(value)}")


class TargetCheck:
    """Whether every target is IGNORE_INDEX or in [0, vocab), checked where the
    targets are; wait() raises ValueError naming the first one that is not, by
    its position in `shape` (targets[b, t] for batched inputs). shard_sizes: the
    vocabulary shards' sizes gathered on the GPU (logprob.check_equal_shards),
    checked in the same read, before the targets.

    On a GPU the check is queued first and its numbers (bad?, index, value, the
    shard sizes) copied to pinned host memory without blocking; the loss queues
    its kernels, then wait() waits for that copy alone, while the GPU goes on
    with the kernels. That wait is the one host sync of a loss call in eager
    mode: the error must come from the call that got the bad index, named, not
    from a later sync. Queuing the kernels first is safe: they never read at a
    target outside [0, vocab), and with unequal shards every tensor the ranks
    exchange still has one shape on every rank, so none is left waiting before
    each raises. On CPU the check runs at once (the torch path's gather would
    fail first). Under torch.compile or CUDA graph capture, where no host sync
    may happen, it does nothing: the kernels give such a target a NaN log-prob
    instead."""

    def __init__(self, targets: torch.Tensor, vocab: int, shape: torch.Size,
                 shard_sizes: torch.Tensor | None = None):
        self.vocab, self.shape, self.read = vocab, tuple(shape), None
        if (targets.numel() == 0 and shard_sizes is None) or _skipped(targets):
            return
        if targets.numel():
            parts = _first_bad((targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab)), targets)
        else:
            parts = [torch.zeros(3, dtype=torch.int64, device=targets.device)]
        if shard_sizes is not None:
            parts.append(shard_sizes.reshape(-1).to(device=targets.device, dtype=torch.int64))
        self.read = _DeferredRead(torch.cat(parts))
        if targets.device.type != "cuda":
            self.wait()

    def wait(self) -> None:
        if self.read is None:
            return
        is_bad, index, value, *shard_sizes = self.read.get()
        check_shard_sizes(shard_sizes)
        if is_bad:
            raise ValueError(f"targets[{_position(index, self.shape)}] = {value} is outside [0, {self.vocab}) "
                             f"(ignore index: {IGNORE_INDEX}; a token whose mask is 0 is never checked)")


@dataclass
class TokenInputs:
    """A loss call's inputs, checked: flat (num_tokens,) tensors on the logits'
    device. behavior, advantages, old and ref are 0 wherever a token does not
    count, so that whatever they held there (NaN, inf) reaches no gradient."""

    targets: torch.Tensor  # int64; IGNORE_INDEX wherever the token does not count
    behavior: torch.Tensor | None  # float32, as are the others; None: on-policy (the learner's own)
    advantages: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None
    mask: torch.Tensor  # the mask, 0 wherever the token does not count
    weights: torch.Tensor  # reduction_weights
    sequences: Sequences | None  # each token's sequence, where known
    shape: torch.Size  # the targets' shape, that of per-token outputs
    check: ValueCheck  # waited for once the op's kernels are queued

    @property
    def counted(self) -> torch.Tensor:
        return self.mask != 0


def prepare_inputs(shape: torch.Size, device, targets, behavior, advantages, mask, old, ref,
                   sequence_ids, cfg: Objective, reduction: str, normalizer=None,
                   nonfinite_logprobs: str = "raise") -> TokenInputs:
    """Check every input against the rules of the module docstring (shape: the
    logits' leading dims) and flatten them; nothing runs on a bad one (on a GPU
    the log-probs' values are read once the op's kernels are queued:
    TokenInputs.check). The targets' range is the op's to check (TargetCheck)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check_kl(cfg.kl_coef, ref)
    check_old(cfg.loss_type, old)
    check_nonfinite(nonfinite_logprobs)
    normalizer = check_normalizer(normalizer, device)
    check_target_ids(targets)
    targets = _per_token(targets, "targets", shape, device, torch.int64)
    given_mask = _per_token(mask, "mask", shape, device)
    targeted = targets != IGNORE_INDEX
    m = torch.where(targeted, torch.ones(shape.numel(), device=device) if mask is None else given_mask, 0.0)
    logprobs = {"behavior_logprobs": _per_token(behavior, "behavior_logprobs", shape, device),
                "old_logprobs": _per_token(old, "old_logprobs", shape, device),
                "ref_logprobs": _per_token(ref, "ref_logprobs", shape, device)}
    advantages_shape = advantages.shape
    advantages = _per_token(per_token_advantages(advantages, shape), "advantages", shape, device)
    if nonfinite_logprobs == "mask":
        for x in logprobs.values():
            if x is not None:
                m = torch.where(torch.isfinite(x), m, 0.0)
    counted = m != 0
    targets = torch.where(counted, targets, IGNORE_INDEX)

    def per_token(flat):
        return None if flat is None else torch.where(counted, flat, 0.0)

    behavior, old, ref = (per_token(logprobs[k]) for k in ("behavior_logprobs", "old_logprobs", "ref_logprobs"))
    raw_advantages, advantages = advantages, per_token(advantages)
    needed = (f'loss_type="{cfg.loss_type}"' if cfg.loss_type in SEQUENCE_TYPES
              else 'reduction="sequence_mean"' if reduction == "sequence_mean" else None)
    sequences = sequence_index(sequence_ids, shape, needed, device)
    weights = reduction_weights(m, reduction, sequences, normalizer)
    check = ValueCheck(logprobs, raw_advantages, given_mask, counted, targeted, shape, nonfinite_logprobs,
                       advantages_shape)  # every shape checked first
    return TokenInputs(targets, behavior, advantages, old, ref, m, weights, sequences, shape, check)
