"""What both sides of a sync share: their set-up, as two functions
(`register_sender`, `register_receiver`) over the same steps (publish this rank,
exchange layouts and device infos through the Store, plan, choose the transport
of every pair, join the point-to-point group), what it agreed (`Registration`),
and `Endpoint`, the base of WeightSender and WeightReceiver, with the helpers
both sides' transfers use."""

from __future__ import annotations

import dataclasses
import datetime
import time
from dataclasses import replace
from typing import Callable, Mapping

import numpy as np
import torch
import torch.distributed as dist

from .engine import DEFAULT_COPY_TIMEOUT_S, check_local_tensors, tensors_device
from .errors import SyncError, SyncTimeoutError
from .layout import Layout, check_exchanged_dtypes, check_int
from .plan import Segment, TransferPlan, bipartite_rounds, plan_transfer
from .protocol import DST, P2P, P2P_WIRE_FORMAT, SRC, Channel, SenderWatch, check_timeout, check_transport_name
from .transports import choose_transports, device_info, make_process_group


@dataclasses.dataclass
class Registration:
    """What one rank's set-up agreed with every other rank of the sync. plan: the
    transfer (this rank's point-to-point buckets capped and relayed as set up);
    transports: (sender, receiver) -> its transport, for every pair; src_infos /
    dst_infos: every rank's device info; p2p_rounds: the point-to-point pairs, round
    by round; p2p_peers: this rank's point-to-point peers in round order;
    incarnation: how many times this rank registered under the sync's name; group:
    the point-to-point group (None without point-to-point pairs)."""

    plan: TransferPlan
    transports: dict[tuple[int, int], str]
    src_infos: list[dict]
    dst_infos: list[dict]
    p2p_rounds: list
    p2p_peers: list[int]
    incarnation: int
    group: dist.ProcessGroup | None

    @property
    def transport(self) -> str:
        """What the sync uses, e.g. "shm", or "p2p+shm" where some pairs span hosts."""
        return "+".join(sorted(set(self.transports.values())))


def register_sender(channel: Channel, layout: Layout, rank: int, tensors: Mapping[str, torch.Tensor],
                    device: torch.device, *, transport: str, timeout: float, bucket_bytes: int,
                    relay_buckets: list | None, delta: bool = False) -> Registration:
    """Sender `rank`'s set-up: publishes its relay buckets (None but on a relay),
    its device info (with whether it sends deltas to its point-to-point receivers)
    and, on rank 0, the plan's bucket size and the senders' layout; then meets the
    receivers (see `_meet`). Its set-up waits block (nobody reports failures to a
    sender)."""
    deadline = time.monotonic() + timeout
    channel.set(f"{SRC}/{rank}/relay_buckets", relay_buckets)  # before the info key, which receivers wait for
    channel.set(f"{SRC}/{rank}/info", {**device_info(device, None), "transport": transport, "delta": delta,
                                       "wire": P2P_WIRE_FORMAT})
    if rank == 0:  # before the layout, which the receivers wait for
        channel.set(f"{SRC}/bucket_bytes", bucket_bytes)
        channel.set(f"{SRC}/layout", layout.to_dict())
    plan, infos, transports = _meet(channel, SRC, layout, rank, deadline, lambda senders: None)
    return _join(channel, SRC, rank, plan, infos, transports, device, timeout,
                 {(rank, dst): relay_buckets for dst in plan.receivers_of(rank)}, tensors)


def register_receiver(channel: Channel, layout: Layout, rank: int, tensors: Mapping[str, torch.Tensor],
                      device: torch.device, *, transport: str, timeout: float, p2p_bucket_bytes: int | None,
                      watch: SenderWatch) -> Registration:
    """Receiver `rank`'s set-up: publishes its device info (its tensors' memory is
    what CUDA IPC exports) and, on rank 0, its cap on point-to-point buckets and
    the receivers' layout; then meets the senders (see `_meet`). Its set-up waits
    watch the senders' failure reports (`watch`): a sender that fails ends them."""
    deadline = time.monotonic() + timeout
    channel.set(f"{DST}/{rank}/info", {**device_info(device, tensors), "transport": transport,
                                       "wire": P2P_WIRE_FORMAT})
    if rank == 0:  # before the layout, which the senders wait for
        channel.set(f"{DST}/bucket_bytes", p2p_bucket_bytes)
        channel.set(f"{DST}/layout", layout.to_dict())
    plan, infos, transports = _meet(channel, DST, layout, rank, deadline,
                                    lambda senders: lambda: watch.failure(senders))
    senders = plan.senders_of(rank)
    relayed = {(src, rank): channel.get_if_set(f"{SRC}/{src}/relay_buckets") for src in senders}
    return _join(channel, DST, rank, plan, infos, transports, device, timeout, relayed, tensors)


def _meet(channel: Channel, me: str, layout: Layout, rank: int, deadline: float,
          failure: Callable[[range], Callable[[], str | None] | None]) -> tuple[TransferPlan, list[dict], dict]:
    """The steps after a rank published itself: both sides' layouts (this rank's
    checked against its rank 0's), the plan, every rank's device info, the
    transport of every pair (every rank computes the same), before `deadline`.
    failure(senders): what the waits watch while they wait for those senders.
    Returns (plan, every rank's info, senders first, transports)."""
    # Until sender rank 0's layout is here, the senders' world size is not known: only rank 0's failure is.
    channel.wait({f"{SRC}/layout": "sender rank 0", f"{DST}/layout": "receiver rank 0"}, deadline,
                 "both sides' layouts", failure(range(1)))
    side = "sender" if me == SRC else "receiver"
    if Layout.from_dict(channel.get(f"{me}/layout")) != layout:
        raise ValueError(f"{side} rank {rank}: its layout differs from the one rank 0 registered")
    src_layout, dst_layout = (Layout.from_dict(channel.get(f"{key}/layout")) for key in (SRC, DST))
    plan = plan_transfer(src_layout, dst_layout, channel.get(f"{SRC}/bucket_bytes"))  # both sides bucket alike
    info_keys = {f"{SRC}/{r}/info": f"sender rank {r}" for r in range(src_layout.world_size)}
    info_keys |= {f"{DST}/{r}/info": f"receiver rank {r}" for r in range(dst_layout.world_size)}
    channel.wait(info_keys, deadline, "every rank's device info", failure(range(src_layout.world_size)))
    infos = [channel.get(k) for k in info_keys]
    check_wire_formats(infos, list(info_keys.values()), f"{side} rank {rank}")
    requested = {i["transport"] for i in infos}
    if len(requested) > 1:
        raise ValueError(f"ranks asked for different transports {sorted(requested)}; pass the same to every rank")
    num_src = src_layout.world_size
    return plan, infos, choose_transports(requested.pop(), infos[:num_src], infos[num_src:], plan.pairs)


def check_wire_formats(infos: list[dict], names: list[str], me: str) -> None:
    """ValueError naming the ranks (`names`, beside their device `infos`) whose
    point-to-point wire format is not this llamarl_core's (P2P_WIRE_FORMAT; none
    published: a version before it had one)."""
    other = [f"{name} ({info.get('wire', 'none')})" for name, info in zip(names, infos)
             if info.get("wire") != P2P_WIRE_FORMAT]
    if other:
        raise ValueError(f"{me}: {', '.join(other)} speak another point-to-point wire format than this "
                         f"llamarl_core's ({P2P_WIRE_FORMAT}): install the same llamarl_core on every rank")


def _join(channel: Channel, me: str, rank: int, plan: TransferPlan, infos: list[dict], transports: dict,
          device: torch.device, timeout: float, relayed: Mapping[tuple[int, int], list | None],
          tensors: Mapping[str, torch.Tensor]) -> Registration:
    """The last steps of a rank's set-up: its own point-to-point pairs' buckets cut
    to the receivers' cap, a relay pair's buckets taken from its sender (`relayed`:
    this rank's pairs -> their relay buckets, None for the plan's own), its
    incarnation counted, the point-to-point group joined (its rank: the sender's,
    or the senders' count plus the receiver's)."""
    side = "sender" if me == SRC else "receiver"
    p2p_cap = channel.get_if_set(f"{DST}/bucket_bytes")
    for pair, buckets in relayed.items():
        if p2p_cap is not None and transports[pair] == P2P:
            plan.cap_buckets(pair, p2p_cap)
        if buckets is not None:
            plan.buckets[pair] = relayed_buckets(buckets, pair, plan, tensors, f"{side} rank {rank}")
    # Point-to-point pairs run round by round, each round a matching (no rank in two pairs).
    rounds = bipartite_rounds(pair for pair, t in transports.items() if t == P2P)
    own, peer = (0, 1) if me == SRC else (1, 0)
    peers = [pair[peer] for pairs in rounds for pair in pairs if pair[own] == rank]
    # A rank registered again under the same name (a restarted process) gets a
    # higher incarnation; point-to-point pairs cannot take it back: the process
    # group's rendezvous keys in the Store serve one group once.
    incarnation = channel.counter(f"{me}/{rank}/incarnation", 1)
    if incarnation > 1 and peers:
        raise ValueError(f"{side} rank {rank} registered again under the name {channel.name!r}, but it has "
                         "point-to-point pairs, which cannot be rejoined: register every sender and receiver "
                         "again under a new name")
    num_src, num_dst = plan.src_layout.world_size, plan.dst_layout.world_size
    group = None
    if rounds:
        group = make_process_group(dist.PrefixStore("pg/", channel.store), rank if me == SRC else num_src + rank,
                                   num_src + num_dst, device.type, timeout)
    return Registration(plan, transports, infos[:num_src], infos[num_src:], rounds, peers, incarnation, group)


def relayed_buckets(relayed: list, pair: tuple[int, int], plan: TransferPlan, tensors: Mapping[str, torch.Tensor],
                    who: str) -> list[tuple[Segment, ...]]:
    """The buckets of a relay pair (rank r of one replica to rank r of the next, one
    layout) in its sender's order: each segment copies a region of a tensor of
    `tensors` (the rank's own: `who`) to the same region of the same tensor.
    Checked to stay inside the tensors and to write exactly the bytes the plan's
    own buckets write, none twice."""
    src, dst = pair
    where = f"{who}: the relay buckets of pair {src} -> {dst}"
    if src != dst or plan.src_layout != plan.dst_layout:
        raise ValueError(f"{where}: not a relay between replicas of one layout")
    buckets = []
    for bucket in relayed:
        segments = []
        for name, offset, pitch, width, height in bucket:
            tensor = tensors.get(name)
            itemsize = tensor.element_size() if tensor is not None else 0
            row = width * itemsize  # the pitch of a single row is unused
            if tensor is None or not (0 <= offset and 0 < row and height > 0 and (height == 1 or row <= pitch)
                                      and offset + (height - 1) * pitch + row <= tensor.nbytes):
                raise ValueError(f"{where}: segment {name!r} at byte {offset} ({height} x {width}, pitch {pitch}) "
                                 "is not inside a tensor of this rank")
            segments.append(Segment(src, name, offset, pitch, dst, name, offset, pitch, width, height, itemsize,
                                    False))
        buckets.append(tuple(segments))
    given, planned = (written_runs([s for b in bs for s in b]) for bs in (buckets, plan.buckets[pair]))
    if given is None or planned is None:
        raise ValueError(f"{where} write some bytes twice")
    if given.keys() != planned.keys() or any(not np.array_equal(given[n], planned[n]) for n in given):
        raise ValueError(f"{where} do not write the bytes the plan writes")
    return buckets


def check_endpoint(side: str, layout: Layout, rank: int, tensors: Mapping[str, torch.Tensor], transport: str,
                   timeout: float, num_threads: int | None, bucket_bytes: int,
                   p2p_bucket_bytes: int | None = None) -> torch.device:
    """The checks both sides make of their arguments before anything is published;
    returns the tensors' device."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a llamarl_core.sync.Layout, got {type(layout).__name__}")
    if not layout.params:
        raise ValueError(f"{side}: the layout has no parameters: a sync of nothing (an empty model?)")
    check_int(rank, "rank", 0)
    if rank >= layout.world_size:
        raise ValueError(f"{side} rank {rank} is outside the layout's world size {layout.world_size}")
    check_timeout(timeout)
    check_transport_name(transport)
    check_int(num_threads, "num_threads", 1, optional=True)
    check_int(bucket_bytes, "bucket_bytes", 1)
    check_int(p2p_bucket_bytes, "p2p_bucket_bytes", 1, optional=True)
    check_exchanged_dtypes(layout, f"{side} rank {rank}")
    check_local_tensors(layout, rank, tensors, side)
    return tensors_device(tensors, f"{side} rank {rank}")


class Endpoint:
    """The base of WeightSender and WeightReceiver: what either holds once its
    set-up function (register_sender, register_receiver) has run, and the helpers
    both sides' transfers use."""

    side = ""

    def __init__(self, channel: Channel, layout: Layout, rank: int, tensors: Mapping[str, torch.Tensor],
                 device: torch.device, registration: Registration, *, timeout: float, num_threads: int | None):
        self.channel, self.layout, self.rank, self.tensors, self.device = channel, layout, rank, dict(tensors), device
        self.timeout, self.num_threads = timeout, num_threads
        self._closed = False
        self.plan = registration.plan
        self.transports, self.transport = registration.transports, registration.transport
        self._src_infos, self._dst_infos = registration.src_infos, registration.dst_infos
        self._p2p_rounds, self._p2p_peers = registration.p2p_rounds, registration.p2p_peers
        self._incarnation, self.group = registration.incarnation, registration.group

    def _deadline(self, timeout: float | None) -> float:
        check_timeout(timeout, optional=True)
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
                # The op stays posted on the pair: what the next one would read is not its own.
                raise SyncTimeoutError(f"{what} did not complete in time ({P2P_AGAIN})")
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


P2P_AGAIN = "a point-to-point pair cannot be used again: register every sender and receiver again under a new name"


def p2p_failure(what: str, exc: RuntimeError) -> SyncError:
    """The sync's error for a failed point-to-point op: gloo reports its own timeouts
    as RuntimeError ("Timed out waiting ..."), which is a SyncTimeoutError here.
    Once an op timed out gloo closes the rank's pairs for good (the peer reads it
    as a connection closed): every later op on them fails, and the error says what
    to do."""
    if "Timed out" in str(exc):
        return SyncTimeoutError(f"{what} did not complete in time ({P2P_AGAIN}): {exc}")
    cause = ("a timeout closed this rank's pairs" if "timeout caused pair closure" in str(exc)
             else "a peer died, timed out or its connection broke")
    return SyncError(f"{what} failed ({cause}; {P2P_AGAIN}): {exc}")


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
