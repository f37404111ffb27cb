"""TRL's vLLM fed by DDMA: `DdmaVLLMGeneration`, the engine
`GRPOTrainer(use_vllm=True)` generates with, colocated or a server.

Colocated: TRL builds its colocated engine (`trl.generation.vllm_generation.
VLLMGeneration`) in the trainer's process and syncs it by gathering every
parameter whole and calling the engine's `load_weights` once per tensor. Here the
engine is built by this subclass with the `llamarl_ddma` weight-transfer backend
and dummy weights, and `sync_weights` sends the trainer's parameters, in place
and in one transfer, straight into the engine's own (on a CPU engine into its
landing buffers, then re-packed: vLLM's CPU layers compute from packed copies,
which TRL's per-tensor `load_weights` fails on). The trainer's WeightSender and
the engine's receiver live in this one process: the set-up and each sync run
the sender and the engine's calls at once (pairing.py).

A PEFT model (LoRA): the sender is registered on its base weights under the
names vLLM loads (TRL's naming: `.base_layer` and the wrapper's prefix dropped,
the adapters' own tensors left out); each sync merges the adapters into those
weights in place (peft's merge_adapter), sends them and unmerges, as TRL's own
sync does around its load_weights, after checking that the merge left every
registered weight in its storage, and restores the adapted weights bit for bit.
DoRA, trainable tokens, other PEFT methods and adapters on an embedding or
lm_head are left to TRL (colocate_refusal).

Several processes, each with its own engine as in TRL's colocate mode:
- DDP (every rank holds the whole model): each rank's engine takes that rank's
  weights from that rank's sender, over a Store and secret of its own; nothing
  crosses ranks.
- FSDP2 (accelerate's plugin, or the caller's own `fully_shard` or
  tensor-parallel plan: DTensor parameters on a mesh over the job's ranks, all
  on one host): every engine needs the whole model and no rank holds it. One
  sync over a Store served by rank 0 (its port and the secret broadcast over the
  job's process group): each rank sends only its own shards, never gathered, to
  rank 0's engine (replica 0), which relays each version on to the other ranks'
  engines (replicas 1 .. N-1, down a binary tree) before its receive returns.
  Whether to register again is decided by all ranks together.

What it does not serve (colocate_refusal: FSDP1's flat parameters and DeepSpeed
ZeRO-3's partitions on several processes, FSDP2 over several hosts or with its
shards offloaded to the CPU, a sharded PEFT model; an engine tensor-parallel
group; vLLM's sleep mode, which discards the weights a sync writes into; a
quantized model; a model of experts on a GPU; a model vLLM holds in a dtype the
sync cannot write the trainer's into) GRPOTrainer leaves to TRL's own engine and
sync on a GPU, with a warning naming the reason, and refuses on a CPU engine,
where TRL's own sync fails (its load_weights on the layers vLLM's CPU backend
re-packs after loading: `llamarl bench trl --vllm`); ZeRO-3 it refuses before,
for its head. An engine built in a dtype the sync cannot write the trainer's
parameters in is refused at construction (_check_engine_dtype).

Server (`vllm_mode="server"`): TRL's client generates as it does; a server
running the llamarl_ddma backend (server.py has its command line) takes its
weights through DdmaWeightTransfer on the main process, fed from TRL's own walk
of the parameters (which gathers them under FSDP or ZeRO-3, every rank taking
part, and merges a PEFT model's adapters first), where TRL's sync needs NCCL and
a CUDA trainer. A server running another backend (the nccl of `trl
vllm-serve`) keeps TRL's own sync. Tested with one and with two (DDP) trainer
processes.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import os
import re
import socket
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType, broadcast, is_peft_model, reduce
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration
from trl.trainer.utils import ensure_master_addr_port

from ...control.auth import SECRET_BYTES, new_secret
from ...sync import Layout, ParamSpec, SyncError, WeightSender, module_layout, module_sender
from ...sync.plan import castable
from ...sync.protocol import check_timeout
from ..vllm import BACKEND, ddma_init_info
from .pairing import register_while, send_while
from .server import DdmaWeightTransfer, address_toward

SYNC_NAME = "trl-colocate"
DELTA_ENV = "LLAMARL_SYNC_DELTA"  # "1": server mode's syncs go as deltas to a server on another host
TIMEOUT_ENV = "LLAMARL_SYNC_TIMEOUT_S"  # seconds a registration or a sync may take (TIMEOUT_S unless set)
TIMEOUT_S = 300.0


def _embedding_names(model) -> list[str]:
    """The module names of `model`'s input and output embeddings (a PEFT model's
    base model's), whatever the family calls them (wte, word_embeddings, ...); none
    for a model not yet loaded (a folder or hub id)."""
    if not isinstance(model, torch.nn.Module):
        return []
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embeddings = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            embeddings.append(getattr(base, getter)())
        except (AttributeError, NotImplementedError):  # a model that does not say: found by name alone
            pass
    return [name for name, module in base.named_modules() if any(module is e for e in embeddings if e is not None)]


def _matches(patterns, name: str) -> bool:
    """PEFT's rule for target_modules and the like: a list entry matches a module
    name or its last dotted parts, a string the whole name as a regular expression."""
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    return any(name == p or name.endswith("." + p) for p in patterns or ())


def _targets(config, names: list[str]) -> bool:
    """Whether the LoraConfig's target_modules (less its exclude_modules) or
    modules_to_save reach one of `names`."""
    return any(_matches(config.modules_to_save, n) or
               (_matches(config.target_modules, n) and not _matches(getattr(config, "exclude_modules", None), n))
               for n in names)


def _peft_refusal(configs, model) -> str | None:
    """Why the in-place merge cannot serve these PEFT configs, or None: LoRA alone
    (DoRA's and trainable tokens' merges rebind weights, prompt learning has none
    to merge), never on an embedding or lm_head (with tied embeddings its delta
    would reach vLLM's tied lm_head), found by name and, on a loaded model, as
    its embedding modules."""
    embeddings = _embedding_names(model)
    for config in configs:
        kind = type(config).__name__
        if kind != "LoraConfig":
            return f"a PEFT {kind} (llamarl's colocated sync merges LoRA adapters only)"
        for option in ("use_dora", "trainable_token_indices"):
            if getattr(config, option, None):
                return f"LoraConfig({option}=...) (its merge rebinds the weights the sync sends from)"
        targets = {*(config.modules_to_save or ()),
                   *([config.target_modules] if isinstance(config.target_modules, str) else
                     config.target_modules or ())}
        if any("embed" in t or "lm_head" in t for t in targets) or _targets(config, embeddings):
            return ("LoRA or modules_to_save on an embedding or lm_head (with tied embeddings its delta would reach "
                    "the other; the sync merges in place)")
    return None


FSDP2 = "FSDP2"  # accelerate's FSDP2 plugin
DTENSORS = "DTensor parameters"  # sharded by the caller (fully_shard, a tensor-parallel plan)
OFFLOADED = "FSDP2 with CPU offload"


def sharding_of(args) -> str | None:
    """What shards the trainer's parameters over its processes under these
    TrainingArguments: "FSDP2" or "FSDP1" (its `fsdp_config` version, 2 by
    default in transformers; accelerate launch's FSDP plugin: FSDP_VERSION, 1 by
    default in accelerate), OFFLOADED (FSDP2 with `cpu_offload` /
    FSDP_OFFLOAD_PARAMS), "DeepSpeed ZeRO-3", or None."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if getattr(args, "fsdp", None):
        fsdp_config = getattr(args, "fsdp_config", None) or {}
        version, offload = int(fsdp_config.get("version", 2)), bool(fsdp_config.get("cpu_offload", False))
    elif os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
        version = int(os.environ.get("FSDP_VERSION", "1"))
        offload = os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() in ("1", "true")
    elif is_deepspeed_zero3_enabled():
        return "DeepSpeed ZeRO-3"
    else:
        return None
    return OFFLOADED if version == 2 and offload else f"FSDP{version}"


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on any rank of the job: a collective every rank calls."""
    return float(reduce(torch.tensor([float(flag)], device=device), reduction="sum")[0]) > 0


def several_hosts(num_processes: int, device: torch.device) -> bool:
    """Whether the job's processes run on more than one host (by host name): a
    collective every rank calls (a hash of each name against rank 0's, over the
    job's process group; nothing pickled); False for one process."""
    if num_processes == 1:
        return False
    digest = hashlib.sha256(socket.gethostname().encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:7], "little")], dtype=torch.int64, device=device)
    return any_rank(bool(broadcast(mine.clone(), from_process=0) != mine), device)


def dtensor_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    """The local shards of `model`'s DTensor parameters (none for a model no one sharded)."""
    return [p.to_local() for p in model.parameters() if hasattr(p, "to_local")]


def _local_store(timeout_s: float, port: int = 0) -> dist.TCPStore:
    """A TCPStore on 127.0.0.1 served by this process (port 0: on a free port), or the one served at `port`."""
    return dist.TCPStore("127.0.0.1", port, is_master=port == 0, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def colocate_refusal(model, num_processes: int, tensor_parallel_size: int, enable_sleep_mode: bool,
                     quantization_config=None, peft_config=None, sharding: str | None = None,
                     hosts_apart: bool = False, model_config=None, device_type: str = "cpu",
                     trainer_dtype: str | None = None) -> str | None:
    """Why DDMA cannot feed TRL's colocated engine for this set-up, or None. model:
    the trainer's `model` argument (a folder or hub id, or the model itself);
    peft_config: its peft_config argument (a PEFT model's own configs are read
    off the model); sharding: what shards the parameters over the processes
    (sharding_of), None for nothing (DDP, or one process: a sharding on one
    process is not refused here, the sync's own registration refuses what it
    cannot read); hosts_apart: whether the processes span several hosts
    (several_hosts); model_config: the model's transformers config where known
    (a model of experts on a GPU; a model vLLM holds in a dtype, engine_dtype, the
    sync cannot write the trainer's into: a float16 checkpoint, or any on a GPU
    below compute capability 8.0, trained in float32); device_type: the engine's
    ("cpu", "cuda"); trainer_dtype: the trainer's parameters' ("float32", ...;
    None: float32, TRL's default)."""
    if model_config is not None:
        text = model_config.get_text_config()
        experts = max((getattr(text, f, None) or 0 for f in _EXPERT_FIELDS), default=0)
        if experts and device_type != "cpu":
            return (f"a model of {experts} experts on {device_type} (llamarl_ddma writes MoE experts into CPU "
                    "engines only: the GPU kernels' layout of them is not verified)")
        engine, trainer = engine_dtype(model_config), trainer_dtype or "float32"
        held = getattr(torch, trainer, None)  # a name torch does not know is TRL's loading's to refuse
        if engine is not None and isinstance(held, torch.dtype) and not castable(held, getattr(torch, engine)):
            return (f"a model vLLM holds in {engine} on this device, trained in {trainer} (the sync casts float32 "
                    "to bfloat16 only, TRL's load_weights casts any)")
    configs = [peft_config] if peft_config is not None else []
    configs += list(getattr(model, "peft_config", {}).values()) if isinstance(model, torch.nn.Module) else []
    if num_processes != 1 and sharding is not None:
        if sharding not in (FSDP2, DTENSORS):
            return (f"{num_processes} processes with {sharding} (llamarl's colocated sync sends DTensor shards "
                    "where they live, FSDP2's or the caller's, or DDP's whole model)")
        if hosts_apart:
            return (f"{sharding} over several hosts (each engine needs every rank's shards; llamarl's colocated "
                    "sync relays them between the engines of one host)")
        if configs:
            return f"a PEFT model with {sharding} (llamarl's colocated sync merges the adapters of a whole model)"
    if tensor_parallel_size != 1:
        return f"vllm_tensor_parallel_size={tensor_parallel_size} (llamarl's colocated sync feeds one engine worker)"
    if enable_sleep_mode:
        return "vllm_enable_sleep_mode=True (sleep discards the engine's weights, which a sync writes in place)"
    if quantization_config is not None or (isinstance(model, torch.nn.Module) and any(
            type(module).__module__.startswith("bitsandbytes") for module in model.modules())):
        return "a quantized model"
    return _peft_refusal(configs, model)


def checkpoint_dtype(model_config) -> str | None:
    """The dtype a transformers config says its checkpoint holds ("float16", ...;
    `dtype`, or the older `torch_dtype`; a multimodal config's text config's
    where the config itself names none), None where it says none."""
    for config in (model_config, model_config.get_text_config()):
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if dtype is not None:
            return str(dtype).removeprefix("torch.")
    return None


def engine_device_type() -> str | None:
    """The device type a vLLM engine built in this process runs on ("cpu",
    "cuda", ...: vLLM's platform here, whatever device the trainer computes on),
    None without vLLM."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None
    return current_platform.device_type


def engine_dtype(model_config) -> str | None:
    """The dtype vLLM holds a model of this transformers config in on this
    process's platform with its dtype "auto", as TRL's colocated engine and this
    module's are built: vLLM 0.32's own resolution (a float32 checkpoint in the
    platform's first supported dtype; a dtype the platform lacks replaced by it:
    float16 for a bfloat16 checkpoint on a GPU below compute capability 8.0).
    None where the config names no dtype (vLLM would read the checkpoint's
    files) or vLLM does not resolve it here (the engine then says why, or the
    check of the built engine refuses)."""
    if checkpoint_dtype(model_config) is None:
        return None
    try:
        from vllm.config.model import _get_and_verify_dtype  # pyproject pins vLLM's minor version

        dtype = _get_and_verify_dtype("", model_config, "auto", is_pooling_model=False)
    except (ImportError, ValueError):
        return None
    return str(dtype).removeprefix("torch.")


# Config fields by which a family counts its routed experts (vLLM's and TRL's reading of them).
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def sync_timeout_s() -> float:
    """LLAMARL_SYNC_TIMEOUT_S: the seconds GRPOTrainer's DDMA set-up and each of its
    syncs may take (colocated and server mode), TIMEOUT_S where unset (a first
    sync of a 14B float32 model over 1 Gbit takes longer). ValueError naming the
    variable for anything but a positive number of seconds."""
    value = os.environ.get(TIMEOUT_ENV)
    if value is None:
        return TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = value
    check_timeout(seconds, TIMEOUT_ENV)
    return seconds


def sync_delta() -> bool:
    """LLAMARL_SYNC_DELTA: "1" sends server mode's syncs after the first to a server
    on another host as deltas (DdmaWeightTransfer delta=True); "0" or unset, whole.
    ValueError naming the variable for anything else."""
    value = os.environ.get(DELTA_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{DELTA_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def _peft_parameters(model):
    """(the name vLLM loads, whether an adapter merges into it, the Parameter) per
    base weight of a PEFT model, named as TRL's sync names them; the adapters'
    own tensors left out."""
    for raw, param in model.named_parameters():
        name = raw.removeprefix("base_model.model.").replace(".base_layer", "")
        if model.prefix in name or "original_module" in name:
            continue
        yield (name.replace("modules_to_save.default.", "").replace("_checkpoint_wrapped_module.", ""),
               ".base_layer." in raw, param)


def peft_base_weights(model) -> dict[str, torch.Tensor]:
    """A PEFT model's base weights (what its adapters merge into, and the
    layers it leaves alone) under the names vLLM loads, as TRL's sync names
    them; the adapters' own tensors left out. The tensors are the Parameters'
    data: merging in place writes them."""
    weights = {}
    for name, _, param in _peft_parameters(model):
        if name in weights:
            raise SyncError(f"two parameters of the PEFT model map to vLLM's {name!r}")
        weights[name] = param.data
    return weights


class DdmaVLLMGeneration(VLLMGeneration):
    """VLLMGeneration whose engine takes its weights by DDMA (module docstring).
    Same constructor arguments as TRL's."""

    transfer: DdmaWeightTransfer | None = None  # server mode, on the main process, a llamarl_ddma server
    _peft_weights: dict[str, torch.Tensor] | None = None  # colocated, a PEFT model: its base weights, by vLLM name
    _peft_adapted: list[str] = []  # and those an adapter merges into
    _layout: Layout | None = None  # a PEFT model: its base weights' (vLLM's names); else read at each registration
    _ddma = False  # server mode: the server runs llamarl_ddma (every rank knows)
    _job_store: tuple[dist.Store, bytes] | None = None  # colocated, sharded: the sync's Store on rank 0, its secret
    _rank_store: tuple[dist.Store, bytes] | None = None  # colocated, whole models: this rank's sync's, its secret

    def _init_vllm(self) -> None:
        self.timeout_s = sync_timeout_s()
        if self.mode == "server":
            self._init_server()
        elif self.mode == "colocate":
            self._init_colocated()
        else:
            raise ValueError(f"vllm_mode must be 'server' or 'colocate', got {self.mode!r}")

    def _init_server(self) -> None:
        """TRL's client on the main process, DDMA's transfer beside it when the
        server runs llamarl_ddma (else TRL's own NCCL communicator); the main
        process's finding (DDMA, TRL's, or an error) told to every rank, whose
        syncs walk the parameters with it: an error raises on every rank."""
        finding = torch.zeros(1, dtype=torch.int64, device=self.accelerator.device)  # 0 TRL's, 1 DDMA, 2 failed
        error = None
        if self.accelerator.is_main_process:
            try:
                base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
                named = "vllm_server_base_url's host" if self.server_base_url else "vllm_server_host"
                self.vllm_client = VLLMClient(base_url=base_url, group_port=self.group_port,
                                              connection_timeout=self.server_timeout)
                backend = (self.vllm_client.get_server_info().get("weight_transfer_config") or {}).get("backend")
                if backend == BACKEND:
                    self.transfer = DdmaWeightTransfer(
                        base_url, store_host=address_toward(urlparse(base_url).hostname, named), timeout_s=self.timeout_s,
                        delta=sync_delta())
                    self.transfer.init_weight_transfer()
                    finding[0] = 1
                else:
                    self.vllm_client.init_communicator(device=self.accelerator.device)
            except Exception as exc:  # noqa: BLE001 - raised below, after every rank has heard
                error, finding[0] = exc, 2
        finding = broadcast(finding, from_process=0)
        if error is not None:
            raise error
        if int(finding[0]) == 2:
            raise SyncError("the main process failed to set up its vLLM server's weight sync (its error says why)")
        self._ddma = int(finding[0]) == 1
        self.accelerator.wait_for_everyone()

    def _init_colocated(self) -> None:
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        # Before vLLM starts (a collective every rank takes part in): where the ranks run decides which sync.
        self._hosts_apart = several_hosts(self.accelerator.num_processes, self.accelerator.device)
        self._check_colocated()
        # vLLM's external launcher reads the process's place in the job from the environment, as in TRL.
        os.environ["RANK"] = str(self.accelerator.process_index)
        os.environ["LOCAL_RANK"] = str(self.accelerator.local_process_index)
        os.environ["WORLD_SIZE"] = str(self.accelerator.num_processes)
        ensure_master_addr_port()
        self.llm = LLM(
            model=self.model.name_or_path, load_format="dummy", tensor_parallel_size=1,
            gpu_memory_utilization=self.gpu_memory_utilization, max_model_len=self.max_model_length,
            max_num_seqs=self.max_num_seqs, model_impl=self.model_impl, distributed_executor_backend="external_launcher",
            seed=self.accelerator.process_index, max_num_batched_tokens=4096, logprobs_mode="processed_logprobs",
            trust_remote_code=self.trust_remote_code,
            weight_transfer_config=WeightTransferConfig(backend="llamarl_ddma"))
        self._llm_weights_sleeping = False
        if is_peft_model(self.model):
            self._peft_adapted = [name for name, adapted, _ in _peft_parameters(self.model) if adapted]
            self._peft_weights = peft_base_weights(self.model)
            self._layout = Layout(1, [ParamSpec(n, tuple(t.shape), t.dtype) for n, t in self._peft_weights.items()])
        self._check_engine_dtype()
        # Registered at the first sync, on the parameters as training holds them (the trainer's set-up after this
        # may rebind them), and again whenever training rebound them since (_sender).
        self.sender, self._registrations = None, 0
        self.version = 0
        self.accelerator.wait_for_everyone()

    def _check_engine_dtype(self) -> None:
        """ValueError, at construction rather than at the first sync, where the engine
        holds its weights in a dtype the sync cannot write the trainer's parameters
        in (the same dtype, or float32 cast to bfloat16: plan.castable)."""
        engine = self.llm.model_config.dtype
        sent = self._peft_weights.values() if is_peft_model(self.model) else self.model.parameters()
        counts = collections.Counter()
        for t in sent:
            if t.is_floating_point():
                counts[t.dtype] += t.numel()
        # The dtype most of the weights are in (a few kept in float32 on both sides, such as a router's
        # bias, are the sync's to check per parameter).
        mine = counts.most_common(1)[0][0] if counts else engine
        if not castable(mine, engine):
            raise ValueError(f"llamarl's colocated vLLM sync: the engine holds its weights in {engine} (vLLM's "
                             f"dtype for {self.model.name_or_path}), the trainer's are {mine}: a cast the sync does "
                             "not make (it casts float32 to bfloat16 only); load the model in the engine's dtype "
                             "(GRPOConfig(model_init_kwargs={'dtype': ...}))")

    def _sharding(self) -> str | None:
        """What shards the model's parameters over the processes now, as
        sharding_of names it: accelerate's FSDP plugin or DeepSpeed ZeRO-3, else
        DTENSORS where a parameter is a DTensor (sharded by the caller); OFFLOADED
        where a shard is not on the engine's device type (FSDP2's CPU offload)."""
        kind = self.accelerator.distributed_type
        if kind == DistributedType.FSDP and not self.accelerator.is_fsdp2:
            return "FSDP1"
        if kind == DistributedType.DEEPSPEED and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            return "DeepSpeed ZeRO-3"
        shards = dtensor_shards(self.model)
        if any(shard.device.type != self.accelerator.device.type for shard in shards):
            return OFFLOADED
        if kind == DistributedType.FSDP:
            return FSDP2
        return DTENSORS if shards else None

    def _check_colocated(self) -> str | None:
        """The model's sharding (_sharding); ValueError naming what the sync cannot
        serve (the same on every rank)."""
        sharding = self._sharding()
        reason = colocate_refusal(self.model, self.accelerator.num_processes, self.tensor_parallel_size,
                                  self.enable_sleep_mode, sharding=sharding, hosts_apart=self._hosts_apart)
        if reason is not None:  # GRPOTrainer checks it first, from its arguments
            raise ValueError(f"llamarl's colocated vLLM sync cannot serve this run: {reason}")
        return sharding

    def _own_store(self) -> tuple[dist.Store, bytes]:
        """The Store of this rank's own sync (its whole model into its engine),
        served by this process, and its secret, handed to the engine in-process."""
        if self._rank_store is None:
            self._rank_store = (_local_store(self.timeout_s), new_secret())
        return self._rank_store

    def _shared_store(self) -> tuple[dist.Store, bytes]:
        """The Store of a sync among all ranks (served by rank 0 on 127.0.0.1: the
        ranks share its host, several_hosts) and its secret, made at the first
        call, every rank taking part: rank 0's port and secret broadcast over the
        job's process group, then every rank's connection counted; a failure on
        any rank raises on every rank."""
        if self._job_store is None:
            device = self.accelerator.device
            port = torch.full((1,), -1, dtype=torch.int64, device=device)
            secret = torch.zeros(SECRET_BYTES, dtype=torch.uint8, device=device)
            store, error = None, None
            if self.accelerator.is_main_process:
                try:
                    store = _local_store(self.timeout_s)
                    port[0] = store.port
                    secret.copy_(torch.frombuffer(bytearray(new_secret()), dtype=torch.uint8))
                except Exception as exc:  # noqa: BLE001 - raised below, after every rank has heard
                    error = exc
            port, secret = broadcast(port, from_process=0), broadcast(secret, from_process=0)
            if store is None and int(port[0]) >= 0:
                try:
                    store = _local_store(self.timeout_s, int(port[0]))
                except Exception as exc:  # noqa: BLE001 - raised below, after every rank has heard
                    error = exc
            failed = any_rank(store is None, device)
            if error is not None:
                raise error
            if failed:
                raise SyncError("another rank failed to reach the colocated sync's Store on rank 0 (its error says "
                                "why)")
            self._job_store = (store, bytes(secret.cpu().tolist()))
        return self._job_store

    def _moved_peft_weights(self) -> list[str]:
        """The PEFT model's base weights (vLLM's names) no longer in the storage registered."""
        live = peft_base_weights(self.model)
        return [n for n, t in self._peft_weights.items() if live[n].data_ptr() != t.data_ptr()]

    def _rebound(self) -> bool:
        """Whether training rebound a parameter since the sender registered it."""
        if self._peft_weights is not None:
            return bool(self._moved_peft_weights())
        try:
            self.sender.check_storage()
        except SyncError:
            return True
        return False

    def _register_again(self) -> bool:
        """Whether to register a sender (again): none yet, or training rebound a
        parameter since; on several processes decided by all ranks together
        (their registrations go in step: a sharded sync is one among them, and
        each registration ends in a collective), a collective only once a sender
        is registered, which is so on every rank or on none (_sender)."""
        again = self.sender is None or self._rebound()
        if self.sender is None or self.accelerator.num_processes == 1:
            return again
        return any_rank(again, self.accelerator.device)

    def _sender(self) -> WeightSender:
        """The sender on the parameters as training holds them now: registered at the
        first sync, and again (the engine's transfer engine shut down first, under a
        new sync name) when training rebound a parameter since (an evaluate() before
        train(), a set-up after the engine was built, FSDP2's sharding). A
        registration failing on any rank raises on every rank (none left waiting in
        the next collective)."""
        if not self._register_again():
            return self.sender
        sharding = self._check_colocated()  # parameters sharded since the engine was built (an FSDP set-up)
        # One sync among all ranks for DTensor shards, else one per rank. The collectives first, in the same
        # order on every rank; after them what may fail on one rank alone.
        sharded = self.accelerator.num_processes > 1 and sharding in (FSDP2, DTENSORS)
        store, secret = self._shared_store() if sharded else self._own_store()
        rank, world = (self.accelerator.process_index, self.accelerator.num_processes) if sharded else (0, 1)
        self._registrations += 1
        name = f"{SYNC_NAME}-{self._registrations}"

        def make_sender():
            if self._peft_weights is None:
                return module_sender(store, self.model, rank, world, name=name, timeout=self.timeout_s, secret=secret)
            self._peft_weights = peft_base_weights(self.model)
            return WeightSender(store, self._layout, 0, self._peft_weights, name=name, timeout=self.timeout_s,
                                secret=secret)

        error = sender = None
        try:
            old, self.sender = self.sender, None  # None on every rank from here, whatever close() does
            if old is not None:
                old.close()
            self.llm.shutdown_weight_transfer_engine()  # idempotent: an earlier registration's receivers, if any
            # every rank's shards into rank 0's engine (replica 0), relayed on to the others' (sharded), or this
            # rank's whole model into its own engine
            layout = self._layout if self._peft_weights is not None else module_layout(self.model, world)
            info = ddma_init_info("127.0.0.1", store.port, layout, name=name, timeout_s=self.timeout_s, secret=secret,
                                  replica=rank, num_replicas=world)
            sender = register_while(make_sender, lambda: self.llm.init_weight_transfer_engine({"init_info": info}),
                                    self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows
            error = exc
        failed = any_rank(error is not None, self.accelerator.device)
        if error is not None:
            raise error
        if failed:
            sender.close()
            raise SyncError("another rank's colocated vLLM sync failed to register (its error says why)")
        self.sender = sender
        return sender

    def sync_weights(self) -> None:
        """The trainer's current weights into the engine: one version, sent in
        place while the engine takes it, then the engine's prefix cache reset (its
        KV was computed under the last version). A server: TRL's walk of the
        parameters (a collective every rank takes part in) handed to the
        transfer on the main process, or TRL's own sync."""
        if self.mode == "server":
            if not self._ddma:
                super().sync_weights()
            elif self.transfer is not None:
                self.transfer.send_weights(self._iter_named_params())
            else:
                for _ in self._iter_named_params():  # the gathers' collectives, rank 0's walk beside them
                    pass
            return
        sender = self._sender()
        self.version += 1

        def update() -> None:
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": {"version": self.version}})
            self.llm.finish_weight_update(weight_version=str(self.version))

        if self._peft_weights is None:
            send_while(sender, self.version, update, self.timeout_s)  # the optimizer may step once it returns
        else:
            self._send_merged(sender, update)
        self.llm.reset_prefix_cache()

    def _send_merged(self, sender: WeightSender, update) -> None:
        """The PEFT model's adapters merged into its base weights in place, sent,
        unmerged; the adapted base weights then restored bit for bit from a copy
        taken before (W + d - d rounds: a bf16 base would drift a little each
        sync). The merge inside the try: one that fails half way is undone too."""
        kept = {name: self._peft_weights[name].clone() for name in self._peft_adapted}
        try:
            self.model.merge_adapter()
            moved = self._moved_peft_weights()
            if moved:
                raise SyncError(f"merging the PEFT adapters rebound {moved[0]!r}: the sync would send the unmerged "
                                "weights")
            send_while(sender, self.version, update, self.timeout_s)
        finally:
            self.model.unmerge_adapter()
            for name, value in kept.items():
                self._peft_weights[name].copy_(value)
