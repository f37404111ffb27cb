"""Where bytes go: exported destination memory and the point-to-point group.

- shm: the receiver's parameters are re-homed into one POSIX shared memory
  region (values kept, same tensor objects); senders map it and write into it.
- cuda_ipc: the receiver exports the CUDA allocations holding its parameters
  (cudaIpcGetMemHandle, keyed by GPU UUID); senders open them on their device.
  A sender in the receiver's own process cannot open the receiver's handles (the
  exporting process never can): it writes to the published addresses directly.
- p2p: a torch.distributed process group (gloo on CPU, NCCL on GPU) spanning
  senders and receivers, made from the same Store; buckets are packed, sent,
  and unpacked into the parameters, round by round (`bipartite_rounds`).

The transport is chosen per (sender, receiver) pair: ranks of one host share
memory, ranks on two hosts go point-to-point (`choose_transports`); two ranks on
one GPU never do (NCCL connects one rank per GPU).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import socket
import threading
import uuid
import warnings
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from .._native import native, native_cuda

SHM, CUDA_IPC, P2P = "shm", "cuda_ipc", "p2p"
TRANSPORTS = (SHM, CUDA_IPC, P2P)

# Parameter offsets inside a shared region are rounded up to 64 bytes, a cache
# line, so no two parameters share a line that two sender threads write.
_SHM_ALIGN = 64


def _namespace(kind: str) -> str:
    """This process's namespace of `kind`; where it cannot be read, a value no other
    process has, so that two processes are never taken for one host by default."""
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return f"{kind}:unreadable:{process_identity()}"


def host_identity() -> str:
    """Equal only for processes that can share memory by /dev/shm and /proc/PID/fd:
    one running kernel (the boot id), one network namespace and one PID namespace.
    The hostname, /dev/shm and the boot id alone do not tell hosts apart: processes
    in two network namespaces (containers, or the test hosts of this repository's
    tests) share all three, and must still talk over the network as two hosts do."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}/{_namespace('net')}/{_namespace('pid')}"


# Told apart from the pid: containers on one host (one hostname and boot id) can
# run processes with equal pids, and a pid alone would make them one process.
_PROCESS_TOKEN = uuid.uuid4().hex


def process_identity() -> str:
    """Equal only within one process (a forked child has another pid)."""
    return f"{os.getpid()}/{_PROCESS_TOKEN}"


def device_info(device: torch.device, tensors: Mapping[str, torch.Tensor] | None = None) -> dict:
    """What choose_transports needs to know of one rank: host, process, device type;
    on CUDA also its GPU's UUID, the GPUs visible here (UUID -> whether this GPU can
    address them peer to peer), and, given the tensors the rank exports, why CUDA IPC
    cannot export them (`ipc_error`, None when it can)."""
    info = {"host": host_identity(), "process": process_identity(), "device": device.type}
    if device.type == "cuda":
        mod = native_cuda()
        index = device.index if device.index is not None else torch.cuda.current_device()
        info["uuid"] = mod.cuda_device_uuid(index)
        info["gpus"] = {mod.cuda_device_uuid(d): mod.cuda_can_access_peer(index, d)
                        for d in range(mod.cuda_device_count())}
        if tensors is not None:
            info["ipc_error"] = cuda_ipc_error(tensors, index)
    return info


def cuda_ipc_error(tensors: Mapping[str, torch.Tensor], index: int) -> str | None:
    """Why cudaIpcGetMemHandle cannot export `tensors` (naming the first that it
    cannot), or None. It exports only cudaMalloc allocations: PyTorch's
    expandable segments (VMM) and its cudaMallocAsync backend allocate otherwise."""
    mod = native_cuda()
    for name, t in tensors.items():
        if t.numel() and not mod.cuda_ipc_capable(index, t.data_ptr()):
            setting = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
            return (
                f"{name!r} is not in memory from cudaMalloc, which CUDA IPC needs "
                f"(PYTORCH_CUDA_ALLOC_CONF={setting!r} here; expandable_segments:True and "
                "backend:cudaMallocAsync allocate otherwise, as do VMM allocators): unset those "
                "in the receiving process"
            )
    return None


def check_transport_name(requested: str) -> None:
    if requested not in ("auto", *TRANSPORTS):
        raise ValueError(f"transport must be 'auto' or one of {TRANSPORTS}, got {requested!r}")


def cuda_ipc_obstacle(senders: Sequence[dict], receivers: Sequence[dict], pairs) -> str | None:
    """Why the cuda_ipc transport cannot move bytes for every (sender, receiver)
    pair in `pairs` (ranks on one host, `device_info` dicts), or None. A pair in
    one process needs no IPC (the sender writes to the receiver's addresses); a
    pair on two GPUs needs peer access either way (the copy kernel writes remote
    memory)."""
    for s, d in pairs:
        src, dst = senders[s], receivers[d]
        if src["uuid"] != dst["uuid"]:
            access = src["gpus"].get(dst["uuid"])
            if access is None:
                return (f"receiver {d}'s GPU {dst['uuid']} is not visible to sender {s} "
                        "(CUDA_VISIBLE_DEVICES must include both GPUs)")
            if not access:
                return (f"sender {s}'s GPU {src['uuid']} cannot access receiver {d}'s GPU {dst['uuid']} "
                        "peer to peer (cudaDeviceCanAccessPeer is 0)")
        if src["process"] != dst["process"] and dst.get("ipc_error"):
            return f"receiver {d}: {dst['ipc_error']}"
    return None


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=5)  # the line that made the WeightSender / WeightReceiver


def _same_gpu(sender: dict, receiver: dict) -> bool:
    return sender["device"] == "cuda" and sender["uuid"] == receiver["uuid"]


def choose_transports(
    requested: str, senders: Sequence[dict], receivers: Sequence[dict], pairs=None
) -> dict[tuple[int, int], str]:
    """The transport of each (sender, receiver) pair that exchanges bytes (`pairs`,
    default all), from every rank's `device_info`; every rank computes the same.
    'auto': shared memory (CPU) or CUDA IPC (GPU) between ranks of one host,
    point-to-point between hosts; on GPU, a pair of one host that CUDA IPC cannot
    serve goes point-to-point (NCCL), with a warning (once), unless its two ranks
    share a GPU: NCCL connects one rank per GPU, so such a pair is refused, naming
    it and why CUDA IPC cannot serve it. A transport named explicitly that cannot
    serve every pair raises ValueError with the reason ('p2p' too, for ranks that
    share a GPU)."""
    check_transport_name(requested)
    if pairs is None:
        pairs = [(s, d) for s in range(len(senders)) for d in range(len(receivers))]
    pairs = sorted(pairs)
    device_types = {i["device"] for i in [*senders, *receivers]}
    if len(device_types) != 1:
        raise ValueError(f"all sender and receiver tensors must be on one device type, got {sorted(device_types)}")
    local = SHM if device_types.pop() == "cpu" else CUDA_IPC
    if requested in (SHM, CUDA_IPC) and requested != local:
        raise ValueError(f"transport {requested!r} needs {'CPU' if requested == SHM else 'CUDA'} tensors")
    if requested == P2P:
        shared = [(s, d) for s, d in pairs if _same_gpu(senders[s], receivers[d])]
        if shared:
            s, d = shared[0]
            raise ValueError(f"transport 'p2p' cannot connect sender {s} and receiver {d}: both are on GPU "
                             f"{senders[s]['uuid']}, and NCCL connects one rank per GPU; use 'auto' or 'cuda_ipc'")
        return {pair: P2P for pair in pairs}
    remote = {(s, d) for s, d in pairs if senders[s]["host"] != receivers[d]["host"]}
    if remote and requested != "auto":
        s, d = min(remote)
        raise ValueError(f"transport {requested!r} needs every rank on one machine, but sender {s} and receiver {d} "
                         "are on different hosts; use 'p2p' (or 'auto': point-to-point between hosts only)")
    chosen = {pair: P2P for pair in remote}
    fallbacks = []
    for s, d in pairs:
        if (s, d) in remote:
            continue
        obstacle = cuda_ipc_obstacle(senders, receivers, [(s, d)]) if local == CUDA_IPC else None
        if obstacle is None:
            chosen[(s, d)] = local
            continue
        shared = _same_gpu(senders[s], receivers[d])
        if requested == CUDA_IPC:
            raise ValueError(f"transport 'cuda_ipc' cannot work here: {obstacle}"
                             + ("" if shared else "; or use transport='p2p'"))
        if shared:
            raise ValueError(f"weight sync: sender {s} and receiver {d} share GPU {senders[s]['uuid']} from two "
                             f"processes, and CUDA IPC cannot serve them ({obstacle}); NCCL connects one rank per "
                             "GPU, so no transport can: fix what CUDA IPC needs")
        fallbacks.append((s, d, obstacle))
        chosen[(s, d)] = P2P
    if fallbacks:
        s, d, obstacle = fallbacks[0]
        _warn_once(f"weight sync: CUDA IPC cannot be used ({obstacle}); falling back to 'p2p' (NCCL) for "
                   f"{len(fallbacks)} sender -> receiver pair(s) of one host, sender {s} -> receiver {d} first")
    return chosen


# ----------------------------------------------------------------------------- shm


def rehome_into_shared_memory(tensors: Mapping[str, torch.Tensor], owner: str | None = None):
    """Move CPU tensors into one new shared region, keeping their values and the
    tensor objects (their `.data` now points into the region). Returns the region
    and each tensor's byte offset in it. If the region cannot be allocated
    (/dev/shm too small) raises RuntimeError naming `owner` (who registers the
    tensors; default this process) and the bytes needed and free, before any
    tensor is moved."""
    offsets, total = {}, 0
    for name, t in tensors.items():
        offsets[name] = total
        total += -(-t.numel() * t.element_size() // _SHM_ALIGN) * _SHM_ALIGN
    try:
        region = native().SharedMemoryRegion.create(max(total, _SHM_ALIGN))
    except native().EngineError as exc:
        owner = owner or f"process {os.getpid()}"
        raise RuntimeError(f"{owner}: cannot move its {len(tensors)} tensors into shared memory, none moved: {exc}") from exc
    flat = torch.frombuffer(region, dtype=torch.uint8)
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        view = flat[offsets[name] : offsets[name] + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        t.data = view
    return region, offsets


def shm_handle(region, offsets: dict[str, int]) -> dict:
    return {"pid": os.getpid(), "fd": region.fd, "name": region.name, "nbytes": region.nbytes, "offsets": offsets}


def open_shm_handle(handle: dict):
    """Map a receiver's region; returns (region, name -> absolute address)."""
    region = native().SharedMemoryRegion.open(handle["pid"], handle["fd"], handle["name"], handle["nbytes"])
    return region, {name: region.address + off for name, off in handle["offsets"].items()}


# ----------------------------------------------------------------------------- cuda ipc


def cuda_ipc_handle(tensors: Mapping[str, torch.Tensor], device: torch.device, export: bool) -> dict:
    """Publish the addresses of `tensors` (for senders in this process) and, when
    `export`, the allocations holding them: one IPC handle per allocation."""
    mod = native_cuda()
    index = device.index if device.index is not None else torch.cuda.current_device()
    addresses = {name: t.data_ptr() for name, t in tensors.items() if t.numel()}
    handles: list[str] = []
    params: dict[str, list[int]] = {}
    for name, ptr in addresses.items() if export else ():
        handle, offset, _ = mod.cuda_ipc_export(index, ptr)
        if handle.hex() not in handles:
            handles.append(handle.hex())
        params[name] = [handles.index(handle.hex()), offset]
    return {
        "uuid": mod.cuda_device_uuid(index), "process": process_identity(),
        "addresses": addresses, "handles": handles, "params": params,
    }


class OpenedCudaHandles:
    """A receiver's allocations mapped on this process's device; closed once. For a
    receiver in this very process, its published addresses (nothing opened)."""

    def __init__(self, handle: dict, device: torch.device):
        self.mod = native_cuda()
        peer = self.mod.cuda_device_by_uuid(handle["uuid"])
        if peer < 0:
            raise ValueError(
                f"the receiver's GPU {handle['uuid']} is not visible in this process "
                "(set CUDA_VISIBLE_DEVICES to include it, or use transport='p2p')"
            )
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.bases: list[int] = []
        if handle["process"] == process_identity():
            # cudaIpcOpenMemHandle fails in the process that exported the handle.
            self.mod.cuda_enable_peer_access(self.index, peer)
            self.addresses = dict(handle["addresses"])
            return
        self.bases = [self.mod.cuda_ipc_open(self.index, bytes.fromhex(h)) for h in handle["handles"]]
        self.addresses = {name: self.bases[i] + off for name, (i, off) in handle["params"].items()}

    def close(self) -> None:
        for base in self.bases:
            self.mod.cuda_ipc_close(self.index, base)
        self.bases = []


# ----------------------------------------------------------------------------- p2p


def make_process_group(store: dist.Store, rank: int, size: int, device_type: str, timeout_s: float):
    """A process group of its own (not the default group) over `store`:
    senders are ranks [0, num_senders), receivers follow."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        # A transfer that fails or times out must raise in the sync (SyncError,
        # SyncTimeoutError) and leave the process running. NCCL's watchdog by default
        # (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) tears the process down once a work item
        # passes the group's timeout; 2 aborts this group's communicators only, and
        # the pending wait raises. The group's constructor reads the variable: set
        # for this group alone, whatever the process uses for its own groups.
        with _environment(TORCH_NCCL_ASYNC_ERROR_HANDLING="2"):
            return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


_ENVIRONMENT_LOCK = threading.Lock()


@contextlib.contextmanager
def _environment(**values: str):
    """os.environ with `values` set inside the block, as it was after it."""
    with _ENVIRONMENT_LOCK:
        before = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
