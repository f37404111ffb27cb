"""Trainer layouts read off the live model, whatever its family.

Two facts come off the model itself, none is written per family:
- which checkpoint tensors each parameter holds, and where: transformers 5
  keeps a MoE's experts fused (`mlp.experts.gate_up_proj` [E, 2I, H]) and
  renames modules (Mixtral's `block_sparse_moe` is `mlp`), while checkpoints
  and inference engines speak the per-expert names `save_pretrained` writes.
  transformers' own `revert_weight_conversion` is run on view probes
  (sync/probe.py): the checkpoint tensors come out as views of the parameters,
  so their places are read, not re-derived. Those checkpoint names are the
  layout's logical tensors.
- which part of each parameter a rank holds: a DTensor's placements on its
  device mesh (FSDP2's `Shard(0)`, tensor-parallel `Shard(d)`, HSDP's
  `Replicate` + `Shard`, FSDP2 over tensor parallelism's `_StridedShard`, 2-D
  meshes), torch.chunk pieces as DTensor cuts them.
  A plain tensor is whole on every rank: a single process, or DDP, of which one
  rank sends (world_size 1).
DDP and torch.compile wrappers are looked through, FSDP1 is refused, and FSDP2
modules are resharded before their shards are read (FSDP2 leaves the root
unsharded after a forward with no backward).

`module_layout(model, world_size)` gives the layout, `module_sender` a
WeightSender over the model's local shards, in place, and `module_receiver` a
WeightReceiver into a generator model's own parameters.
`fsdp_layout(model, world_size, dtype)` gives the layout `fully_shard` will
produce, from an unsharded (or meta-device) model, for an engine to plan
against before any trainer connects.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .protocol import DEFAULT_TIMEOUT_S
from .errors import SyncError
from .layout import (Explicit, Layout, ParamSpec, Replicate, Shard, check_int, chunk_bounds, contiguous_strides,
                     strided_fragments)
from .plan import DEFAULT_BUCKET_BYTES
from .probe import ProbeError, ViewProbe
from .receiver import WeightReceiver
from .sender import WeightSender

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, extent) in a parameter's dims


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """A parameter's storage on this rank (a DTensor's local shard), no copy."""
    return (param.to_local() if hasattr(param, "to_local") else param).detach()


# ----------------------------------------------------------------------------- checkpoint names


CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."  # the module name torch's checkpoint_wrapper adds


def checkpointed(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of `model` a checkpoint holds, by name: its parameters (a tied
    one once, under its first name) and its persistent buffers (an activation
    checkpointing wrapper's state dict leaves its name out)."""
    kept = model.state_dict(keep_vars=True)
    return dict(model.named_parameters()) | {name: b for name, b in model.named_buffers()
                                             if name.replace(CHECKPOINT_WRAPPER, "") in kept}


def checkpoint_views(model: torch.nn.Module, buffers: bool = False) -> dict[str, list[tuple[str, tuple[int, ...], Box]]]:
    """Parameter name -> the checkpoint tensors it holds: (checkpoint name, shape,
    box of the parameter it fills); with `buffers`, the persistent buffers too
    (a router's trained bias is one: checkpoints hold them beside the
    parameters). A model transformers converts nothing for holds its own names,
    whole; activation checkpointing's wrapper (torch's `checkpoint_wrapper`, as
    accelerate's FSDP2 applies it) is not in a checkpoint name, as its state
    dict leaves it out. ValueError naming the parameter when a conversion
    computes rather than slices, or does not cover it exactly once."""
    tensors = checkpointed(model) if buffers else dict(model.named_parameters())
    params = {name: tuple(t.shape) for name, t in tensors.items()}
    named = {name.replace(CHECKPOINT_WRAPPER, ""): name for name in params}  # checkpoint name -> parameter's
    if len(named) != len(params):
        clash = next(n for n in params if named[n.replace(CHECKPOINT_WRAPPER, "")] != n)
        raise ValueError(f"parameter {clash!r} and {named[clash.replace(CHECKPOINT_WRAPPER, '')]!r} have one "
                         "checkpoint name")
    views = {name: [(ckpt, params[name], ((0,) * len(params[name]), params[name]))] for ckpt, name in named.items()}
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return views
    if not isinstance(model, PreTrainedModel):
        return views
    probes = {ckpt: ViewProbe.of(ckpt, params[name], tensors[name].dtype) for ckpt, name in named.items()}
    try:
        reverted = revert_weight_conversion(model, dict(probes))
    except ProbeError as exc:
        raise ValueError(f"transformers' checkpoint conversion of {type(model).__name__}: {exc}") from None
    views = {name: [] for name in params}
    for ckpt_name, probe in reverted.items():
        if not isinstance(probe, ViewProbe):
            raise ValueError(f"transformers' checkpoint conversion of {type(model).__name__} computes "
                             f"{ckpt_name!r} instead of slicing a parameter")
        source = named[probe.source]
        box = _as_box(probe, params[source])
        views[source].append((ckpt_name, tuple(probe.shape), box))
    for name, held in views.items():
        if not _cover_exactly_once([box for _, _, box in held], params[name]):
            raise ValueError(f"parameter {name!r}: transformers' checkpoint conversion maps it to "
                             f"{[n for n, _, _ in held]}, which do not cover it exactly once")
    return views


def _cover_exactly_once(boxes: list[Box], shape: tuple[int, ...]) -> bool:
    """Whether `boxes` (each inside `shape`) tile it: every element in exactly one.
    Counted on the grid the boxes' own edges cut each dim into (a cell per expert
    and part for a fused MoE tensor), not per element."""
    edges = [sorted({0, size} | {offset[d] + e for offset, extent in boxes for e in (0, extent[d])})
             for d, size in enumerate(shape)]
    cell = [{edge: i for i, edge in enumerate(dim_edges)} for dim_edges in edges]
    count = torch.zeros([len(dim_edges) - 1 for dim_edges in edges], dtype=torch.int32)
    for offset, extent in boxes:
        count[tuple(slice(at[o], at[o + e]) for at, o, e in zip(cell, offset, extent))] += 1
    return bool((count == 1).all())


def _as_box(probe: ViewProbe, shape: tuple[int, ...]) -> Box:
    """The box of a parameter (contiguous, `shape`) that a probe's view covers: its
    dims, in order, must be the parameter's (size-1 dims squeezed away)."""
    if 0 in shape:  # no element to place (and strides of 0)
        return (0,) * len(shape), shape
    strides = contiguous_strides(shape)
    offset, coords = probe.meta.storage_offset(), []
    for stride in strides:
        coords.append(offset // stride)
        offset %= stride
    extent = [1] * len(shape)
    view_dims = [(n, s) for n, s in zip(probe.shape, probe.meta.stride()) if n != 1]
    dim = 0
    for n, s in view_dims:
        while dim < len(shape) and (strides[dim] != s or shape[dim] == 1):
            dim += 1
        if dim == len(shape) or coords[dim] + n > shape[dim]:
            raise ValueError(f"{probe.source!r}: a checkpoint tensor of shape {tuple(probe.shape)} is a view of it "
                             f"that is not a box of shape {shape} (a transpose?)")
        extent[dim] = n
        dim += 1
    return tuple(coords), tuple(extent)


# ----------------------------------------------------------------------------- placements


Runs = list[tuple[int, int]]  # [start, stop) ranges of one dim's indices, in the local order


def _take(runs: Runs, start: int, stop: int) -> Runs:
    """Positions [start, stop) of the indices `runs` list, as runs (adjacent ones merged)."""
    out: Runs = []
    position = 0
    for a, b in runs:
        lo, hi = max(start - position, 0), min(stop - position, b - a)
        if lo < hi:
            if out and out[-1][1] == a + lo:
                out[-1] = (out[-1][0], a + hi)
            else:
                out.append((a + lo, a + hi))
        position += b - a
    return out


def _shard_runs(runs: Runs, placement, num_chunks: int, coord: int) -> Runs:
    """The indices a mesh coordinate keeps of `runs` under a Shard (torch.chunk's
    piece) or a _StridedShard (FSDP2 over tensor parallelism: the indices cut into
    `split_factor` torch.chunk pieces first, and this coordinate's piece of each)."""
    size = sum(b - a for a, b in runs)
    split_factor = int(getattr(placement, "split_factor", 1)) if type(placement).__name__ == "_StridedShard" else 1
    pieces: Runs = []
    for split in range(split_factor):
        a, b = chunk_bounds(size, split_factor, split)
        lo, hi = chunk_bounds(b - a, num_chunks, coord)
        pieces += _take(runs, a + lo, a + hi)
    return _take(pieces, 0, size)  # adjacent pieces merged


def _mesh_coordinates(name: str, mesh, world_size: int) -> list[tuple[int, list[int], list[int]]]:
    """(rank, its coordinate on `mesh`'s dims, their sizes) for every rank of the
    layout. A submesh (FSDP2 over tensor parallelism puts the parameters that are
    not tensor-parallel on the data-parallel dim alone) is placed in its root mesh
    by dim name: the ranks it leaves out hold what their peers on it hold."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    if root is not mesh and (not mesh.mesh_dim_names or not root.mesh_dim_names
                             or not set(mesh.mesh_dim_names) <= set(root.mesh_dim_names)):
        raise ValueError(f"parameter {name!r} lives on a submesh (dims {mesh.mesh_dim_names}) that is not a set of "
                         f"its root mesh's named dims {root.mesh_dim_names} (a flattened one?)")
    dims = [root.mesh_dim_names.index(n) for n in mesh.mesh_dim_names] if root is not mesh else \
        list(range(root.mesh.ndim))
    ranks = root.mesh.flatten().tolist()
    if sorted(ranks) != list(range(world_size)):
        raise ValueError(f"parameter {name!r} lives on a device mesh of ranks {ranks}, not the {world_size} ranks "
                         "of the layout (a mesh that spans other processes: pass their number as world_size)")
    shape = tuple(root.mesh.shape)
    out = []
    for position, rank in enumerate(ranks):
        coords = [int(c) for c in torch.unravel_index(torch.tensor(position), shape)]
        out.append((rank, [coords[d] for d in dims], [shape[d] for d in dims]))
    return out


def _rank_boxes(name: str, param: torch.Tensor, world_size: int) -> list[Box] | None:
    """Each rank's box of `param` from its DTensor placements (None for a plain
    tensor), placements applied left to right as DTensor does. ValueError naming
    the parameter for a placement we cannot read, or a rank's shard that is not
    one box."""
    if not hasattr(param, "placements"):
        return None
    placements, shape = param.placements, tuple(param.shape)
    boxes: list[Box] = [None] * world_size
    for rank, coords, sizes in _mesh_coordinates(name, param.device_mesh, world_size):
        runs: list[Runs] = [[(0, n)] if n else [] for n in shape]
        for mesh_dim, placement in enumerate(placements):
            if placement.is_replicate():
                continue
            if type(placement).__name__ not in ("Shard", "_StridedShard"):
                raise ValueError(f"parameter {name!r}: placement {placement} on mesh dim {mesh_dim} is not "
                                 "supported (Shard, _StridedShard and Replicate are); a partial tensor cannot be "
                                 "sent shard by shard")
            dim = placement.dim
            runs[dim] = _shard_runs(runs[dim], placement, sizes[mesh_dim], coords[mesh_dim])
        split = [d for d, r in enumerate(runs) if len(r) > 1]
        if split:
            raise ValueError(f"parameter {name!r}: rank {rank} holds indices {runs[split[0]]} of dim {split[0]} "
                             f"(placements {placements}), not one box")
        boxes[rank] = (tuple(r[0][0] if r else 0 for r in runs), tuple(r[0][1] - r[0][0] if r else 0 for r in runs))
    return boxes


def _one_dim_shard(param: torch.Tensor, boxes: list[Box] | None) -> Shard | Replicate | None:
    """The compact placement when the boxes are a 1-D mesh's Shard(d) or Replicate."""
    if boxes is None:
        return Replicate()
    if param.device_mesh.ndim != 1 or param.device_mesh.mesh.tolist() != list(range(len(boxes))):
        return None  # a 2-D mesh, or ranks in another order: listed
    placement = param.placements[0]
    return Replicate() if placement.is_replicate() else Shard(placement.dim)


def _params_of(name: str, shape: tuple[int, ...], dtype: torch.dtype, world_size: int, boxes: list[Box] | None,
               held: list[tuple[str, tuple[int, ...], Box]], compact: Shard | Replicate | None) -> ParamSpec:
    """The ParamSpec of a parameter whose ranks hold `boxes` of it (None: each the
    whole) and which holds the checkpoint tensors `held`: `compact` when it holds
    one of them whole and `compact` is given, else an Explicit listing."""
    if compact is not None and len(held) == 1 and held[0][1] == shape:
        return ParamSpec(name, shape, dtype, compact, source=held[0][0] if held[0][0] != name else None)
    boxes = boxes or [((0,) * len(shape), shape)] * world_size
    local_shapes, fragments = [], []
    for offset, extent in boxes:
        local_shapes.append(extent)
        mine = []
        for ckpt_name, ckpt_shape, (c_off, c_ext) in held:
            lo = [max(a, b) for a, b in zip(offset, c_off)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offset, extent, c_off, c_ext)]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            # the checkpoint tensor's strides, per parameter dim (0 on the dims it squeezed away)
            ckpt_strides = []
            view_strides = iter(s for n, s in zip(ckpt_shape, contiguous_strides(ckpt_shape)) if n != 1)
            for n in c_ext:
                ckpt_strides.append(next(view_strides) if n != 1 else 0)
            src = sum((l - c) * s for l, c, s in zip(lo, c_off, ckpt_strides))
            local_strides = contiguous_strides(extent)
            dst = sum((l - o) * s for l, o, s in zip(lo, offset, local_strides))
            mine += strided_fragments(ckpt_name, ckpt_shape, src, tuple(ckpt_strides), extent, dst, local_strides,
                                      tuple(h - l for l, h in zip(lo, hi)))
        fragments.append(tuple(mine))
    sources = tuple((ckpt_name, ckpt_shape) for ckpt_name, ckpt_shape, _ in held)
    return ParamSpec(name, local_shapes[0], dtype, Explicit(sources, tuple(local_shapes), tuple(fragments)))


# ----------------------------------------------------------------------------- layouts and senders


def module_layout(model: torch.nn.Module, world_size: int) -> Layout:
    """The layout of `model`'s parameters over `world_size` trainer ranks, read
    off the live model: checkpoint names (checkpoint_views), each rank's part
    from its DTensor placements, dtypes of its local shards. ValueError naming
    the culprit for: a model with no DTensor parameters on several ranks (DDP or
    a replicated model: rank 0 alone sends, with world_size 1), a placement
    other than Shard / _StridedShard / Replicate (Partial), a rank's shard that
    is not one box, a mesh over other ranks."""
    check_int(world_size, "world_size", 1)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    model = _resharded(_unwrapped(model))
    params = dict(model.named_parameters())
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters: nothing to sync")
    if world_size > 1 and not any(hasattr(p, "placements") for p in params.values()):
        raise ValueError(f"{type(model).__name__}'s parameters are plain tensors, whole on every rank (DDP or a "
                         f"single process), yet world_size is {world_size}: register rank 0 alone, with "
                         "world_size=1, and let the other ranks skip the sync")
    views = checkpoint_views(model)
    specs = []
    for name, p in params.items():
        boxes = _rank_boxes(name, p, world_size)
        specs.append(_params_of(name, tuple(p.shape), p.dtype, world_size, boxes, views[name],
                                _one_dim_shard(p, boxes)))
    return Layout(world_size, specs)


def fsdp_layout(model: torch.nn.Module, world_size: int, dtype: torch.dtype) -> Layout:
    """The layout FSDP2's `fully_shard` (default placements, one 1-D mesh) gives
    `model` over `world_size` ranks, in `dtype`: built from the unsharded model
    (a meta-device one will do), before any trainer runs, for the engine side to
    plan against; it holds the same fragments as what `module_sender` registers
    then when `fully_shard` covers every parameter on one 1-D mesh (senders and
    receivers plan again from the layouts they register when they connect). A
    model already sharded is read as it is (module_layout), in `dtype`."""
    check_int(world_size, "world_size", 1)
    model = _unwrapped(model)
    if any(hasattr(p, "placements") for p in model.parameters()):
        live = module_layout(model, world_size)
        return Layout(world_size, [ParamSpec(s.name, s.shape, dtype, s.placement, s.source)
                                   for s in live.params.values()])
    views = checkpoint_views(model)
    specs = []
    for name, p in model.named_parameters():
        shape, boxes = tuple(p.shape), None
        if world_size > 1:  # fully_shard's Shard(0): torch.chunk pieces of dim 0
            boxes = []
            for rank in range(world_size):
                start, stop = chunk_bounds(shape[0], world_size, rank) if shape else (0, 0)
                boxes.append(((start,) + (0,) * (len(shape) - 1), (stop - start,) + shape[1:]))
        compact = Shard(0) if world_size > 1 else Replicate()
        specs.append(_params_of(name, shape, dtype, world_size, boxes, views[name], compact))
    return Layout(world_size, specs)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP and torch.compile wrappers (their parameter names carry
    `module.` / `_orig_mod.`, which no checkpoint has); FSDP1 is refused by name."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif type(model).__name__ == "FullyShardedDataParallel":
            raise ValueError("FSDP1 (FullyShardedDataParallel) flattens parameters into one buffer per unit; "
                             "shard the model with FSDP2's fully_shard instead")
        else:
            return model


def _resharded(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every FSDP2 module holding its shards: FSDP2 leaves the root's
    parameters unsharded after a forward with grad enabled and no backward (a
    log-prob pass outside no_grad), and the shards are what a sync reads."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return model
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def local_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's local shard, in place (FSDP2 modules resharded first:
    their shards are what a sync reads)."""
    return {n: local_shard(p) for n, p in _resharded(model).named_parameters()}


class _Registered:
    """A live model's parameters as one end of a sync registered them (their local
    shards' storage), checked again before every transfer."""

    def __init__(self, model: torch.nn.Module, role: str, end: str):
        self.model, self.role, self.end = model, role, end
        self.storage = {n: self._key(t) for n, t in self.shards().items()}

    def shards(self) -> dict[str, torch.Tensor]:
        return local_shards(self.model)

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        return t.data_ptr(), tuple(t.shape), t.dtype

    def check(self) -> None:
        """SyncError naming the first parameter whose storage is not the registered one."""
        live = self.shards()
        for name, registered in self.storage.items():
            if name not in live:
                raise SyncError(f"{self.role} parameter {name!r} is gone from the model since the {self.end} "
                                "registered it")
            if self._key(live[name]) != registered:
                raise SyncError(f"{self.role} parameter {name!r} was rebound after the {self.end} registered it "
                                "(model.to(), load_state_dict(assign=True), an offload): the sync would use the old "
                                f"storage; build a new {self.end} for the model as it is now")


class ModuleSender(WeightSender):
    """A WeightSender over a live model's local shards (module_sender). Each
    `send` first checks that every parameter still has the storage it had when
    registered: one rebound since (`model.to()`, `load_state_dict(assign=True)`,
    an offload) raises SyncError naming it before a byte moves; build a new
    sender after such a change. The other parameters are WeightSender's."""

    def __init__(self, store: dist.Store, model: torch.nn.Module, rank: int, world_size: int, *,
                 name: str = "weights", transport: str = "auto", timeout: float = DEFAULT_TIMEOUT_S,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, num_threads: int | None = None,
                 secret: bytes | None = None, delta: bool = False):
        model = _unwrapped(model)
        layout = module_layout(model, world_size)
        self.model = model
        self._live = _Registered(model, "trainer", "sender")
        super().__init__(store, layout, rank, self._live.shards(), name=name, transport=transport, timeout=timeout,
                         bucket_bytes=bucket_bytes, num_threads=num_threads, secret=secret, delta=delta)

    def check_storage(self) -> None:
        """SyncError naming the first parameter whose storage is not the registered one."""
        self._live.check()

    def _check_sources(self) -> None:
        self.check_storage()
        super()._check_sources()


def module_sender(store: dist.Store, model: torch.nn.Module, rank: int, world_size: int, *, name: str = "weights",
                  transport: str = "auto", timeout: float = DEFAULT_TIMEOUT_S,
                  num_threads: int | None = None, secret: bytes | None = None, delta: bool = False) -> ModuleSender:
    """A sender over any `nn.Module`'s local shards, in place, under the layout
    `module_layout(model, world_size)` (its `.layout`): plain tensors on one
    rank, FSDP2 / tensor-parallel / HSDP DTensors on `world_size` ranks. delta:
    as WeightSender's."""
    return ModuleSender(store, model, rank, world_size, name=name, transport=transport, timeout=timeout,
                        num_threads=num_threads, secret=secret, delta=delta)


class ModuleReceiver(WeightReceiver):
    """A WeightReceiver into a live model's own parameters (module_receiver):
    every receive writes the memory the model's Parameters hold (their local
    shards), and first checks that each still holds the memory registered: one
    rebound since (`model.to()`, `load_state_dict(assign=True)`) raises SyncError
    naming it before a byte moves; build a new receiver after such a change. The
    other parameters are WeightReceiver's."""

    def __init__(self, store: dist.Store, model: torch.nn.Module, rank: int, world_size: int, *,
                 name: str = "weights", transport: str = "auto", timeout: float = DEFAULT_TIMEOUT_S,
                 num_threads: int | None = None, replica: int = 0, num_replicas: int = 1,
                 secret: bytes | None = None):
        model = _unwrapped(model)
        self.model = model
        super().__init__(store, module_layout(model, world_size), rank, local_shards(model), name=name,
                         transport=transport, timeout=timeout, num_threads=num_threads, replica=replica,
                         num_replicas=num_replicas, secret=secret)
        self._live = _Registered(model, "generator", "receiver")  # after the set-up: shared memory moves storages

    def check_storage(self) -> None:
        """SyncError naming the first parameter whose storage is not the registered one."""
        self._live.check()

    def _check_storage(self) -> None:
        self.check_storage()
        super()._check_storage()


def module_receiver(store: dist.Store, model: torch.nn.Module, rank: int, world_size: int, *,
                    name: str = "weights", transport: str = "auto", timeout: float = DEFAULT_TIMEOUT_S,
                    num_threads: int | None = None, replica: int = 0, num_replicas: int = 1,
                    secret: bytes | None = None) -> ModuleReceiver:
    """A receiver into any `nn.Module`'s own parameters, in place, under the
    layout `module_layout(model, world_size)` (its `.layout`): a plain model on
    one rank (a transformers model as the generator), tensor-parallel DTensors on
    `world_size` ranks; replica / num_replicas as WeightReceiver's."""
    return ModuleReceiver(store, model, rank, world_size, name=name, transport=transport, timeout=timeout,
                          num_threads=num_threads, replica=replica, num_replicas=num_replicas, secret=secret)

