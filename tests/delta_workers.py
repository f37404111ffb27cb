"""Worker processes for test_delta_pair.py: trainer ranks sending deltas point to point,
generator ranks receiving them, both walking the same versions of one model."""

from __future__ import annotations

import collections
import dataclasses
import time

import torch

from helpers import deltas_by_size, hf_state_dict, small_config
from sync_checks import mismatches, poisoned_destination
from llamarl_core.sync import SyncError, WeightReceiver, WeightSender
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp
from llamarl_core.sync.reference import reference_fsdp_shards, reference_vllm_tp_shards
from sync_workers import connect

# What each version after the first changes in the trainer's float32 weights.
CHANGES = ("nothing", "one element", "a hundredth", "specials", "a hundredth", "everything", "a hundredth")
POKED_AFTER = 4  # the receivers change one element of their own weights after this version lands


def states(config_name: str, seed: int) -> list[dict[str, torch.Tensor]]:
    """The trainer's full state at versions 1, 2, ... (CHANGES), the same in every process."""
    state = hf_state_dict(small_config(config_name), seed)
    out = [state]
    gen = torch.Generator().manual_seed(seed + 1)
    for change in CHANGES:
        state = {k: v.clone() for k, v in state.items()}
        names = sorted(state)
        if change == "one element":
            state[names[3]].view(-1)[5] += 1.0
        elif change == "a hundredth":
            for name in names:
                flat = state[name].view(-1)
                picked = torch.rand(flat.numel(), generator=gen) < 0.01
                flat[picked] += torch.randn(int(picked.sum()), generator=gen)
        elif change == "specials":  # -0.0 for 0.0 changes the sign bit alone; NaN and inf are bytes like any other
            flat = state[names[1]].view(-1)
            flat[:4] = torch.tensor([0.0, float("inf"), -float("inf"), float("nan")])
            state[names[2]].view(-1)[0] = -0.0
        elif change == "everything":
            for name in names:
                state[name].mul_(1.5)
        out.append(state)
    return out


def _corrupting(versions_sent: list[int], version: int) -> None:
    """From now on in this process, the first delta bucket encoded while `version` is
    the last of `versions_sent` says it holds one element more than it does."""
    from llamarl_core.sync.delta import DENSE
    from llamarl_core.sync.delta_pair import PairBase

    encode, done = PairBase.encode, []

    def lying(self, index, new, scan, delta):
        out = encode(self, index, new, scan, delta)
        if versions_sent[-1] == version and not done and out.encoding != DENSE:
            done.append(index)
            return dataclasses.replace(out, changed=out.changed + 1)
        return out

    PairBase.encode = lying


def sender(port: int, rank: int, world: int, tp: int, config_name: str, seed: int, bucket_bytes: int,
           corrupt_version: int | None = None, limit: float = 1.0, prescan_share: float | None = None) -> list[dict]:
    """Send every version with delta=True, under a fixed density `limit`; returns
    each send's last_send, as a dict. corrupt_version: in that version, this rank's
    first delta bucket lies about its size (the receiver must refuse it).
    prescan_share: stream.PRESCAN_SHARE in this process (a small one: a version's
    first buckets scanned before the offer, the rest as they are sent)."""
    torch.set_num_threads(1)
    deltas_by_size(limit)
    if prescan_share is not None:
        from llamarl_core.sync import stream

        stream.PRESCAN_SHARE = prescan_share
    sent = [0]
    if corrupt_version is not None:
        _corrupting(sent, corrupt_version)
    config = small_config(config_name)
    layout = hf_llama_fsdp(config, world, torch.float32)
    versions = states(config_name, seed)
    shards = {n: t.clone() for n, t in reference_fsdp_shards(versions[0], world, torch.float32)[rank].items()}
    stats = []
    with WeightSender(connect(port), layout, rank, shards, name="delta", transport="p2p", timeout=60,
                      bucket_bytes=bucket_bytes, delta=True) as sync:
        for version, state in enumerate(versions, start=1):
            for name, shard in reference_fsdp_shards(state, world, torch.float32)[rank].items():
                shards[name].copy_(shard)  # in place, as an optimizer step
            sent.append(version)
            wrote = sync.send(version)
            stats.append(dataclasses.asdict(sync.last_send) | {"returned": wrote})
    return stats


def _engine_nans(shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference's NaNs as the copy engine casts every float32 NaN (the quiet NaN
    0x7FC0, csrc/copy_segments.h; torch's own cast gives 0x7FC0 or 0xFFFF)."""
    for tensor in shards.values():
        tensor.view(torch.int16)[tensor.isnan()] = 0x7FC0
    return shards


def receiver(port: int, rank: int, tp: int, config_name: str, seed: int, replica: int = 0,
             num_replicas: int = 1, limit: float = 1.0, write_here: bool = False,
             slow_writes: bool = False, fail_write_version: int | None = None) -> list[list[str]]:
    """Receive every version into NaN-poisoned parameters (generator replica
    `replica` of `num_replicas`: replica 0 from the trainer, the others relayed);
    returns "mismatches": per version the mismatches against the reference shards of
    that version, or ["not taken: <error>"] for a receive that raised SyncError naming a
    bucket refused or not written in; "relayed": per version and child replica, the relay's
    last_send (delta_pair.SendStats as a dict); "checksums": per version, the buckets
    whose checksum this rank read for its senders on their headers' ask, and "early":
    those it read ahead, while a header was on its way. write_here: each bucket
    written in on the receiving thread, as on a GPU; slow_writes: every 16th
    delta applied 5 ms late (a bucket two later must wait to land in its buffer);
    fail_write_version: in that version the second bucket unpacked whole fails to
    be written in (its copy raises)."""
    import llamarl_core.sync.receiver as receiver_module
    from llamarl_core.sync.delta import BucketCodec
    from llamarl_core.sync.delta_pair import PairHeld

    torch.set_num_threads(1)
    deltas_by_size(limit)  # its relays'
    checksums, early, ahead = [0], [0], [False]  # per version: read on a header's ask, read ahead of it
    checksum, early_checksums = BucketCodec.destination_checksum, PairHeld.early_checksums

    def counted(self, tensors):
        (early if ahead[0] else checksums)[-1] += 1
        return checksum(self, tensors)

    def counted_ahead(self, tensors, come):
        ahead[0] = True
        try:
            return early_checksums(self, tensors, come)
        finally:
            ahead[0] = False

    BucketCodec.destination_checksum, PairHeld.early_checksums = counted, counted_ahead
    if slow_writes:
        apply, applied = BucketCodec.apply, [0]

        def late(self, *args):
            applied[0] += 1
            if applied[0] % 16 == 0:
                time.sleep(0.005)
            return apply(self, *args)

        BucketCodec.apply = late
    receiving, unpacks = [0], collections.Counter()  # the version in receive(); its unpacks so far
    if fail_write_version is not None:
        copy = receiver_module.run_segment_table

        def failing(*args, **kwargs):
            unpacks[receiving[0]] += 1
            if receiving[0] == fail_write_version and unpacks[receiving[0]] == 2:
                raise RuntimeError("a copy that failed")
            return copy(*args, **kwargs)

        receiver_module.run_segment_table = failing
    config = small_config(config_name)
    layout = vllm_llama_tp(config, tp, torch.bfloat16)
    params = poisoned_destination(layout, rank)
    out, relayed = [], []
    with WeightReceiver(connect(port), layout, rank, params, name="delta", transport="p2p", timeout=60,
                        replica=replica, num_replicas=num_replicas) as sync:
        sync._write_here = write_here or sync._write_here
        for version, state in enumerate(states(config_name, seed), start=1):
            try:
                checksums.append(0)
                early.append(0)
                receiving[0] = version
                assert sync.receive() == version
                for child in sync.relays.children:  # what the relay to each child put on the wire
                    stats = sync.relays.ready(child, time.monotonic() + 1).last_send
                    relayed.append({"version": version, "child": child, **dataclasses.asdict(stats)})
            except SyncError as exc:
                if "refused" not in str(exc) and "could not be written in" not in str(exc):
                    raise
                out.append([f"not taken: {exc}"])
                continue
            out.append(mismatches(_engine_nans(reference_vllm_tp_shards(state, config, tp, torch.bfloat16)[rank]),
                                  params))
            if version == POKED_AFTER:  # bytes changed outside the sync: the next version must still land whole
                name = sorted(params)[0]
                params[name].view(-1)[0] = 123.0
    return {"mismatches": out, "relayed": relayed, "checksums": checksums[1:], "early": early[1:]}
