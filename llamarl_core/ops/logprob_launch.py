"""Launchers of the log-prob kernels (kernels/logprob.py) and their torch CPU
path: logprob_forward / logprob_backward take 2-D logits and flat per-token
tensors and run the Triton kernels (CUDA tensors, or CPU tensors under
TRITON_INTERPRET=1) or the chunked torch path; the launch configs, their GPU
table and every variant a GPU compiles (kernel_variants). The op built on them
is ops/logprob.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch

from ._launch import KernelLaunch, next_pow2, use_interpreter
from .aipo_inputs import IGNORE_INDEX

# ----------------------------------------------------------------------------- launchers


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _use_triton(logits: torch.Tensor) -> bool:
    """Triton for CUDA tensors, and for CPU tensors under TRITON_INTERPRET=1."""
    return logits.device.type == "cuda" or (logits.device.type == "cpu" and use_interpreter())


@dataclass(frozen=True)
class LogprobConfig:
    """Launch shape of a log-prob kernel: a program takes `rows` token rows and
    walks the vocabulary in `block_v` blocks with `num_warps` warps. The backward
    splits each row's vocabulary over several programs (a second grid axis) until
    the grid has `min_programs` programs (0: one program per `rows` rows); the
    forward ignores min_programs."""

    block_v: int
    rows: int
    num_warps: int
    min_programs: int = 0


# On a GPU, (largest vocabulary, forward, backward) by vocabulary; each config is
# one compiled variant per dtype, so kernel_variants() compiles every row. Memory
# bound: the aim is enough bytes in flight per SM (by Little's law an H100 needs
# about 16 KiB: 23 GB/s a SM times ~0.7 us of latency) with registers left for
# 64 warps. Chosen from registers (kernel_check) and that estimate, not yet timed:
# - Forward: per-lane accumulators cost 2 registers (3 with the entropy) per value
#   a thread holds; 2048 x 8 warps: 8 bf16 values (one 16-byte load) a thread, 32
#   registers on sm_90, 8 programs = 64 warps a SM, 32 KiB of loads in flight.
# - Backward: no accumulators; 8192 x 16 warps: two 16-byte loads a thread;
#   min_programs 8192, so short batches (a linear_aipo_loss chunk) still fill the
#   GPU and the last wave is a small part.
# On an H100 (`--gpu-sweep`, 4096 x 128256 bf16): forward 2048 x 8 warps 0.97x of
# a device copy of its bytes, the best of 11 shapes; backward 8192 x 16 warps,
# >= 8192 programs, 0.96x (the 4096 x 8 warps it replaced: 0.94x).
# - Vocabularies up to 8192: 2 or 4 rows a program, 8 values a thread (4 rows of
#   1024 had ptxas spill a register on sm_80 / sm_90).
# `python -m llamarl_core.bench.bench_aipo --gpu-sweep` times the large-vocabulary
# configs beside other candidates.
GPU_CONFIGS = (
    (1024, LogprobConfig(block_v=256, rows=4, num_warps=4), LogprobConfig(block_v=256, rows=4, num_warps=4)),
    (8192, LogprobConfig(block_v=1024, rows=2, num_warps=8), LogprobConfig(block_v=1024, rows=2, num_warps=8)),
    (None, LogprobConfig(block_v=2048, rows=1, num_warps=8),
     LogprobConfig(block_v=8192, rows=1, num_warps=16, min_programs=8192)),
)


def logprob_configs(vocab: int, num_rows: int, on_gpu: bool) -> tuple[LogprobConfig, LogprobConfig]:
    """(forward, backward) configs: the GPU table's row for `vocab`. In the
    interpreter, where each program instance costs about 0.5 ms (V=32000 over 64
    rows: 0.16 s at BLOCK_V=32768, 2.8 s at 1024), few large programs: two
    vocabulary blocks a row (so the loop runs more than once) and up to 32768
    elements a program."""
    if on_gpu:
        return next((fwd, bwd) for limit, fwd, bwd in GPU_CONFIGS if limit is None or vocab <= limit)
    block = min(16384, max(16, next_pow2(vocab) // 2))
    config = LogprobConfig(block, min(next_pow2(num_rows), max(1, 32768 // block)), 4)
    return config, config


def _forward_launch(logits, targets, lse, logp, ent, temperature: float, config: LogprobConfig) -> KernelLaunch:
    from llamarl_core.kernels.logprob import logprob_fwd_kernel

    n, v = logits.shape
    return KernelLaunch(
        logprob_fwd_kernel, (_cdiv(n, config.rows),),
        dict(logits_ptr=logits, targets_ptr=targets, lse_ptr=lse, logp_ptr=logp,
             entropy_ptr=ent if ent is not None else lse, num_rows=n, vocab=v, stride_row=logits.stride(0),
             inv_temperature=1.0 / temperature),
        dict(IGNORE_INDEX=IGNORE_INDEX, BLOCK_V=config.block_v, ROWS=config.rows, COMPUTE_ENTROPY=ent is not None),
        config.num_warps)


def _backward_launch(logits, dlogits, targets, lse, coef, temperature: float, config: LogprobConfig, entropy=None,
                     grad_entropy=None) -> KernelLaunch:
    from llamarl_core.kernels.logprob import logprob_bwd_kernel

    n, v = logits.shape
    row_programs = _cdiv(n, config.rows)
    num_blocks = max(1, _cdiv(v, config.block_v))
    splits = min(num_blocks, max(1, _cdiv(config.min_programs, row_programs)))
    cols_per_program = _cdiv(num_blocks, splits) * config.block_v
    return KernelLaunch(
        logprob_bwd_kernel, (row_programs, max(1, _cdiv(v, cols_per_program))),
        dict(logits_ptr=logits, dlogits_ptr=dlogits, targets_ptr=targets, lse_ptr=lse, coef_ptr=coef,
             entropy_ptr=lse if entropy is None else entropy,
             grad_entropy_ptr=coef if grad_entropy is None else grad_entropy, num_rows=n, vocab=v,
             stride_row=logits.stride(0), stride_drow=dlogits.stride(0), inv_temperature=1.0 / temperature,
             cols_per_program=cols_per_program),
        dict(BLOCK_V=config.block_v, ROWS=config.rows, ENTROPY_GRAD=grad_entropy is not None), config.num_warps)


def logprob_launches(logits, targets, lse, logp, ent, coef, dlogits, temperature: float, forward: LogprobConfig,
                     backward: LogprobConfig, grad_entropy=None) -> tuple[KernelLaunch, KernelLaunch]:
    """The forward and backward KernelLaunch of these configs on these tensors
    (CUDA ones to time, CPU ones to compile): how kernel_variants(), the tests and
    the GPU sweep (bench_aipo --gpu-sweep) reach any config. grad_entropy: the
    backward takes the entropy's gradient too (with ent, the entropies)."""
    return (_forward_launch(logits, targets, lse, logp, ent, temperature, forward),
            _backward_launch(logits, dlogits, targets, lse, coef, temperature, backward, ent if grad_entropy is not None
                             else None, grad_entropy))


def kernel_variants() -> list[tuple[str, KernelLaunch]]:
    """Every (kernel, constexprs, argument types) the launchers can launch on a
    GPU, on small CPU tensors standing in for CUDA ones: what a GPU must compile.
    Each GPU_CONFIGS row in every dtype, forward and backward each with and
    without the entropy (its value; its gradient);
    for bf16 also a vocabulary that is not a multiple of 16 (the JIT's divisibility
    hint on the row stride, which gives 16-byte loads)."""
    variants = []
    cases = [(dtype, limit, fwd, bwd) for dtype in (torch.bfloat16, torch.float16, torch.float32)
             for limit, fwd, bwd in GPU_CONFIGS]
    cases.append((torch.bfloat16, 32001, *GPU_CONFIGS[-1][1:]))
    for dtype, limit, fwd, bwd in cases:
        vocab = limit if limit is not None else 128256
        logits = torch.empty((4, vocab), dtype=dtype)
        targets = torch.empty(4, dtype=torch.int64)
        lse, logp, ent = (torch.empty(4, dtype=torch.float32) for _ in range(3))
        tag = f"{str(dtype).removeprefix('torch.')}, vocab {vocab}"
        for entropy in (False, True):
            forward, backward = logprob_launches(logits, targets, lse, logp, ent if entropy else None, logp,
                                                 torch.empty_like(logits), 0.7, fwd, bwd, lse if entropy else None)
            variants.append((f"logprob forward, {tag}{', entropy' if entropy else ''}", forward))
            variants.append((f"logprob backward, {tag}{', entropy gradient' if entropy else ''}", backward))
    return variants


def _run(launch: KernelLaunch, device: torch.device) -> None:
    """launch.launch(device); in the interpreter with numpy's floating-point
    warnings off, as on a GPU: the kernels overflow to -inf and take exp2(-inf) = 0
    on purpose (kernels/logprob.py)."""
    if device.type != "cpu":
        launch.launch(device)
        return
    with numpy.errstate(over="ignore", divide="ignore", invalid="ignore"):
        launch.launch(device)


def logprob_forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool,
                    scratch: torch.Tensor | None = None):
    """(lse, logp, entropy or None), float32 (num_tokens,), for 2-D contiguous-row
    logits. scratch: an optional float32 buffer of at least one CPU chunk, reused.
    A row of -inf only has lse = -inf, log-prob NaN (0 for an ignored token) and
    entropy NaN; a target outside [0, vocab) other than IGNORE_INDEX a NaN
    log-prob (never a read outside the row)."""
    n, v = logits.shape
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    logp = torch.empty_like(lse)
    ent = torch.empty_like(lse) if entropy else None
    if n == 0:
        return lse, logp, ent
    if _use_triton(logits):
        on_gpu = logits.device.type == "cuda"
        config = logprob_configs(v, n, on_gpu)[0]
        _run(_forward_launch(logits, targets, lse, logp, ent, temperature, config), logits.device)
        return lse, logp, ent
    _cpu_forward(logits, targets, 1.0 / temperature, lse, logp, ent, scratch)
    return lse, logp, ent


def logprob_backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor,
                     temperature: float, out: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                     grad_entropy: torch.Tensor | None = None) -> torch.Tensor:
    """dlogits = (coef_t * (onehot(y_t) - p_t) - g_t * p_t * (log p_t + H_t)) /
    temperature, in logits' dtype, with p_t = softmax(logits_t / temperature)
    (from lse), H_t its entropy (`entropy`) and g_t = grad_entropy (that term
    only when grad_entropy is given). out: where to write it (may be `logits`
    itself: every element is read before it is written). A row of -inf only (lse
    = -inf) gets coef_t at its target and 0 elsewhere. A target outside [0,
    vocab) (IGNORE_INDEX, or another shard's) gets no one-hot term."""
    n, v = logits.shape
    dlogits = torch.empty_like(logits) if out is None else out
    if n == 0:
        return dlogits
    coef = coef.to(torch.float32).contiguous()
    if grad_entropy is not None:
        grad_entropy = grad_entropy.to(torch.float32).contiguous()
    if _use_triton(logits):
        on_gpu = logits.device.type == "cuda"
        config = logprob_configs(v, n, on_gpu)[1]
        _run(_backward_launch(logits, dlogits, targets, lse, coef, temperature, config, entropy, grad_entropy),
             logits.device)
        return dlogits
    _cpu_backward(logits, targets, lse, coef, 1.0 / temperature, dlogits, entropy, grad_entropy)
    return dlogits


# ----------------------------------------------------------------------------- torch CPU path

# Rows per chunk: about 16 Mi float32 values (64 MiB) of scratch, reused across
# chunks: a fresh buffer per chunk costs its page faults every time (a 128 MiB
# copy into new memory runs at about 3 GB/s here, into reused memory far faster).
_CHUNK_ELEMS = 1 << 24


def _row_chunks(n: int, v: int):
    step = max(1, _CHUNK_ELEMS // max(v, 1))
    return [slice(s, min(n, s + step)) for s in range(0, n, step)]


def _scratch(n: int, v: int, device, scratch: torch.Tensor | None) -> torch.Tensor:
    rows = min(n, max(1, _CHUNK_ELEMS // max(v, 1)))
    if scratch is not None and scratch.dtype == torch.float32 and scratch.numel() >= rows * v:
        return scratch.view(-1)[: rows * v].view(rows, v)
    return torch.empty((rows, v), dtype=torch.float32, device=device)


def _cpu_forward(logits, targets, inv_t: float, lse, logp, ent, scratch) -> None:
    """Per chunk: max, exp(x / T - max) into the scratch buffer, sum -> lse; the
    target's log-prob; optionally the entropy."""
    n, v = logits.shape
    buf_all = _scratch(n, v, logits.device, scratch)
    for rows in _row_chunks(n, v):
        x = logits[rows]
        buf = buf_all[: x.shape[0]]
        if x.dtype == torch.float32:
            torch.mul(x, inv_t, out=buf)
        else:  # upcast first: a bf16 tensor times a Python float is computed in bf16
            buf.copy_(x).mul_(inv_t)
        row_max = buf.amax(dim=-1)
        safe_max = torch.where(row_max == float("-inf"), 0.0, row_max)  # rows of -inf only
        buf.sub_(safe_max.unsqueeze(-1)).exp_()
        total = buf.sum(dim=-1)
        chunk_lse = safe_max + total.log()
        lse[rows] = chunk_lse
        chunk_targets = targets[rows]
        valid = chunk_targets != IGNORE_INDEX
        in_row = (chunk_targets >= 0) & (chunk_targets < v)
        picked = x.gather(-1, torch.where(in_row, chunk_targets, 0).unsqueeze(-1)).squeeze(-1).to(torch.float32) * inv_t
        logp[rows] = torch.where(valid, torch.where(in_row, picked - chunk_lse, float("nan")), 0.0)
        if ent is not None:  # H = lse - sum(p * x / T); p * x is 0 where p is (x = -inf)
            weighted = torch.where(buf > 0, buf * x.to(torch.float32), 0.0).sum(dim=-1) * inv_t
            ent[rows] = chunk_lse - weighted / total


def _cpu_backward(logits, targets, lse, coef, inv_t: float, dlogits, entropy, grad_entropy) -> None:
    """Per chunk: p = exp(x / T - lse), -p * (coef + g * (log p + H)) / T (the
    entropy term with grad_entropy g), plus coef / T at the target, written
    straight into float32 dlogits (through the scratch buffer otherwise)."""
    n, v = logits.shape
    direct = dlogits.dtype == torch.float32
    buf_all = None if direct else _scratch(n, v, logits.device, None)
    # A row of -inf only (lse = -inf): exp(-inf - inf) = 0 rather than exp(-inf + inf) = NaN, as the kernel.
    neg_lse = torch.where(lse == float("-inf"), float("-inf"), -lse)
    for rows in _row_chunks(n, v):
        x = logits[rows]
        out = dlogits[rows] if direct else buf_all[: x.shape[0]]
        torch.add(neg_lse[rows].unsqueeze(-1), x, alpha=inv_t, out=out)
        if grad_entropy is None:
            out.exp_().mul_((-coef[rows] * inv_t).unsqueeze(-1))
        else:  # log p + H, then coef + g (log p + H), then times -p / T; p = 0 (x = -inf) gives 0
            factor = (out + entropy[rows].unsqueeze(-1)).mul_(grad_entropy[rows].unsqueeze(-1))
            factor.add_(coef[rows].unsqueeze(-1))
            out.exp_()
            out.mul_(torch.where(out > 0, factor, 0.0)).mul_(-inv_t)
        chunk_targets = targets[rows]
        tokens = torch.nonzero((chunk_targets >= 0) & (chunk_targets < v)).squeeze(-1)
        out[tokens, chunk_targets[tokens]] += coef[rows][tokens] * inv_t
        if not direct:
            dlogits[rows] = out
