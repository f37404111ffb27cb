"""Advantage estimators: per-sample advantages from the rewards of a trainer
step's samples and the prompt group each answers.

An estimator is `fn(rewards, group_ids) -> advantages`: rewards float32 (N,),
group_ids int64 (N,) (the samples of a group share a prompt; every group of the
step is whole), advantages (N,) of finite floats. Each sample's advantage goes
on every one of its completion tokens. Built in (TrainConfig.advantage):
    group_mean      A_i = r_i - mean(r over i's group)                   (AIPO, Dr.GRPO)
    group_mean_std  A_i = (r_i - mean) / (std + 1e-6), std the group's sample
                    standard deviation (n - 1)                            (GRPO)
    rloo            A_i = r_i - mean(r over the other samples of i's group)
                        = n / (n - 1) * (r_i - mean)                      (RLOO)
or a function of yours, `module:function` (or the function itself in Python).
Dr.GRPO also drops the per-token mean of the loss for a constant: see
LossConfig.normalizer (TrainConfig(loss_normalizer=...)).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ops.aipo import group_advantages
from .plugins import builtin_or_load, check_arity

AdvantageFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def group_mean(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    return group_advantages(rewards, group_ids)


def group_mean_std(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    return group_advantages(rewards, group_ids, normalize_std=True)


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    _, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n = counts[index].to(torch.float32)
    if bool((n < 2).any()):
        alone = sorted(set(group_ids[n < 2].tolist()))
        raise ValueError(f"rloo: groups {alone} have one sample; leave-one-out needs at least 2 per group")
    return group_advantages(rewards, group_ids) * n / (n - 1)


ADVANTAGES: dict[str, AdvantageFn] = {"group_mean": group_mean, "group_mean_std": group_mean_std, "rloo": rloo}




def compute_advantages(fn: AdvantageFn, rewards: torch.Tensor, group_ids: torch.Tensor, what: str) -> torch.Tensor:
    """fn(rewards, group_ids) as float32 (N,); ValueError naming `what` when it
    returns anything but N finite numbers."""
    out = fn(rewards, group_ids)
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"advantage {what} returned a {type(out).__name__}, not a tensor of {len(rewards)} advantages")
    if out.shape != rewards.shape or not out.is_floating_point():
        raise ValueError(f"advantage {what} returned {out.dtype} of shape {tuple(out.shape)} for rewards of shape "
                         f"{tuple(rewards.shape)}; one float per sample expected")
    out = out.detach().to(torch.float32)
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"advantage {what} returned non-finite advantages {out.tolist()} for rewards "
                         f"{rewards.tolist()}")
    return out


def advantage_function(spec: str) -> AdvantageFn:
    """The estimator `spec` names (a built-in name or module:function), tried on a
    probe (two groups of two samples); ValueError, before anything starts, unless
    it loads, takes (rewards, group_ids) and returns one finite float per sample."""
    fn = builtin_or_load(spec, ADVANTAGES, "advantage")
    rewards, groups = torch.tensor([1.0, 0.0, 0.25, 0.75]), torch.tensor([0, 0, 1, 1])
    check_arity(fn, (rewards, groups), "advantage")
    compute_advantages(fn, rewards, groups, repr(spec))
    return fn
