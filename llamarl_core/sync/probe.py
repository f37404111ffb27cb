"""View probes: where a model's own loading code puts each tensor, read off the
code itself rather than described again by hand.

A `ViewProbe` stands for a (view of a) logical tensor and holds no data. Handed
to code that slices and copies weights (vLLM's `load_weights`, transformers'
checkpoint conversions), it follows every view op (narrow, select, chunk,
unbind, view, ...) on a meta tensor, passes element-wise copies (clone,
contiguous, a dtype or device change) through with its element map unchanged,
and at `dst.copy_(probe)` writes nothing but records which elements of the
logical tensor `dst` would receive (`ProbeCopy`). Any other op on a probe
(arithmetic, `torch.cat`, an in-place write into it) raises `ProbeError` naming
the op and the tensor: what a loader computes cannot be replayed as a copy.
`recording(targets)` also guards the tensors being loaded into: a write into
one that is not a copy from a probe or a constant fill (a loader that copies
and then transforms the parameter in place, `param.copy_(fn(param))`) raises
`ProbeError` naming it.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten

# Ops whose outputs are views of their input: run on the meta stand-in.
_VIEW_OPS = {
    aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.unbind.int, aten.chunk.default, aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default,
    aten.detach.default, aten.t.default, aten.transpose.int, aten.permute.default, aten.as_strided.default,
    aten.expand.default, aten.unflatten.int, aten.flatten.using_ints,
}
# Ops whose output element i is input element i: the element map passes through.
_ELEMENTWISE_COPIES = {aten.clone.default, aten._to_copy.default, aten.contiguous.default, aten.lift_fresh.default}


class ProbeError(ValueError):
    """Loading code did something to a probe that is not a view or a copy."""


@dataclass(frozen=True)
class ProbeCopy:
    """`dst.copy_(view of source)`: the view's first element at flat index
    `src_offset` of the contiguous logical tensor `source`, `src_strides` in
    elements, `extent` its shape; `dst` the tensor written (a view of a
    parameter, or of a meta placeholder standing for one)."""

    source: str
    src_offset: int
    src_strides: tuple[int, ...]
    extent: tuple[int, ...]
    dst: torch.Tensor


class _Recorder(threading.local):
    copies: list | None = None


_recorder = _Recorder()


# Writes the guard lets through: a constant (vLLM zeroes a vocabulary's padding rows).
_CONSTANT_FILLS = {aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default}


class _Guard(TorchDispatchMode):
    """Raises ProbeError on a write into a guarded storage other than a copy from
    a probe or a constant fill."""

    def __init__(self, targets: dict[int, str]):
        super().__init__()
        self.targets = targets

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        allowed = func in _CONSTANT_FILLS or (func is aten.copy_.default and isinstance(args[1], ViewProbe))
        if func._schema.is_mutable and not allowed:
            schema_args = func._schema.arguments
            values = list(args) + [kwargs.get(a.name) for a in schema_args[len(args):]]
            for arg, value in zip(schema_args, values):
                if arg.alias_info is None or not arg.alias_info.is_write or not isinstance(value, torch.Tensor) \
                        or isinstance(value, ViewProbe):
                    continue
                name = self.targets.get(value.untyped_storage()._cdata)
                if name is not None:
                    raise ProbeError(f"the loading code writes into {name!r} with {func}, a value it computes rather "
                                     "than a copy of a checkpoint tensor; it cannot be replayed as a weight sync")
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording(targets: dict[int, str] | None = None):
    """Collect the ProbeCopy of every `copy_` from a probe in this thread.
    targets: {untyped storage `_cdata`: name} of the tensors loaded into, guarded
    (see the module docstring)."""
    outer, _recorder.copies = _recorder.copies, []
    try:
        if targets:
            with _Guard(targets):
                yield _recorder.copies
        else:
            yield _recorder.copies
    finally:
        _recorder.copies = outer


def _meta_view(shape: tuple[int, ...], strides: tuple[int, ...], offset: int, dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor viewing elements `offset` + sum(index * strides) of a storage."""
    span = offset + sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    return torch.empty(span, dtype=dtype, device="meta").as_strided(shape, strides, offset)


class ViewProbe(torch.Tensor):
    """A stand-in for `source` (or a view of it) with no data; see the module docstring."""

    source: str
    meta: torch.Tensor

    @staticmethod
    def __new__(cls, source: str, meta: torch.Tensor):
        probe = torch.Tensor._make_wrapper_subclass(cls, meta.shape, strides=meta.stride(),
                                                    storage_offset=meta.storage_offset(), dtype=meta.dtype,
                                                    device="meta", requires_grad=False)
        probe.source, probe.meta = source, meta
        return probe

    @classmethod
    def of(cls, source: str, shape: tuple[int, ...], dtype: torch.dtype) -> "ViewProbe":
        """A probe for the whole contiguous logical tensor `source`."""
        return cls(source, torch.empty(shape, dtype=dtype, device="meta"))

    def __repr__(self) -> str:
        return f"ViewProbe({self.source!r}, shape={tuple(self.shape)}, offset={self.meta.storage_offset()})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        probes = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, ViewProbe)]  # torch.cat's list too
        if func is aten.copy_.default and isinstance(args[1], ViewProbe) and not isinstance(args[0], ViewProbe):
            dst, src = args[0], args[1]
            if tuple(dst.shape) != tuple(src.shape):
                raise ProbeError(f"{src.source!r}: a copy of shape {tuple(src.shape)} into {tuple(dst.shape)} "
                                 "(a broadcast)")
            if _recorder.copies is None:
                raise ProbeError(f"{src.source!r}: a probe was copied outside `recording()`")
            _recorder.copies.append(ProbeCopy(src.source, src.meta.storage_offset(), tuple(src.meta.stride()),
                                              tuple(src.shape), dst))
            return dst
        if func in _VIEW_OPS and probes:
            source = probes[0].source
            out = func(*tree_map(lambda a: a.meta if isinstance(a, ViewProbe) else a, args), **kwargs)
            return tree_map(lambda t: cls(source, t) if isinstance(t, torch.Tensor) else t, out)
        if func in _ELEMENTWISE_COPIES and len(probes) == 1 and args[0] is probes[0]:
            probe, dtype = probes[0], kwargs.get("dtype") or probes[0].dtype
            meta = probe.meta if dtype == probe.dtype else _meta_view(
                tuple(probe.meta.shape), tuple(probe.meta.stride()), probe.meta.storage_offset(), dtype)
            return cls(probe.source, meta)
        names = sorted({p.source for p in probes}) or ["a probe"]
        raise ProbeError(f"{', '.join(map(repr, names))}: the loading code applies {func} to the tensor; only views "
                         "and copies can be replayed as a weight sync")
