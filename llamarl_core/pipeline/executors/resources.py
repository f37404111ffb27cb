"""Where an executor computes: its threads and cores (CPU pinning), its GPU, and its
own torch.distributed process group."""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist

from ...control.auth import AuthenticatedStore
from ..config import TrainConfig
from .link import GENERATOR, REWARD, TRAINER

ALL_CORES = os.sched_getaffinity(0)  # at import, before any pinning


def setup_threads(config: TrainConfig, role: str, rank: int, launched: bool) -> None:
    """Async mode: one thread per executor and, with enough cores, the generator
    and trainer ranks pinned to cores of their own (the two phases run at once;
    measured on a 2-core machine: one core each beats sharing both). Sync
    mode: each phase has every core while it runs, shared by its ranks. Under torchrun, a host's
    cores are shared evenly by its ranks (torchrun's own OMP_NUM_THREADS is 1),
    unpinned: which roles share a host is the placement's choice."""
    cores = sorted(os.sched_getaffinity(0))
    if launched:
        torch.set_num_threads(max(1, len(cores) // int(os.environ["LOCAL_WORLD_SIZE"])))
        return
    if config.run.mode == "sync":  # the phase's processes share the cores (a thread per core in each: tp 2's
        # generation 1.7x slower); an engine's own workers (vLLM) are its business
        ranks = {GENERATOR: config.generator.processes * config.generator.replicas,
                 TRAINER: config.trainer.world}.get(role, 1)
        torch.set_num_threads(max(1, len(cores) // ranks))
        return
    torch.set_num_threads(1)
    generator_ranks = config.generator.tp * config.generator.replicas
    pinned = generator_ranks + config.trainer.world
    if role != REWARD and pinned <= len(cores):
        index = rank if role == GENERATOR else generator_ranks + rank
        os.sched_setaffinity(0, {cores[index]})


@contextlib.contextmanager
def every_core(world: int):
    """While nothing else computes (the trainer's warm-up, before the first sync),
    a lone trainer may use every core; its own pinning and threads come back after."""
    pinned, threads = os.sched_getaffinity(0), torch.get_num_threads()
    if world == 1:
        os.sched_setaffinity(0, ALL_CORES)
        torch.set_num_threads(len(ALL_CORES))
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)
        torch.set_num_threads(threads)


# The Python Stores under this process's groups, alive as long as the process (see process_group).
_GROUP_STORES: list[AuthenticatedStore] = []


def process_group(store: dist.Store, name: str, rank: int, world: int, config: TrainConfig, secret: bytes) -> None:
    """This executor's own process group: gloo, and NCCL for CUDA tensors (FSDP2's
    and tensor parallelism's collectives) when the run is on GPUs. Its rendezvous
    values (the ranks' addresses, NCCL's id) are authenticated with the run's secret."""
    backend = "cpu:gloo,cuda:nccl" if config.run.device == "cuda" else "gloo"
    prefix = f"pg/{name}/"
    group_store = AuthenticatedStore(dist.PrefixStore(prefix, store), secret, label=prefix)
    # The group keeps only the C++ part of a Store written in Python: without this reference its methods are
    # gone once the call returns, and every later use from C++ (NCCL's monitor thread checks a key once a
    # second; new_group) raised "Tried to call pure virtual function" (seen on an H200, 267 warnings a run).
    _GROUP_STORES.append(group_store)
    dist.init_process_group(backend, store=group_store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=config.run.timeout_s))


def select_gpu(config: TrainConfig, role: str, rank: int, launched: bool) -> None:
    """On GPUs, one device per rank: under torchrun GPU LOCAL_RANK (the controller's and
    the reward's ranks hold a local rank, and a GPU, too); else trainer rank r on GPU
    r, generator rank r on GPU trainer_world + r (wrapped around when there are fewer)."""
    if launched:
        local_rank = int(os.environ["LOCAL_RANK"])
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"{role} rank {rank} is torchrun local rank {local_rank}, and this host has "
                             f"{torch.cuda.device_count()} CUDA devices: one per local rank (--nproc-per-node)")
        torch.cuda.set_device(local_rank)
        return
    index = rank if role == TRAINER else config.trainer.world + rank
    torch.cuda.set_device(index % torch.cuda.device_count())


def end_process_group() -> None:
    """Destroy this process's group, if any, and let its Stores go (a torchrun rank's
    serve loop runs executors one after another in one process)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUP_STORES.clear()
