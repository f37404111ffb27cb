"""Where bytes go: exported destination memory and the point-to-point group.

- shm: the receiver's parameters are re-homed into one POSIX shared memory
  region (values kept, same tensor objects); senders map it and write into it.
- cuda_ipc: the receiver exports the CUDA allocations holding its parameters
  (cudaIpcGetMemHandle, keyed by GPU UUID); senders open them on their device.
- p2p: a torch.distributed process group (gloo on CPU, NCCL on GPU) spanning
  senders and receivers, made from the same Store; buckets are packed, sent,
  and unpacked into the parameters.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Mapping

import torch
import torch.distributed as dist

from .._native import native, native_cuda

SHM, CUDA_IPC, P2P = "shm", "cuda_ipc", "p2p"
TRANSPORTS = (SHM, CUDA_IPC, P2P)

# Parameter offsets inside a shared region are rounded up to 64 bytes, a cache
# line, so no two parameters share a line that two sender threads write.
_SHM_ALIGN = 64


def host_identity() -> str:
    """Hostname plus kernel boot id: equal only for processes on one running machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def device_info(device: torch.device) -> dict:
    info = {"host": host_identity(), "pid": os.getpid(), "device": device.type}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        info["uuid"] = native_cuda().cuda_device_uuid(index)
    return info


def check_transport_name(requested: str) -> None:
    if requested not in ("auto", *TRANSPORTS):
        raise ValueError(f"transport must be 'auto' or one of {TRANSPORTS}, got {requested!r}")


def choose_transport(requested: str, infos: list[dict]) -> str:
    """Pick the transport every rank agrees on, from all ranks' `device_info`."""
    check_transport_name(requested)
    device_types = {i["device"] for i in infos}
    if len(device_types) != 1:
        raise ValueError(f"all sender and receiver tensors must be on one device type, got {sorted(device_types)}")
    device_type = device_types.pop()
    one_host = len({i["host"] for i in infos}) == 1
    local = SHM if device_type == "cpu" else CUDA_IPC
    if requested == "auto":
        return local if one_host else P2P
    if requested in (SHM, CUDA_IPC):
        if requested != local:
            raise ValueError(f"transport {requested!r} needs {'CPU' if requested == SHM else 'CUDA'} tensors")
        if not one_host:
            raise ValueError(f"transport {requested!r} needs every rank on one machine; use 'p2p'")
    return requested


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


def cuda_ipc_handle(tensors: Mapping[str, torch.Tensor], device: torch.device) -> dict:
    """Export the allocations holding `tensors`: one IPC handle per allocation."""
    mod = native_cuda()
    index = device.index if device.index is not None else torch.cuda.current_device()
    handles: list[str] = []
    params: dict[str, list[int]] = {}
    for name, t in tensors.items():
        if t.numel() == 0:
            continue
        handle, offset, _ = mod.cuda_ipc_export(index, t.data_ptr())
        if handle.hex() not in handles:
            handles.append(handle.hex())
        params[name] = [handles.index(handle.hex()), offset]
    return {"uuid": mod.cuda_device_uuid(index), "handles": handles, "params": params}


class OpenedCudaHandles:
    """A receiver's allocations mapped on this process's device; closed once."""

    def __init__(self, handle: dict, device: torch.device):
        self.mod = native_cuda()
        if self.mod.cuda_device_by_uuid(handle["uuid"]) < 0:
            raise ValueError(
                f"the receiver's GPU {handle['uuid']} is not visible in this process "
                "(set CUDA_VISIBLE_DEVICES to include it, or use transport='p2p')"
            )
        self.index = device.index if device.index is not None else torch.cuda.current_device()
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
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)
