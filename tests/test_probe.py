"""View probes (llamarl_core/sync/probe.py): random chains of view ops on a probe
record exactly the elements the same ops select from real data; what a loader
computes is refused, naming the tensor."""

from __future__ import annotations

import random

import pytest
import torch

from llamarl_core.sync.probe import ProbeError, ViewProbe, recording


def random_view(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """One random view op (the kinds loaders use) applied to `t`."""
    ops = ["narrow", "chunk", "unsqueeze"]
    if t.dim() > 1:
        ops += ["select", "t" if t.dim() == 2 else "transpose", "flatten"]
    if t.dim() > 1 and any(n == 1 for n in t.shape):
        ops.append("squeeze")
    op = rng.choice(ops)
    dim = rng.randrange(t.dim())
    n = t.shape[dim]
    if op == "narrow" and n:
        start = rng.randrange(n)
        return t.narrow(dim, start, rng.randint(1, n - start))
    if op == "chunk" and n:
        pieces = t.chunk(rng.randint(1, max(1, n)), dim)
        return pieces[rng.randrange(len(pieces))]
    if op == "select" and n:
        return t.select(dim, rng.randrange(n))
    if op == "t":
        return t.t()
    if op == "transpose":
        return t.transpose(dim, rng.randrange(t.dim()))
    if op == "flatten" and t.is_contiguous():
        return t.flatten()
    if op == "squeeze":
        return t.squeeze(next(d for d, m in enumerate(t.shape) if m == 1))
    return t.unsqueeze(rng.randrange(t.dim() + 1))


def test_random_view_chains_record_the_elements_they_select():
    rng = random.Random(0)
    for trial in range(1000):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 4)))
        real = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
        probe = ViewProbe.of("w", shape, torch.float64)
        seed = rng.random()
        real_view, probe_view = real, probe
        for steps in range(rng.randint(0, 5)):
            op_rng = random.Random(f"{seed}/{steps}")  # the same op on both
            real_view = random_view(real_view, op_rng)
            probe_view = random_view(probe_view, random.Random(f"{seed}/{steps}"))
        if rng.random() < 0.3:  # element-wise copies pass the element map through
            real_view, probe_view = real_view.float().contiguous(), probe_view.float().contiguous()
        dst = torch.empty(real_view.shape, dtype=real_view.dtype)
        with recording() as copies:
            assert dst.copy_(probe_view) is dst
        assert len(copies) == 1, trial
        c = copies[0]
        assert c.source == "w" and c.dst is dst and c.extent == tuple(real_view.shape)
        replayed = real.flatten().as_strided(c.extent, c.src_strides, c.src_offset)
        assert torch.equal(replayed.to(real_view.dtype), real_view), (trial, shape)


def test_computing_on_a_probe_is_refused_naming_it():
    probe = ViewProbe.of("model.w", (4, 6), torch.float32)
    for compute in (lambda p: p * 2, lambda p: torch.cat([p, p]), lambda p: p.add_(1), lambda p: p.exp()):
        with pytest.raises(ProbeError, match="'model.w': the loading code applies"):
            compute(probe)
    with pytest.raises(ProbeError, match="outside `recording\\(\\)`"):
        torch.empty(4, 6).copy_(probe)
    with pytest.raises(ProbeError, match="a broadcast"), recording():
        torch.empty(3, 4, 6).copy_(probe)


def test_a_loader_that_transforms_the_parameter_after_copying_is_refused():
    """vLLM's composed loaders copy a checkpoint tensor into the parameter, then
    write fn(parameter) over it (Mamba's A = -exp(A_log)): guarded targets refuse
    any write but a copy from a probe or a constant fill, naming the parameter."""
    placeholder = torch.empty(8, 6, device="meta")
    targets = {placeholder.untyped_storage()._cdata: "model.layers.0.mixer.A"}
    probe = ViewProbe.of("model.layers.0.mixer.A_log", (4, 6), torch.float32)
    other = torch.zeros(3)
    with recording(targets) as copies:
        placeholder.data[:4].copy_(probe)
        placeholder[4:].fill_(0)  # vLLM zeroes vocabulary padding rows so
        other.add_(1)  # a tensor that is not loaded into: not guarded
    assert len(copies) == 1 and torch.equal(other, torch.ones(3))
    for transform in (lambda t: t.data.copy_(-torch.exp(t)), lambda t: t.mul_(2), lambda t: t[:2].add_(1)):
        with pytest.raises(ProbeError, match="writes into 'model.layers.0.mixer.A'"), recording(targets):
            placeholder.data[:4].copy_(probe)
            transform(placeholder)
