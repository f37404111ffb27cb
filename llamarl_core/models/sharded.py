"""A trainer's model built on the meta device, sharded, then filled one tensor at
a time: no rank ever holds the whole model, only its own shards plus one
tensor (one module's, for a random initialisation) at a time.

`empty_model` builds the transformers model on the meta device, shards it with
FSDP2 over `mesh` (every decoder layer, then the root; no mesh: one rank, plain
tensors) and allocates each rank's shards on `device`; its buffers (rotary
frequencies) are computed by the model's own `_init_weights`. Its parameters
are then filled by one of:
- `init_random`: the model's own `_init_weights`, module by module on a
  full-size copy seeded from (seed, module name), drawn on the device the model
  is on (a CPU thread draws about 80M values a second: 13 s for 1B parameters on
  the 2-core machine; a GPU, milliseconds): the same weights at any world size,
  on the CPU or on GPUs of one model (CUDA's draws depend on the SM count);
- `load_shards`: a safetensors checkpoint under the model's or its family's
  checkpoint names (a MoE's per-expert tensors, which transformers fuses on
  load), each rank reading only its rows of each tensor (memory-mapped), and
  the persistent buffers the checkpoint holds;
- `copy_from_full`: whole tensors by name (export of a family whose conversion
  is not a set of slices, in one process);
- `copy_shards`: another model of the same class and sharding (a reference
  model from the policy), shard by shard, cast to this model's dtype.
Nothing is left as `to_empty`'s garbage: `init_random` raises naming what the
model's `_init_weights` leaves unset, `load_shards` (NotByName) and
`copy_from_full` naming the tensors the checkpoint or state lacks, before
anything is read."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import torch

__all__ = ["empty_model", "tied_parameters", "tied_aliases", "init_random", "load_shards", "NotByName",
           "copy_from_full", "copy_shards", "checkpoint_names", "local_part", "local_slices",
           "few_names"]


def empty_model(model_config, *, dtype: torch.dtype, device, mesh=None):
    """The causal LM of `model_config` in `dtype`, sharded over `mesh` (FSDP2:
    each decoder layer, then the root) or whole when `mesh` is None, its tensors
    allocated on `device` but its parameters not yet filled (see the module's
    docstring); its buffers computed. A model without `model.layers` cannot be
    sharded layer by layer: ValueError naming its class."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise ValueError(f"{type(model).__name__} has no model.layers to shard one by one (FSDP2)")
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    ties = tied_parameters(model)
    model.to_empty(device=device)
    for names in ties:  # to_empty off the meta device makes one new parameter per module, untying them
        module, attr = _owner(model, names[0])
        first = getattr(module, attr)
        for name in names[1:]:
            setattr(*_owner(model, name), first)
    _init_buffers(model)
    return model


def tied_parameters(model) -> list[list[str]]:
    """The names of each parameter of `model` that several modules share (a tied
    lm_head and embedding), the first name (named_parameters') first."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def tied_aliases(model) -> frozenset[str]:
    """The second and later names of `model`'s tied parameters (lm_head.weight when
    it is the embedding): the names a checkpoint holds no tensor under."""
    return frozenset(name for names in tied_parameters(model) for name in names[1:])


def few_names(names: list[str], shown: int = 4) -> str:
    """The first `shown` of `names`, and how many more there are, for an error."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _owner(model, name: str) -> tuple[torch.nn.Module, str]:
    module, _, attr = name.rpartition(".")
    return model.get_submodule(module), attr


def local_slices(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The part of the global tensor that this rank holds of `tensor` (a DTensor
    sharded or replicated over its mesh, or a plain tensor: all of it), as one
    slice a dimension."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return tuple(slice(0, n) for n in tensor.shape)
    for placement in tensor.placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(f"a DTensor placed {placement}: only Shard and Replicate are described")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own storage of `tensor` (its local shard for a DTensor)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _module_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _owners(model) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module of `model` that holds parameters or buffers
    of its own."""
    return [(name, module) for name, module in model.named_modules()
            if next(module.parameters(recurse=False), None) is not None
            or next(module.buffers(recurse=False), None) is not None]


def _template(model):
    """`model`'s class and config, unsharded, in float32, on the meta device (no
    memory): the full shapes its initialisation runs on."""
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)


def _initialised_copy(model, template, name: str, seed: int, kind: str, device: torch.device) -> torch.nn.Module:
    """A copy of module `name` of `template` whose `kind` tensors ("parameter" or
    "buffer") are full-size tensors on `device` (the others stay on the meta device,
    where initialising them costs nothing: a Gemma embedding's buffer pass allocates
    no table), the floating ones first set to NaN, then initialised by `model`'s own
    `_init_weights` under the generators of the CPU and of `device` seeded from
    (seed, name), their states restored after."""
    module = copy.deepcopy(template.get_submodule(name))
    table = module._parameters if kind == "parameter" else module._buffers
    for key, t in table.items():
        if t is not None:
            real = torch.empty_like(t, device=device)
            if real.is_floating_point():
                real.fill_(float("nan"))
            table[key] = torch.nn.Parameter(real, t.requires_grad) if kind == "parameter" else real
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(_module_seed(seed, name))  # every device's generator
        model._init_weights(module)
    return module


def _own_tensors(module: torch.nn.Module, kind: str):
    return module.named_parameters(recurse=False) if kind == "parameter" else module.named_buffers(recurse=False)


def _fill_from_init(model, seed: int, kind: str) -> None:
    """Every `kind` ("parameter" or "buffer") of `model` from `_initialised_copy`;
    a tied parameter filled once, by the first module that holds it."""
    done: set[int] = set()
    live, template = dict(_owners(model)), _template(model)
    for name, _ in _owners(template):
        module = live[name]
        tensors = [(n, t) for n, t in _own_tensors(module, kind) if id(t) not in done]
        if not tensors:
            continue
        # Drawn where the model lives; buffers (rotary frequencies) computed on the CPU, as a generator computes them.
        device = local_part(tensors[0][1]).device if kind == "parameter" else torch.device("cpu")
        full = dict(_own_tensors(_initialised_copy(model, template, name, seed, kind, device), kind))
        for n, t in tensors:
            value = full[n]
            if value.is_floating_point() and torch.isnan(value).any():
                raise ValueError(f"{type(model).__name__}._init_weights leaves {kind} {name}.{n} unset: "
                                 "this model cannot be built on the meta device")
            with torch.no_grad():
                local_part(t).copy_(value[local_slices(t)])
            done.add(id(t))


def _init_buffers(model) -> None:
    _fill_from_init(model, 0, "buffer")  # buffers are computed, not drawn: the seed plays no part


def init_random(model, seed: int) -> None:
    """Fill `model` (from `empty_model`) with the model's own initialisation,
    module by module, each seeded from (seed, its name) and drawn on the device the
    model is on (each module's full size there at a time): the same weights at any
    world size, on the CPU or on GPUs of one model (a GPU draws other values than
    the CPU, and GPUs of other SM counts other values again)."""
    _fill_from_init(model, seed, "parameter")


def checkpoint_names(folder: str | Path) -> dict[str, Path]:
    """The tensor names of the safetensors checkpoint in `folder` (an index file,
    or model.safetensors) and the file that holds each."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{folder} holds no safetensors checkpoint (model.safetensors or its index)")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


class NotByName(ValueError):
    """A checkpoint that does not hold a model's tensors under the model's or its
    family's checkpoint names (transformers' loader may still map them)."""


_FLOATS = {"F16", "BF16", "F32"}


def load_shards(model, folder: str | Path) -> None:
    """Fill `model` (from `empty_model`) from the safetensors checkpoint in
    `folder`, each rank reading its own rows of each tensor only (its persistent
    buffers whole: a MoE router's trained bias is one). A family
    transformers converts on load (a MoE whose experts it fuses, Mixtral's renamed
    modules) is read under its checkpoints' names: transformers' own reverse
    conversion, run on view probes (sync/live.py checkpoint_views), says which
    slice of which parameter each checkpoint tensor is, and a rank reads the part
    of it inside its rows. Before a tensor is read: NotByName naming the
    checkpoint tensors the folder lacks (a tied parameter may be absent under its
    second name), or when the conversion computes a parameter rather than
    slicing it; ValueError naming those it holds in another shape, in a dtype
    other than float16 / bfloat16 / float32 (an FP8 or integer-quantized
    checkpoint), or beside quantization scales."""
    from safetensors import safe_open

    from ..sync.live import checkpoint_views, checkpointed

    files = checkpoint_names(folder)
    params = checkpointed(model)
    try:
        views = checkpoint_views(model, buffers=True)  # tensor -> [(checkpoint name, shape, box of the tensor)]
    except ValueError as exc:
        raise NotByName(str(exc)) from None
    wanted = {ckpt: shape for held in views.values() for ckpt, shape, _ in held}
    missing = [n for n in wanted if n not in files]
    if missing:
        raise NotByName(f"the checkpoint in {folder} does not hold {type(model).__name__}'s parameters by their "
                        f"names: missing {few_names(missing)}")
    tied = tied_aliases(model)
    quantized = [n for n in files if n not in wanted and n not in tied
                 and any(k in n.rsplit(".", 1)[-1] for k in ("scale", "qweight", "qzeros"))]
    wrong, in_file = [], {}
    for name in wanted:
        in_file.setdefault(files[name], []).append(name)
    for file, names in in_file.items():  # each file's header read once
        with safe_open(file, framework="pt") as f:
            for name in names:
                piece = f.get_slice(name)
                shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
                if shape != tuple(wanted[name]):
                    wrong.append(f"{name} {list(shape)} (the model's {list(wanted[name])})")
                elif dtype not in _FLOATS:
                    wrong.append(f"{name} in {dtype}")
    if wrong or quantized:
        problems = ([f"shaped or typed otherwise: {few_names(wrong)}"] if wrong else []) + (
            [f"quantization tensors {few_names(quantized)}"] if quantized else [])
        raise ValueError(f"the checkpoint in {folder} does not hold {type(model).__name__}'s parameters as float "
                         f"tensors of its shapes: {'; '.join(problems)} (nothing was read)")
    by_file: dict[Path, list] = {}
    for name, held in views.items():
        rows = local_slices(params[name])
        for ckpt, shape, box in held:
            part = _overlap(box, rows, shape)
            if part is not None:
                by_file.setdefault(files[ckpt], []).append((name, ckpt, *part))
    for file, reads in by_file.items():
        with safe_open(file, framework="pt") as f, torch.no_grad():
            for name, ckpt, source, target in reads:
                destination = local_part(params[name])[target]
                destination.copy_(f.get_slice(ckpt)[source].reshape(destination.shape))


def _overlap(box, rows: tuple[slice, ...], shape: tuple[int, ...]):
    """Where the checkpoint tensor of `shape` that fills `box` ((offset, extent) in
    its parameter's dims; the tensor's dims are the box's, size-1 dims aside) meets
    this rank's `rows` (local_slices): (slices of the checkpoint tensor, slices of
    the rank's local part), or None when they do not meet."""
    offset, extent = box
    lows = [max(o, r.start) for o, r in zip(offset, rows)]
    highs = [min(o + e, r.stop) for o, e, r in zip(offset, extent, rows)]
    if any(lo >= hi for lo, hi in zip(lows, highs)):
        return None
    inside = iter([(lo - o, hi - o) for lo, hi, o, e in zip(lows, highs, offset, extent) if e != 1])
    source = tuple(slice(0, 1) if n == 1 else slice(*next(inside)) for n in shape)
    target = tuple(slice(lo - r.start, hi - r.start) for lo, hi, r in zip(lows, highs, rows))
    return source, target


def copy_from_full(model, state: dict[str, torch.Tensor]) -> None:
    """Fill `model` (from `empty_model`) from `state`, whole tensors by the
    model's parameter names (a transformers model's state_dict), each rank
    copying its own part. ValueError naming the parameters `state` lacks or
    holds in another shape, before a tensor is copied."""
    params = dict(model.named_parameters())
    bad = [n for n, t in params.items() if n not in state or tuple(state[n].shape) != tuple(t.shape)]
    if bad:
        raise ValueError(f"the state does not hold {type(model).__name__}'s parameters {bad[:4]} in their shapes")
    with torch.no_grad():
        for name, t in params.items():
            local_part(t).copy_(state[name][local_slices(t)])


def copy_shards(model, source) -> None:
    """Fill `model` (from `empty_model`) from `source`, a model of the same class
    and sharding: each rank copies its own shards, cast to `model`'s dtype.
    ValueError naming the first parameter whose name, shape or placement differs."""
    from torch.distributed.tensor import DTensor

    mine, theirs = dict(model.named_parameters()), dict(source.named_parameters())
    if mine.keys() != theirs.keys():
        raise ValueError(f"copy_shards: the models' parameters differ: {sorted(mine.keys() ^ theirs.keys())[:4]}")
    for name, t in mine.items():
        s = theirs[name]
        if t.shape != s.shape or isinstance(t, DTensor) != isinstance(s, DTensor) or (
                isinstance(t, DTensor) and t.placements != s.placements):
            raise ValueError(f"copy_shards: {name} is {list(s.shape)} in the source, {list(t.shape)} here, or "
                             "placed otherwise")
        with torch.no_grad():
            local_part(t).copy_(local_part(s))
