"""The set-up both sides of a sync share (`Endpoint`): validate, publish this rank,
exchange layouts and device infos through the Store, plan, choose the transport of
every pair, join the point-to-point group; and the helpers both sides' transfers use."""

from __future__ import annotations

import datetime
import time
from dataclasses import replace
from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist

from .engine import DEFAULT_COPY_TIMEOUT_S, check_local_tensors, tensors_device
from .errors import SyncError, SyncTimeoutError
from .layout import Layout
from .plan import Segment, TransferPlan, bipartite_rounds, plan_transfer
from .protocol import DST, SRC, Channel, SenderWatch
from .transports import P2P, check_transport_name, choose_transports, device_info, make_process_group


class Endpoint:
    """Shared set-up of WeightSender and WeightReceiver (their docstrings say what
    each parameter means). channel: the sync's Store namespace. watch: a receiver's
    view of its senders' failure reports, polled by its set-up waits (None on a
    sender: its waits block)."""

    side = ""

    def __init__(self, channel: Channel, layout: Layout, rank: int, tensors: Mapping[str, torch.Tensor], *,
                 transport: str, timeout: float, bucket_bytes: int, num_threads: int | None,
                 relay_buckets: list | None = None, p2p_bucket_bytes: int | None = None,
                 watch: SenderWatch | None = None):
        if not 0 <= rank < layout.world_size:
            raise ValueError(f"{self.side} rank {rank} is outside the layout's world size {layout.world_size}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        check_transport_name(transport)
        if bucket_bytes <= 0 or (p2p_bucket_bytes is not None and p2p_bucket_bytes <= 0):
            raise ValueError(f"bucket sizes must be positive, got bucket_bytes={bucket_bytes}, "
                             f"p2p_bucket_bytes={p2p_bucket_bytes}")
        check_local_tensors(layout, rank, tensors, self.side)
        self.layout, self.rank, self.timeout = layout, rank, timeout
        self.tensors = dict(tensors)
        self.device = tensors_device(self.tensors, f"{self.side} rank {rank}")
        self.num_threads = num_threads
        self.channel = channel
        self._closed = False

        def failure(senders):  # what a receiver's set-up waits watch for
            return None if watch is None else lambda: watch.failure(senders)

        deadline = time.monotonic() + timeout
        me = SRC if self.side == "sender" else DST
        exported = self.tensors if me == DST else None  # receivers' memory is what CUDA IPC exports
        if me == SRC:  # before the info key, which receivers wait for
            channel.set(f"{SRC}/{rank}/relay_buckets", relay_buckets)
        channel.set(f"{me}/{rank}/info", {**device_info(self.device, exported), "transport": transport})
        if rank == 0:  # before the layout, which the other side waits for
            channel.set(f"{me}/bucket_bytes", bucket_bytes if me == SRC else p2p_bucket_bytes)
            if me == SRC:  # the receivers' cap applies only where the senders know it too (not older senders)
                channel.set(f"{SRC}/reads_p2p_cap", True)
            channel.set(f"{me}/layout", layout.to_dict())
        # Until sender rank 0's layout is here, the senders' world size is not known: only rank 0's failure is.
        channel.wait({f"{SRC}/layout": "sender rank 0", f"{DST}/layout": "receiver rank 0"}, deadline,
                     "both sides' layouts", failure([0]))
        bucket_bytes = channel.get(f"{SRC}/bucket_bytes")  # both sides must bucket alike (p2p)
        p2p_cap = channel.get_if_set(f"{DST}/bucket_bytes") if channel.get_if_set(f"{SRC}/reads_p2p_cap") else None
        if Layout.from_dict(channel.get(f"{me}/layout")) != layout:
            raise ValueError(f"{self.side} rank {rank}: its layout differs from the one rank 0 registered")
        other = DST if me == SRC else SRC
        other_layout = Layout.from_dict(channel.get(f"{other}/layout"))
        src_layout, dst_layout = (layout, other_layout) if me == SRC else (other_layout, layout)
        self.plan: TransferPlan = plan_transfer(src_layout, dst_layout, bucket_bytes)
        info_keys = {f"{SRC}/{r}/info": f"sender rank {r}" for r in range(src_layout.world_size)}
        info_keys |= {f"{DST}/{r}/info": f"receiver rank {r}" for r in range(dst_layout.world_size)}
        channel.wait(info_keys, deadline, "every rank's device info", failure(range(src_layout.world_size)))
        infos = [channel.get(k) for k in info_keys]
        requested = {i["transport"] for i in infos}
        if len(requested) > 1:
            raise ValueError(f"ranks asked for different transports {sorted(requested)}; pass the same to every rank")
        self._src_infos, self._dst_infos = infos[: src_layout.world_size], infos[src_layout.world_size :]
        # One transport per (sender, receiver) pair; every rank computes the same.
        self.transports = choose_transports(transport, self._src_infos, self._dst_infos, self.plan.pairs)
        # What the sync uses, e.g. "shm", or "p2p+shm" where some pairs span hosts.
        self.transport = "+".join(sorted(set(self.transports.values())))
        own_pairs = [(rank, d) for d in self.plan.receivers_of(rank)] if me == SRC else [
            (s, rank) for s in self.plan.senders_of(rank)]
        for pair in own_pairs:
            if p2p_cap is not None and self.transports[pair] == P2P:
                self.plan.cap_buckets(pair, p2p_cap)
            relayed = relay_buckets if me == SRC else channel.get_if_set(f"{SRC}/{pair[0]}/relay_buckets")
            if relayed is not None:
                self.plan.buckets[pair] = self._relayed_buckets(relayed, pair)
        # Point-to-point pairs run round by round, each round a matching (no rank in two pairs).
        self._p2p_rounds = bipartite_rounds(pair for pair, t in self.transports.items() if t == P2P)
        # This rank's point-to-point peers (receivers of a sender, senders of a receiver), in round order.
        own, peer = (0, 1) if me == SRC else (1, 0)
        self._p2p_peers = [pair[peer] for pairs in self._p2p_rounds for pair in pairs if pair[own] == rank]
        # A rank registered again under the same name (a restarted process) gets a
        # higher incarnation; point-to-point pairs cannot take it back: the process
        # group's rendezvous keys in the Store serve one group once.
        self._incarnation = channel.counter(f"{me}/{rank}/incarnation", 1)
        if self._incarnation > 1 and self._p2p_peers:
            raise ValueError(f"{self.side} rank {rank} registered again under the name {channel.name!r}, but it has "
                             "point-to-point pairs, which cannot be rejoined: register every sender and receiver "
                             "again under a new name")
        self.group = None
        if self._p2p_rounds:
            num_src = src_layout.world_size
            self.group = make_process_group(
                dist.PrefixStore("pg/", channel.store),
                rank if me == SRC else num_src + rank,
                num_src + dst_layout.world_size,
                self.device.type,
                timeout,
            )

    def _relayed_buckets(self, relayed: list, pair: tuple[int, int]) -> list[tuple[Segment, ...]]:
        """The buckets of a relay pair (rank r of one replica to rank r of the next, one
        layout) in its sender's order: each segment copies a region of a tensor to the
        same region of the same tensor. Checked to stay inside the tensors and to
        write exactly the bytes the plan's own buckets write, none twice."""
        src, dst = pair
        where = f"{self.side} rank {self.rank}: the relay buckets of pair {src} -> {dst}"
        if src != dst or self.plan.src_layout != self.plan.dst_layout:
            raise ValueError(f"{where}: not a relay between replicas of one layout")
        buckets = []
        for bucket in relayed:
            segments = []
            for name, offset, pitch, width, height in bucket:
                tensor = self.tensors.get(name)
                itemsize = tensor.element_size() if tensor is not None else 0
                row = width * itemsize  # the pitch of a single row is unused
                if tensor is None or not (0 <= offset and 0 < row and height > 0 and (height == 1 or row <= pitch)
                                          and offset + (height - 1) * pitch + row <= tensor.nbytes):
                    raise ValueError(f"{where}: segment {name!r} at byte {offset} ({height} x {width}, pitch {pitch}) "
                                     "is not inside a tensor of this rank")
                segments.append(Segment(src, name, offset, pitch, dst, name, offset, pitch, width, height, itemsize,
                                        False))
            buckets.append(tuple(segments))
        given, planned = (written_runs([s for b in bs for s in b]) for bs in (buckets, self.plan.buckets[pair]))
        if given is None or planned is None:
            raise ValueError(f"{where} write some bytes twice")
        if given.keys() != planned.keys() or any(not np.array_equal(given[n], planned[n]) for n in given):
            raise ValueError(f"{where} do not write the bytes the plan writes")
        return buckets

    def _deadline(self, timeout: float | None) -> float:
        if self._closed:
            raise SyncError(f"{self.side} rank {self.rank} is closed")
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    @staticmethod
    def _copy_timeout(deadline: float) -> float:
        """What is left of the call's deadline for a device copy (never more than the engine's cap)."""
        return min(DEFAULT_COPY_TIMEOUT_S, max(deadline - time.monotonic(), 1e-3))

    def _wait_work(self, work, deadline: float, what: str) -> None:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0 or not work.wait(datetime.timedelta(seconds=remaining)):
                raise SyncTimeoutError(f"{what} did not complete in time")
        except RuntimeError as exc:
            if isinstance(exc, SyncError):
                raise
            raise p2p_failure(what, exc) from exc

    def _post(self, op: str, tensor: torch.Tensor, peer: int, tag: int, what: str):
        """Post a point-to-point `op` ("send" / "recv") on the group; returns its work.
        Gloo may refuse already at posting (a pair closed by an earlier timeout)."""
        try:
            return getattr(self.group, op)([tensor], peer, tag)
        except RuntimeError as exc:
            raise p2p_failure(what, exc) from exc

    def _staging(self, pair_buckets) -> list[torch.Tensor]:
        """Staging for the p2p transport, from each p2p pair's buckets: bucket i goes
        through buffer i % 2, so packing (or unpacking) one bucket overlaps the
        transfer of the next. The second buffer, one more bucket of memory (256 MiB by
        default, 16 MiB into generator replicas), only where some pair has more than
        one bucket."""
        largest = max((sum(seg.nbytes for seg in b) for buckets in pair_buckets for b in buckets), default=0)
        count = 2 if any(len(buckets) > 1 for buckets in pair_buckets) else 1
        return [torch.empty(largest, dtype=torch.uint8, device=self.device) for _ in range(count)]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def p2p_failure(what: str, exc: RuntimeError) -> SyncError:
    """The sync's error for a failed point-to-point op: gloo reports its own timeouts
    as RuntimeError ("Timed out waiting ..."), which is a SyncTimeoutError here."""
    if "Timed out" in str(exc):
        return SyncTimeoutError(f"{what} did not complete in time: {exc}")
    return SyncError(f"{what} failed (a peer died or its connection broke): {exc}")


def written_runs(segments: list[Segment]) -> dict[str, np.ndarray] | None:
    """Destination tensor -> the byte runs the segments write, merged: rows of
    [start, end), sorted; None if two segments write a byte twice."""
    rows: dict[str, list] = {}
    for seg in segments:
        starts = seg.dst_offset + seg.dst_pitch * np.arange(seg.height, dtype=np.int64)
        rows.setdefault(seg.dst_name, []).append(np.stack([starts, starts + seg.width * seg.itemsize], axis=1))
    runs = {}
    for name, parts in rows.items():
        spans = np.concatenate(parts)
        spans = spans[np.argsort(spans[:, 0], kind="stable")]
        if (spans[1:, 0] < spans[:-1, 1]).any():
            return None
        joined = np.flatnonzero(spans[1:, 0] != spans[:-1, 1]) + 1  # where a new run begins
        runs[name] = np.stack([spans[np.r_[0, joined], 0], spans[np.r_[joined - 1, len(spans) - 1], 1]], axis=1)
    return runs


def packed(bucket: tuple[Segment, ...]) -> tuple[list[Segment], list[Segment]]:
    """(pack, unpack) segments moving a bucket through a dense staging buffer:
    pack reads the source tensors (casting) into staging, unpack copies staging
    into the destination tensors."""
    pack, unpack, offset = [], [], 0
    for seg in bucket:
        row = seg.width * seg.itemsize
        pack.append(replace(seg, dst_offset=offset, dst_pitch=row))
        unpack.append(replace(seg, src_offset=offset, src_pitch=row, cast=False))
        offset += seg.nbytes
    return pack, unpack
