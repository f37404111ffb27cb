"""The worker side of `llamarl_ddma`: one DdmaWeightTransferEngine per vLLM
worker (tensor-parallel rank), created by vLLM once the model is loaded.

`init_transfer_engine` derives the worker's destination layout from the
engine's own loaders, run on probes of the trainer's logical tensors
(layouts.py: packed q/k/v and gate/up, TP slices, the padded vocabulary,
stacked experts, tied embeddings; any family vLLM loads), or for FP8 weights
and their scales from `vllm_llama_tp` (the Llama family); checks the live
model and the trainer's layout against it, and only then connects a
WeightReceiver: a mismatch is refused before any byte moves, naming the
parameter. `receive_weights` takes one version.

Where the bytes land:
- GPU: in the parameters themselves (kernel format: fused q/k/v and gate/up, TP
  slices, padded vocabulary; FP8 weights with their scales, written together),
  no layer-by-layer reload. A failed sync leaves them torn: `update_weights`
  raises, and generation must stay paused until a sync completes. Not yet run on
  a GPU: FP8 scales that vLLM rewrites for DeepGEMM (block FP8 on Hopper) are not
  in the layout's format.
- CPU: vLLM computes every linear layer (lm_head and a tied embedding too) from
  a oneDNN-packed copy of its weight and frees the weight itself, so bytes
  written into parameters change nothing; its MoE layers hold their experts
  pre-packed. The sync lands in full-size buffers of this worker's own; once a
  version is complete, the norms and embeddings are copied from them, the
  linears re-packed and the experts pre-packed again (`commit`). A failed sync
  leaves the engine serving the last complete version, untouched.
"""

from __future__ import annotations

import dataclasses
import datetime
import time

import torch
import torch.distributed as dist
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ...control.auth import AuthenticatedStore, parse_secret, required_secret
from ...sync import SyncError, WeightReceiver, plan_transfer
from ...sync.layout import Layout
from ...sync.presets import vllm_llama_tp
from .layouts import derive_rank_layout, gather_layout, loader_writes, meta_placeholders, publish

_FP8_SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")


@dataclasses.dataclass
class DdmaInitInfo(WeightTransferInitInfo):
    """See the package docstring (`ddma_init_info` builds it)."""

    store_host: str
    store_port: int
    trainer_layout: dict
    name: str = "weights"
    timeout_s: float = 120.0
    transport: str = "auto"
    replica: int = 0
    num_replicas: int = 1
    # Hex; None: this worker's environment (LLAMARL_SECRET / LLAMARL_SECRET_FILE). Not in the repr (logs).
    secret: str | None = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass
class DdmaUpdateInfo(WeightTransferUpdateInfo):
    version: int | None = None
    timeout_s: float | None = None


# ----------------------------------------------------------------------------- the live model


def _packed_on_cpu(module: torch.nn.Module) -> bool:
    """vLLM's CPU backend computes this layer from a packed copy of its weight."""
    return hasattr(module, "cpu_linear")


def live_parameters(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
    """name -> (the tensor a sync writes, the local shape it holds).
    - A CPU linear whose weight vLLM freed after packing it (an empty tensor)
      holds its partition's shape (the tensor is then that empty one).
    - An FP8 weight that vLLM keeps as the transposed view of an (N, K) tensor
      (its per-tensor and per-channel FP8 GEMMs read it so) is written through
      that (N, K) tensor: the same storage, in the layout's row order."""
    modules = dict(model.named_modules())
    initial_shapes = {}
    if any(p.numel() == 0 for p in model.parameters()):  # the shapes vLLM recorded before packing
        with meta_placeholders(model) as placeholders:
            initial_shapes = {n: tuple(p.shape) for n, p in placeholders.values()}
    out = {}
    for name, param in model.named_parameters():
        module = modules[name.rpartition(".")[0]]
        tensor = param.data
        if tensor.dtype == torch.float8_e4m3fn and tensor.dim() == 2 and not tensor.is_contiguous() \
                and tensor.t().is_contiguous():
            tensor = tensor.t()
        shape = tuple(tensor.shape)
        if name.endswith(".weight") and tensor.numel() == 0 and _packed_on_cpu(module):
            shape = initial_shapes[name]
        out[name] = (tensor, shape)
    return out


def fp8_granularity(live: dict[str, tuple[torch.Tensor, tuple[int, ...]]]) -> str | None:
    """The granularity of the live model's FP8 weights (None: no FP8 weights). Raises,
    naming it, on an FP8 weight without a scale, or on mixed granularities."""
    found = {}
    for name, (param, shape) in live.items():
        if not name.endswith(".weight") or param.dtype != torch.float8_e4m3fn:
            continue
        base = name[: -len("weight")]
        if base + "weight_scale_inv" in live:
            found[name] = "block"
        elif base + "weight_scale" in live:
            found[name] = "channel" if live[base + "weight_scale"][1][:1] == shape[:1] and shape[0] > 1 else "tensor"
        else:
            raise ValueError(f"FP8 destination {name!r} has no scale ({base}weight_scale or {base}weight_scale_inv): "
                             "an FP8 weight is written with its scale, never without")
    kinds = set(found.values())
    if len(kinds) > 1:
        raise ValueError(f"the engine's FP8 weights mix granularities {sorted(kinds)}: " + ", ".join(
            f"{n} ({g})" for n, g in list(found.items())[:4]))
    return kinds.pop() if kinds else None


def engine_layout(hf_config, tp_size: int, dtype: torch.dtype, fp8: str) -> Layout:
    """An FP8 engine's layout: the Llama-family preset (vllm_llama_tp), the format
    whose weights and scales sync/fp8.py writes; ValueError for other families."""
    try:
        return vllm_llama_tp(hf_config, tp_size, dtype, fp8=fp8)
    except ValueError as exc:
        raise ValueError(f"llamarl_ddma syncs FP8 weights in the Llama-family preset's format only "
                         f"(architectures {getattr(hf_config, 'architectures', None)}): {exc}") from None


def check_live_model(layout: Layout, rank: int, live: dict[str, tuple[torch.Tensor, tuple[int, ...]]]) -> None:
    """The live model holds exactly the tensors `layout` gives `rank`: ValueError
    naming the first one missing, extra, or of another shape or dtype."""
    expected = layout.local_tensor_specs(rank)
    for name, (shape, dtype) in expected.items():
        if name not in live:
            raise ValueError(f"vLLM worker {rank}: the engine's model has no parameter {name!r}, which the "
                             f"{layout.world_size}-way vLLM layout of its config has")
        param, live_shape = live[name]
        if live_shape != shape or param.dtype != dtype:
            raise ValueError(f"vLLM worker {rank}: parameter {name!r} is {live_shape} {param.dtype} in the engine, "
                             f"its layout says {shape} {dtype}")
    extra = sorted(set(live) - set(expected))
    if extra:
        raise ValueError(f"vLLM worker {rank}: the engine's model has parameter {extra[0]!r} that no layout "
                         f"covers ({len(extra)} such); a sync would leave it stale")


# ----------------------------------------------------------------------------- the engine


class DdmaWeightTransferEngine(WeightTransferEngine[DdmaInitInfo, DdmaUpdateInfo]):
    init_info_cls = DdmaInitInfo
    update_info_cls = DdmaUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.receiver: WeightReceiver | None = None
        self.version: int | None = None
        self._commit = None

    def init_transfer_engine(self, init_info: DdmaInitInfo) -> None:
        if self.receiver is not None:
            raise SyncError("llamarl_ddma: init_weight_transfer_engine was already called on this worker; "
                            "call shutdown_weight_transfer_engine first")
        for what, size in (("data", self.parallel_config.data_parallel_size),
                           ("pipeline", self.parallel_config.pipeline_parallel_size)):
            if size > 1:  # every replica / stage would register as the same receiver ranks
                raise ValueError(f"llamarl_ddma supports tensor parallelism only, not {what} parallel size {size}")
        rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        live = live_parameters(self.model)
        trainer_layout = Layout.from_dict(init_info.trainer_layout)
        secret = required_secret(None if init_info.secret is None else parse_secret(init_info.secret, "init_info's secret"),
                                 f"llamarl_ddma worker {rank}")
        store = dist.TCPStore(init_info.store_host, init_info.store_port, is_master=False,
                              timeout=datetime.timedelta(seconds=init_info.timeout_s))
        # The workers' derived layouts travel through the Store too: authenticated, as the sync's values.
        layouts = AuthenticatedStore(store, secret, label=f"llamarl/vllm/{init_info.name}/")
        fp8 = fp8_granularity(live)
        try:
            if fp8 is not None:  # FP8 weights and their scales: the Llama-family preset's format
                layout = engine_layout(self.model_config.hf_config, tp_size, self.model_config.dtype, fp8)
            else:
                logical = trainer_layout.logical_shapes()
                key = f"{init_info.name}/engine_layout"
                try:
                    mine = derive_rank_layout(self.model, logical, self.model_config.dtype, rank)
                except Exception as exc:  # published, so the peers raise this rather than time out
                    reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                    publish(layouts, key, rank, {"error": reason})
                    raise
                layout = gather_layout(layouts, key, rank, tp_size, mine, logical, init_info.timeout_s)
            check_live_model(layout, rank, live)
            plan_transfer(trainer_layout, layout)
        except ValueError as exc:
            raise ValueError(f"the trainer's model does not match the vLLM engine's ({self.model_config.model}): "
                             f"{exc}") from exc
        on_cpu = self.device.type == "cpu"
        if on_cpu:
            tensors, self._commit = _cpu_destinations(self.model, layout, rank, live)
        else:
            moe = [name for name, module in self.model.named_modules() if _moe_experts(module) is not None]
            if moe:
                raise ValueError(f"llamarl_ddma: MoE layer {moe[0]!r} on {self.device}: the format its expert kernel "
                                 "keeps w13 / w2 in after loading is not yet verified on a GPU; MoE runs on CPU engines")
            tensors = {name: live[name][0] for name in layout.local_tensor_specs(rank)}
        self.receiver = WeightReceiver(store, layout, rank, tensors, name=init_info.name,
                                       transport=init_info.transport, timeout=init_info.timeout_s, secret=secret,
                                       replica=init_info.replica, num_replicas=init_info.num_replicas)

    def pending_version(self) -> int | None:
        """The version the trainer ranks offer this worker and it has not taken yet
        (WeightReceiver.pending: no wait), None while there is none: a server
        pauses generation for an update once every worker has one, and the senders'
        work before their offer (the scans of a delta) runs beside generation."""
        if self.receiver is None:
            raise SyncError("llamarl_ddma: call init_weight_transfer_engine before asking for a pending version")
        return self.receiver.pending()

    def start_weight_update(self) -> None:
        if self.receiver is None:
            raise SyncError("llamarl_ddma: call init_weight_transfer_engine before a weight update")

    def receive_weights(self, update_info: DdmaUpdateInfo) -> None:
        """One version from the trainer ranks, complete, then (CPU) committed."""
        if self.receiver is None:
            raise SyncError("llamarl_ddma: call init_weight_transfer_engine before update_weights")
        version = self.receiver.receive(timeout=update_info.timeout_s)
        if update_info.version is not None and version != update_info.version:
            if self._commit is None:  # in place: the bytes are the live weights already
                self.version = version
                raise SyncError(f"llamarl_ddma: the trainer sent version {version}, update_weights asked for "
                                f"{update_info.version}; the engine now holds version {version}")
            raise SyncError(f"llamarl_ddma: the trainer sent version {version}, update_weights asked for "
                            f"{update_info.version}; not committed, the engine keeps version {self.version}")
        if self._commit is not None:
            self._commit()
        self.version = version

    def finish_weight_update(self) -> None:
        pass  # the bytes are in place once receive_weights returns

    @property
    def commit_seconds(self) -> float:
        """How long the last commit (CPU: copies and re-packing) took; 0 on GPU."""
        return self._commit.seconds if self._commit is not None else 0.0

    def differences_from_loader(self, weights) -> list[str]:
        """The synced tensors of this worker against what vLLM's own `load_weights`
        writes from `weights` (checkpoint-named tensors; layouts.loader_writes),
        compared bit for bit before any post-processing (CPU: the landing tensors
        the commit packs from; the vocabulary's padding rows left out, which the
        loader zeroes and a sync keeps). Returns one line per parameter that
        differs (empty: the derived layout is what the loader does)."""
        receiver = self.receiver
        if receiver is None:
            raise SyncError("llamarl_ddma: call init_weight_transfer_engine first")
        if any(spec.fp8 is not None for spec in receiver.layout.params.values()):
            raise SyncError("llamarl_ddma: an FP8 engine's weights are quantized on the way; there is no loader "
                            "output to compare them with bit for bit")
        expected = loader_writes(self.model, weights)
        differences = []
        for name, synced in receiver.tensors.items():
            want, got = expected[name], synced
            pad_start, pad_stop = receiver.layout.padding_rows(name, receiver.rank)
            if pad_stop > pad_start:
                want, got = want[:pad_start], got[:pad_start]
            if not torch.equal(got.cpu(), want.cpu()):
                worst = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else "shape"
                differences.append(f"worker {receiver.rank}: {name} {tuple(want.shape)} differs from the loader's "
                                   f"(max |difference| {worst})")
        return differences

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        self._commit = None


def _moe_experts(module: torch.nn.Module):
    """The expert kernel of a vLLM MoE layer (one holding `w13_weight`): its
    `fused_experts` object, or the quant method itself when it has none (never
    None for a MoE layer, so that no expert weight is copied unrecognised);
    None for any other module."""
    if not hasattr(module, "w13_weight"):
        return None
    method = getattr(module, "quant_method", None)
    return getattr(getattr(method, "moe_kernel", None), "fused_experts", None) or method or module


def _cpu_destinations(model: torch.nn.Module, layout: Layout, rank: int, live: dict):
    """Landing tensors of this worker's own (initialised from the live values, so
    the vocabulary's padding rows keep theirs), and the commit that applies a
    complete version: copy into live parameters, then re-pack every packed layer."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    landing = {}
    for name, (shape, dtype) in layout.local_tensor_specs(rank).items():
        param = live[name][0]
        landing[name] = param.detach().clone() if param.numel() else torch.zeros(shape, dtype=dtype)
    name_of = {id(p): n for n, p in model.named_parameters()}
    prepacked = []  # (MoE layer, landing w13, landing w2, the kernel's ISA): re-packed, never copied
    for module_name, module in model.named_modules():
        experts = _moe_experts(module)
        if experts is None:
            continue
        if type(experts).__name__ != "CPUUnquantizedExperts" or getattr(experts, "_use_zentorch", False):
            raise ValueError(f"vLLM worker {rank}: MoE layer {module_name!r} runs {type(experts).__name__}, whose "
                             "weight format llamarl_ddma does not re-create after a sync")
        w13, w2 = f"{module_name}.w13_weight", f"{module_name}.w2_weight"
        if experts._padded_intermediate_size(experts.moe_config) != experts.moe_config.intermediate_size_per_partition:
            raise ValueError(f"vLLM worker {rank}: MoE layer {module_name!r} pads its intermediate size "
                             f"{experts.moe_config.intermediate_size_per_partition} per rank after loading, which "
                             "llamarl_ddma does not re-create (a multiple of 32 per rank is not padded)")
        prepacked.append((module, landing[w13], landing[w2], experts.isa))
    repacked = {id(t) for _, w13, w2, _ in prepacked for t in (w13, w2)}
    copies = [(live[n][0], t) for n, t in landing.items() if live[n][0].numel() and id(t) not in repacked]
    packed = []  # (module, landing weight or None when the module keeps its weight)
    for module_name, module in model.named_modules():
        if not _packed_on_cpu(module) or not isinstance(getattr(module, "weight", None), torch.Tensor):
            continue
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
            # vLLM packs the input embedding too, but only lm_head (tied or not: a module
            # of its own) computes from a packed copy. Skipping it: 0.24 s instead of
            # 0.65 s to re-pack a 0.58 GiB fp32 model with a 32000-row vocabulary.
            continue
        name = name_of.get(id(module.weight))
        if name is None:
            raise ValueError(f"vLLM worker {rank}: packed layer {module_name!r} has a weight no parameter name holds")
        packed.append((module, None if module.weight.numel() else landing[name]))

    def commit() -> None:
        start = time.monotonic()
        with torch.no_grad():
            for param, src in copies:
                param.copy_(src)
            for module, w13, w2, isa in prepacked:
                torch.ops._C.prepack_moe_weight(w13, module.w13_weight.data, isa)
                torch.ops._C.prepack_moe_weight(w2, module.w2_weight.data, isa)
            for module, weight in packed:
                if weight is None:
                    dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                    continue
                freed = module.weight
                module.weight = torch.nn.Parameter(weight, requires_grad=False)
                try:
                    dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                finally:
                    module.weight = freed
        commit.seconds = time.monotonic() - start

    commit.seconds = 0.0
    return landing, commit
