"""Where bytes go: exported destination memory and the point-to-point group.

- shm: the storages of the receiver's parameters are moved into POSIX shared
  memory in place (values kept; every tensor sharing a storage sees the
  writes); senders map them and write into them.
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
import math
import os
import resource
import threading
import warnings
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from .._native import native, native_cuda
from ..control.hosts import host_identity, process_identity
from .protocol import CUDA_IPC, P2P, SHM, check_transport_name


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


def share_in_place(tensors: Mapping[str, torch.Tensor], owner: str) -> dict:
    """Move the storages of CPU `tensors` into POSIX shared memory in place and
    return the handle senders map them by. In place: each storage (torch's own
    object) gets shared memory under the same values, so every tensor that shares
    it sees what the senders write: the tensors given, the model's Parameters they
    alias (`p.data`, `p.detach()`), views. Memory outside torch that aliased a
    storage (a NumPy array of `t.numpy()`, behind `torch.from_numpy`) keeps the
    old bytes. A storage torch already shares through a descriptor is kept as it
    is (a receiver registered again). The memory is torch's file-descriptor
    sharing (what torch.multiprocessing uses): unlinked at once, nothing left in
    /dev/shm, freed with the last tensor of the storage.

    Refused with RuntimeError naming `owner`: before any storage moves, /dev/shm
    without room for them (bytes needed and free, read by statvfs: a storage
    copied into a full tmpfs would kill the process with SIGBUS; the check and
    the copies are not one step, so ranks registering at once on an almost full
    /dev/shm can pass it together), more storages than the open-file limit lets
    the process keep descriptors of (the soft limit is raised to the hard one
    first), and a shared storage torch cannot give a descriptor of; when its
    turn comes (the storages before it moved, values kept), a memory-mapped
    file torch keeps private (`UntypedStorage.from_file(shared=False)`).

    Handle: {"pid", "regions": [[fd, name, nbytes], ...], "params": {tensor name:
    [region index, byte offset]}}; tensors of no bytes have no entry."""
    storages: dict[int, torch.UntypedStorage] = {}
    first: dict[int, str] = {}  # storage -> the first tensor on it, to name in errors
    places: dict[str, tuple[int, int]] = {}
    for name, t in tensors.items():
        if t.numel() == 0:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        storages.setdefault(key, storage)
        first.setdefault(key, name)
        places[name] = (key, t.data_ptr() - key)
    unshared = [s for s in storages.values() if not s.is_shared()]
    _make_room_for_descriptors(len(unshared), len(tensors), owner)
    page = os.sysconf("SC_PAGE_SIZE")
    needed = sum(-(-s.nbytes() // page) * page for s in unshared)
    stats = os.statvfs("/dev/shm")
    free = stats.f_bavail * stats.f_frsize
    if needed > free:
        raise RuntimeError(f"{owner}: cannot move its {len(tensors)} tensors into shared memory, none moved: shared "
                           f"memory region needs {needed} bytes, /dev/shm has {free} bytes free (statvfs): enlarge it "
                           "(e.g. docker run --shm-size=...) or use transport='p2p'")
    # Those shared already first: one refused is refused before anything moves.
    described = {key: _descriptor(storage, first[key], owner) for key, storage in storages.items()
                 if storage.is_shared()}
    regions, index = [], {}
    for key, storage in storages.items():
        fd, name = described[key] if key in described else _descriptor(storage, first[key], owner)
        index[key] = len(regions)
        regions.append([fd, name, storage.nbytes()])
    return {"pid": os.getpid(), "regions": regions,
            "params": {name: [index[key], offset] for name, (key, offset) in places.items()}}


def _make_room_for_descriptors(count: int, num_tensors: int, owner: str) -> None:
    """torch keeps a descriptor open per shared storage for as long as it lives:
    the soft limit on open files (1024 by default outside containers; a 405B
    model has over 1100 parameter tensors) raised to the hard one where `count`
    more would not fit, else RuntimeError naming `owner`, before any storage
    moves. A margin of 64 is left for everything else the process opens."""
    if count == 0:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = len(os.listdir("/proc/self/fd")) + count + 64
    if soft != resource.RLIM_INFINITY and wanted > soft:
        top = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(top, soft), hard))
        if top < wanted:
            raise RuntimeError(f"{owner}: cannot move its {num_tensors} tensors into shared memory, none moved: "
                               f"their {count} storages need a descriptor each, and the limit on open files is "
                               f"{hard} (ulimit -n): raise it, or use transport='p2p'")


def _descriptor(storage: torch.UntypedStorage, tensor: str, owner: str) -> tuple[int, str]:
    """(descriptor, /dev/shm name) of a storage torch shares through a descriptor
    (the name from its /proc/self/fd link, which a peer checks before it maps it)."""
    fd, _ = storage._share_fd_cpu_()  # moves an unshared storage; a no-op for one shared so
    target = os.readlink(f"/proc/self/fd/{fd}") if fd >= 0 else ""
    if not (target.startswith("/dev/shm/") and target.endswith(" (deleted)")):
        raise RuntimeError(f"{owner}: the storage of {tensor!r} cannot be shared through an unlinked descriptor "
                           f"({target or 'torch gives none: a memory-mapped file?'}): register a copy (t.clone()) "
                           "in its place, or use transport='p2p'")
    return fd, target[len("/dev/shm") : -len(" (deleted)")]


class OpenedSharedStorages:
    """A receiver's shared storages (share_in_place's handle) mapped in this
    process; `addresses`: tensor name -> address. `specs` (the receiver's
    layout's local_tensor_specs: name -> (shape, dtype)): each tensor with bytes
    must have a place, inside its region."""

    def __init__(self, handle: dict, specs: Mapping[str, tuple]):
        regions = handle["regions"]
        sizes = {name: math.prod(shape) * dtype.itemsize for name, (shape, dtype) in specs.items()}
        missing = [name for name, nbytes in sizes.items() if nbytes and name not in handle["params"]]
        if missing:
            raise ValueError(f"the receiver's memory handle has no place for {missing[0]!r}")
        for name, (i, offset) in handle["params"].items():
            if name not in sizes or not (0 <= i < len(regions) and 0 <= offset
                                         and offset + sizes[name] <= regions[i][2]):
                raise ValueError(f"the receiver's memory handle places {name!r} outside its shared memory")
        self.regions = []
        try:
            for fd, name, nbytes in regions:
                self.regions.append(native().SharedMemoryRegion.open(handle["pid"], fd, name, nbytes))
        except BaseException:
            self.close()
            raise
        self.addresses = {name: self.regions[i].address + offset for name, (i, offset) in handle["params"].items()}

    def close(self) -> None:
        for region in self.regions:
            region.close()
        self.regions = []


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
