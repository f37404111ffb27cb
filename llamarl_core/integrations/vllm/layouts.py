"""The engine's destination layout, read off its own loaders.

vLLM's `model.load_weights` knows how each checkpoint tensor lands in the
engine's parameters for its config and rank: q/k/v and gate/up packed, tensor-
parallel slices, the padded vocabulary, experts stacked into `w13_weight` /
`w2_weight`, expert parallelism, tied embeddings. `derive_rank_layout` runs it
on view probes (llamarl_core/sync/probe.py) of the trainer's logical tensors,
against the meta placeholders vLLM recorded for its layers at model init (the
live tensors may be packed, freed or re-laid out by then), and records where
every copy would land: nothing is written, nothing described again by hand.
Each tensor-parallel worker derives its own rank; `gather_layout` assembles
the engine's whole layout through the Store (JSON, never pickles).

A parameter no trainer tensor fills, other than the vocabulary's padding rows,
and one the engine computes from loaded weights after loading (a parameter
vLLM did not record at init; MLA attention's absorbed `W_UK_T` / `W_UV`, which
some CPU backends keep as packed copies no parameter list shows), are refused
by name: a sync would leave them stale.
"""

from __future__ import annotations

import contextlib
import json
import time

import torch
import torch.distributed as dist

from ...sync.layout import Explicit, Fragment, Layout, ParamSpec, strided_fragments, view_2d
from ...sync.probe import ProbeError, ViewProbe, recording


@contextlib.contextmanager
def meta_placeholders(model: torch.nn.Module, materialize: bool = False):
    """Every layer's tensors swapped for the meta placeholders vLLM recorded at
    model init (their shapes before any post-processing), the live ones put back
    after. Yields {placeholder storage key: (parameter name, placeholder)}.
    materialize: the placeholders made real (zeros on the device vLLM loads on),
    for a `load_weights` that writes (loader_writes)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import (
        materialize_meta_tensor,
        restore_layer_on_meta,
        to_meta_tensor,
    )
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_tensors

    saved = []
    try:
        for layer in model.modules():
            info = get_layerwise_info(layer)
            saved.append((layer, get_layer_params_buffers(layer), set(layer._non_persistent_buffers_set)))
            restore_layer_on_meta(layer, info)
            if materialize:
                with info.restore_device:
                    for name, tensor in get_layer_tensors(layer).items():
                        # A zeroed tensor of the placeholder's class and attributes; those vLLM
                        # keeps live rather than on meta (biases) copied too, never written.
                        fresh = materialize_meta_tensor(tensor if tensor.is_meta else to_meta_tensor(tensor))
                        fresh.data.zero_()
                        setattr(layer, name, fresh)
        found: dict[int, tuple[str, torch.Tensor]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):  # a module under two names: the first
            found.setdefault(param.untyped_storage()._cdata, (name, param))
        yield found
    finally:
        for layer, (params, buffers), non_persistent in saved:
            for name in list(get_layer_tensors(layer)):
                delattr(layer, name)
            for name, param in params.items():
                layer.register_parameter(name, param)
            for name, buffer in buffers.items():
                layer.register_buffer(name, buffer, persistent=name not in non_persistent)


def loader_writes(model: torch.nn.Module, weights) -> dict[str, torch.Tensor]:
    """What the model's own `load_weights` writes from `weights` ((checkpoint name,
    tensor) pairs), into zeroed copies of vLLM's placeholders: parameter name ->
    tensor (its shape before any post-processing). The live parameters are
    untouched. The reference a derived layout is checked against."""
    with meta_placeholders(model, materialize=True) as placeholders:
        model.load_weights(iter(weights))
        return {name: param.detach().clone() for name, param in placeholders.values()}


def _padding_rows(model: torch.nn.Module, name: str, local_rows: int) -> tuple[int, int] | None:
    """Local rows [start, stop) of a vocabulary-parallel embedding that are padding."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    module = model.get_submodule(name.rpartition(".")[0])
    if not isinstance(module, VocabParallelEmbedding) or name.rpartition(".")[2] != "weight":
        return None
    return (module.shard_indices.num_org_elements, local_rows)


def derive_rank_layout(model: torch.nn.Module, logical: dict[str, tuple[int, ...]], dtype: torch.dtype,
                       rank: int) -> Layout:
    """This worker's part of the engine layout, a one-rank Layout of Explicit
    placements, from running the model's own `load_weights` on probes of the
    trainer's `logical` tensors.
    ValueError naming the culprit: a loader that computes instead of copying, a
    trainer tensor the engine does not take, a parameter nothing fills."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    mla = [name for name, module in model.named_modules() if isinstance(module, MLAAttention)]
    if mla:  # parameters (W_UK_T / W_UV) or, by backend, packed copies that no parameter list shows (amx_mla)
        raise ValueError(f"vLLM worker {rank}: the engine computes the absorbed MLA weights of {mla[0]!r} (W_UK_T / "
                         "W_UV, or packed copies of them) from loaded weights after loading; llamarl_ddma does not "
                         "recompute them, and a sync would leave them stale")
    live = dict(model.named_parameters())
    by_param: dict[str, list[Fragment]] = {name: [] for name in live}
    with meta_placeholders(model) as placeholders:
        shapes = {name: tuple(p.shape) for _, (name, p) in placeholders.items()}
        targets = {key: name for key, (name, _) in placeholders.items()}  # written only by copies from probes
        try:  # one call for every tensor (a loader walks the model per call)
            with recording(targets) as copies:
                model.load_weights([(source, ViewProbe.of(source, shape, dtype)) for source, shape in logical.items()])
        except Exception:  # again one tensor at a time, to name the culprit
            for source, shape in logical.items():
                with recording(targets):
                    try:
                        model.load_weights([(source, ViewProbe.of(source, shape, dtype))])
                    except ProbeError as exc:
                        raise ValueError(f"vLLM worker {rank}: {exc}") from None
                    except Exception as exc:
                        raise ValueError(f"vLLM worker {rank}: the engine does not take the trainer's {source!r} "
                                         f"{shape}: {type(exc).__name__}: {exc}") from None
            raise
        for copy in copies:
            source, shape = copy.source, logical[copy.source]
            key = copy.dst.untyped_storage()._cdata
            if key not in placeholders:
                raise ValueError(f"vLLM worker {rank}: the loader of {source!r} writes a tensor that is no "
                                 "parameter of the model")
            name, param = placeholders[key]
            if not param.is_contiguous():
                raise ValueError(f"vLLM worker {rank}: parameter {name!r} is not contiguous")
            if name not in by_param:
                raise ValueError(f"vLLM worker {rank}: the loader of {source!r} writes {name!r}, which the live "
                                 "model ties to another parameter")
            by_param[name].extend(strided_fragments(
                source, shape, copy.src_offset, copy.src_strides, tuple(param.shape),
                copy.dst.storage_offset() - param.storage_offset(), tuple(copy.dst.stride()), copy.extent))
    derived = [name for name in by_param if name not in shapes]
    if derived:  # created by process_weights_after_loading from loaded weights (MLA's absorbed W_UK_T / W_UV)
        raise ValueError(f"vLLM worker {rank}: the engine computes parameter {derived[0]!r} from loaded weights after "
                         f"loading ({len(derived)} such: {', '.join(derived[:3])}); llamarl_ddma does not recompute it, "
                         "and a sync would leave it stale")
    specs = []
    for name, fragments in by_param.items():
        shape = shapes[name]
        rows, cols = view_2d(shape)
        written = sum(f.num_rows * f.num_cols for f in fragments)
        padding = None
        if written < rows * cols:
            padding = _padding_rows(model, name, rows)
            if padding is None or written != padding[0] * cols:
                raise ValueError(f"vLLM worker {rank}: the engine's parameter {name!r} {shape} gets "
                                 f"{written} of its {rows * cols} elements from the trainer's tensors; a sync "
                                 "would leave the rest stale (a trainer that hands only some tensors, such as one that "
                                 "sends its trainable parameters alone, with some frozen; or a trainer of another "
                                 "model or family?)")
        sources = tuple((source, tuple(logical[source])) for source in sorted({f.source for f in fragments}))
        placement = Explicit(sources, (shape,), (tuple(fragments),), (padding,) if padding else None)
        specs.append(ParamSpec(name, shape, live[name].dtype, placement))
    return Layout(1, specs)


def assemble_layout(ranks: list[Layout], logical: dict[str, tuple[int, ...]]) -> Layout:
    """The engine's Layout from every rank's derive_rank_layout."""
    specs = []
    for name, first in ranks[0].params.items():
        if any(name not in part.params for part in ranks):
            raise ValueError(f"vLLM parameter {name!r} exists on some tensor-parallel ranks only")
        parts = [part.params[name].placement for part in ranks]
        sources = sorted({source for part in parts for source, _ in part.sources})
        padding = None
        if any(part.padding for part in parts):
            padding = tuple(part.padding[0] if part.padding else (0, 0) for part in parts)
        placement = Explicit(tuple((source, tuple(logical[source])) for source in sources),
                             tuple(part.local_shapes[0] for part in parts),
                             tuple(part.fragments[0] for part in parts), padding)
        specs.append(ParamSpec(name, first.shape, first.dtype, placement))
    layout = Layout(len(ranks), specs)
    check_sources_read_whole(layout, logical)
    return layout


def check_sources_read_whole(layout: Layout, logical: dict[str, tuple[int, ...]]) -> None:
    """Every element of every trainer tensor is read by some rank (vLLM's loaders
    cut a tensor to the engine's own shard sizes without checking its whole size,
    and skip names they do not know: a trainer model larger than the engine's, or
    with tensors it has not, would otherwise leave them unsent, silently).
    ValueError naming the tensor."""
    rects: dict[str, set[tuple[int, int, int, int]]] = {}
    for name in layout.params:
        for rank in range(layout.world_size):
            for f in layout.fragments(name, rank):  # a rectangle several ranks read (replicated KV heads) counts once
                rects.setdefault(f.source, set()).add((f.src_row, f.src_row + f.num_rows, f.src_col,
                                                       f.src_col + f.num_cols))
    unread = sorted(set(logical) - set(rects))
    if unread:
        raise ValueError(f"the engine reads nothing of the trainer's {unread[0]!r} ({len(unread)} such tensors): the "
                         "trainer's model is not the engine's, or the engine's loader drops it")
    for source, read in rects.items():
        rows, cols = view_2d(tuple(logical[source]))
        read = sorted(read)
        for i, a in enumerate(read):
            for b in read[i + 1:]:
                if b[0] >= a[1]:
                    break
                if a[2] < b[3] and b[2] < a[3]:
                    raise ValueError(f"the engine reads rows [{max(a[0], b[0])}, {min(a[1], b[1])}) of the trainer's "
                                     f"{source!r} in two different places")
        area = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in read)
        if area != rows * cols:
            raise ValueError(f"the engine reads {area} of the {rows * cols} elements of the trainer's {source!r} "
                             f"{tuple(logical[source])}: the trainer's model is not the engine's (another size?)")


def publish(store: dist.Store, key: str, rank: int, part: dict) -> int:
    """This rank's part ({"layout": its Layout's dict}, or {"error": reason}) under
    its next generation; returns the generation."""
    generation = store.add(f"{key}/generation/{rank}", 1)
    store.set(f"{key}/{generation}/{rank}", json.dumps(part))
    return generation


def gather_layout(store: dist.Store, key: str, rank: int, world_size: int, mine: Layout,
                  logical: dict[str, tuple[int, ...]], timeout_s: float) -> Layout:
    """Every tensor-parallel worker publishes its part under `key` and reads the
    others' (a generation counter per rank keeps an earlier engine's parts apart).
    A peer that published {"error": reason} (publish) has that reason raised."""
    generation = publish(store, key, rank, {"layout": mine.to_dict()})
    keys = [f"{key}/{generation}/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    pending = list(keys)
    while pending:
        pending = [k for k in pending if not store.check([k])]
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"vLLM worker {rank}: no derived layout from {pending} within {timeout_s} s")
        time.sleep(0.01 if pending else 0)
    parts = [json.loads(store.get(k)) for k in keys]
    failed = [(r, part["error"]) for r, part in enumerate(parts) if "error" in part]
    if failed:  # a peer could not derive its part: its reason, not a timeout here
        raise ValueError(f"vLLM worker {failed[0][0]}: {failed[0][1]}")
    return assemble_layout([Layout.from_dict(part["layout"]) for part in parts], logical)
