"""The decisions of a point-to-point pair of deltas (llamarl_core/sync/delta_pair.py:
the sender's base and density limit, the receiver's words), driven alone through
random orders of sends, failures and restarts, and between real processes: every
version lands on every receiver bit for bit as a full send writes it."""

import itertools
import random

import numpy as np
import pytest
import torch

from helpers import random_destination, small_config, unpack_bucket
from sync_checks import mismatches
from llamarl_core.sync import plan_transfer
from llamarl_core.sync.delta import DENSE, BucketCodec, bucket_checksum, pair_codecs
from llamarl_core.sync.endpoint import packed
from llamarl_core.sync.engine import run_segment_table
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp


def test_a_bucket_sent_whole_unscanned_is_packed_with_its_base_at_once():
    """PairBase.take_whole on the host with the bucket's pack table, as the stream
    sends a bucket denser than the limit: staging and the base take the packed
    bytes, the base's checksum theirs, and the next scan moves from them. A pack
    through a table that fails says so (the caller packs staging) and leaves the
    bucket held by no receiver (its checksum unknown). A first scan, against a
    base never sent, finds every element changed but records no density: the next
    version is scanned, not sent whole unscanned."""
    from llamarl_core.sync.delta_pair import PairBase
    from llamarl_core.sync.engine import KIND_COPY, KIND_F32_TO_BF16
    from llamarl_core.sync.plan import Segment

    gen = torch.Generator().manual_seed(8)
    source = torch.randn(3 * 5000 + 1, generator=gen)
    segments = [Segment(0, "s", 0, 3, 0, "a", 0, 3, 3, 1, 1, False),
                Segment(0, "s", 3, 10000, 0, "b", 0, 10000, 5000, 1, 2, False)]
    codec = BucketCodec(segments)
    staging = torch.full((codec.nbytes,), 77, dtype=torch.uint8)
    table = np.array([(source.data_ptr(), 3, staging.data_ptr(), 3, 3, 1, KIND_COPY),
                      (source.data_ptr() + 4, 20000, staging.data_ptr() + 3, 10000, 5000, 1, KIND_F32_TO_BF16)],
                     dtype=np.int64)
    packed_bytes = torch.empty_like(staging)
    run_segment_table(table + np.array([0, 0, packed_bytes.data_ptr() - staging.data_ptr(), 0, 0, 0, 0]),
                      torch.device("cpu"), 1)
    base = PairBase([codec], torch.device("cpu"))
    base._last_density[0], base.density.limit = 0.9, 0.5  # found dense last time: whole, unscanned
    assert base.skips_scan(0) and base.reads_through(0, staging)
    with pytest.raises(ValueError, match="take_whole, not scan"):
        base.scan(0, staging, table)
    assert base.take_whole(0, staging, table, threads=2)
    assert torch.equal(staging, packed_bytes) and torch.equal(base._base(0), packed_bytes)
    assert base.sums[0] == bucket_checksum(packed_bytes)
    source[:2] += 1.0  # the next version: its scan's checksum moves from the base's
    base._last_density[0] = 0.0
    scan = base.scan(0, staging, table)
    assert scan.changed > 0 and base.sums[0] == bucket_checksum(base._base(0))
    base._last_density[0], base._unscanned[0], base._rescan_after[0] = 0.9, 0, 1
    shifted = table.copy()
    shifted[:, 2] += 1  # does not write staging: refused before a byte is written
    assert not base.take_whole(0, staging, shifted) and base.sums[0] is None
    fresh = PairBase([codec], torch.device("cpu"))
    fresh.density.limit = 0.5
    assert fresh.scan(0, staging, table, delta=False) is None and fresh.sums[0] == bucket_checksum(fresh._base(0))
    assert not fresh.skips_scan(0) and fresh.wants_checksums((1, fresh.sums))


def _destination_bytes(unpack, tensors):
    """The bytes the segments `unpack` cover in `tensors`, in the bucket's order."""
    parts = []
    for seg in unpack:
        flat = tensors[seg.dst_name].view(-1).view(torch.uint8)
        rows = flat.as_strided((seg.height, seg.width * seg.itemsize), (seg.dst_pitch, 1),
                               flat.storage_offset() + seg.dst_offset)
        parts.append(rows.reshape(-1))
    return torch.cat(parts)


def test_random_orders_of_sends_failures_restarts_and_pokes_never_apply_a_delta_to_another_base():
    """The delta protocol's decisions (PairBase.begin / wants_checksums / usable /
    scan / take_whole / encode on the sender, PairHeld.word on the receiver, the
    version word alone where every bucket goes whole), driven as stream.py
    and receiver.py drive them, through 600 random runs of 3-8 events: a version sent
    whole to its end, a send that breaks off after a random bucket (the receiver
    holds part of it), a receiver restarted (its weights poisoned afresh, nothing
    held), a sender restarted (no base), bytes of the receiver changed outside the
    sync; density limits that send changed buckets whole, unscanned; probes (a
    version whole, unscanned); half the versions scanned before the offer
    (stream.prescan) as far as a random bucket; half the receives' checksums read
    ahead (PairHeld.early_checksums) as far as a random bucket. Every delta is
    applied to exactly the bytes it was made against, and
    after every completed send the receiver's tensors equal, bit for bit, those of
    a receiver that took every version whole."""
    from llamarl_core.sync.delta_pair import WORDS_CHECKSUMS, WORDS_VERSION, PairBase, PairHeld

    llama = small_config("llama_gqa_bias")
    plan = plan_transfer(hf_llama_fsdp(llama, 3, torch.float32), vllm_llama_tp(llama, 2, torch.bfloat16),
                         bucket_bytes=40000)
    pair = max(plan.buckets, key=lambda p: len(plan.buckets[p]))
    buckets = plan.buckets[pair]
    codecs = pair_codecs(buckets)
    unpacks = [packed(b)[1] for b in buckets]
    layout, rank, cpu = plan.dst_layout, pair[1], torch.device("cpu")
    rng = random.Random(41)
    deltas = fulls = whole_versions = prescans = 0  # whole_versions: a base stood, yet every bucket went whole unscanned
    for run in range(600):
        gen = torch.Generator().manual_seed(run)
        version_bytes = [torch.randint(0, 256, (c.nbytes,), dtype=torch.uint8, generator=gen) for c in codecs]
        base, held = PairBase(codecs, cpu), PairHeld(codecs)
        base.density.observe = lambda *timing: None  # the timed limit has a test of its own: here one drawn
        base.density.limit = rng.choice([1.0, 1.0, 0.01, 0.0])  # 0: buckets found changed go whole unscanned
        tensors = random_destination(layout, rank, run)
        reference = {name: t.clone() for name, t in tensors.items()}
        version = 0
        for _ in range(rng.randint(3, 8)):
            event = rng.choices(["send", "break", "receiver restart", "sender restart", "poke"], [6, 2, 1, 1, 1])[0]
            if event == "receiver restart":
                tensors, held = random_destination(layout, rank, rng.randrange(1 << 30)), PairHeld(codecs)
                reference = {name: t.clone() for name, t in tensors.items()}
                continue
            if event == "sender restart":
                base = PairBase(codecs, cpu)
                continue
            if event == "poke":  # one byte the pair writes, changed behind the sync (here and in the reference)
                seg = rng.choice([seg for u in unpacks for seg in u])
                at = seg.dst_offset + rng.randrange(seg.height) * seg.dst_pitch + rng.randrange(seg.width * seg.itemsize)
                for t in (tensors, reference):
                    t[seg.dst_name].view(-1).view(torch.uint8)[at] ^= 1 + rng.randrange(255)
                continue
            version += 1
            fraction = rng.choice([0.0, 0.002, 0.05, 1.0])
            for data in version_bytes:  # the next version: none, a few, a twentieth or every byte changed
                if fraction == 1.0:
                    data ^= 1
                elif fraction:
                    data[torch.randint(0, data.numel(), (int(fraction * data.numel()) + 1,), generator=gen)] ^= 1
            base.density.probe = rng.random() < 0.1  # a probe: the version whole and unscanned
            standing = base.begin()  # the header asks for words; the receiver sends them
            asked = WORDS_CHECKSUMS if base.wants_checksums(standing) else WORDS_VERSION
            # Half the versions scanned before the offer (stream.prescan), as far as a random bucket
            # (the share of payloads kept): their deltas kept, each sent or not as the word says.
            scanned, kept, was_then = set(), {}, {}
            if asked == WORDS_CHECKSUMS and rng.random() < 0.5:
                for i in range(rng.randint(0, len(codecs))):
                    if not base.skips_scan(i):
                        scanned.add(i)
                        was_then[i] = base.bytes[base.starts[i]:base.starts[i] + codecs[i].nbytes].clone()
                        kept[i] = base.encode(i, version_bytes[i], base.scan(i, version_bytes[i], delta=True), True)
                        prescans += 1
            # Half the receives read their checksums ahead, as far as a random bucket, while the header
            # is on its way (PairHeld.early_checksums): none where it holds no version of the pair.
            early = None
            if rng.random() < 0.5:
                ahead, asks = rng.randint(0, len(codecs)), itertools.count()
                early = held.early_checksums(tensors, lambda: next(asks) >= ahead)
                assert len(early) == (0 if held.version is None else ahead), (run, early, ahead)
            words = [held.word(i, tensors, cpu, checksum=asked == WORDS_CHECKSUMS, early=early).tolist()
                     for i in range(PairHeld.words(len(codecs), asked))]
            if asked == WORDS_VERSION:  # every bucket goes whole: the receiver read none of what it holds
                assert words == [[-1 if held.version is None else held.version]]
                whole_versions += standing[0] is not None
            use = [asked == WORDS_CHECKSUMS and PairBase.usable(standing, words[0][0], i, words[i][-1])
                   for i in range(len(codecs))]
            held.version = None
            last = len(codecs) if event == "send" else rng.randrange(len(codecs))
            for i, (codec, unpack, data) in enumerate(zip(codecs, unpacks, version_bytes)):
                if i == last:
                    break
                if i in scanned:  # its base took the version's bytes before the offer
                    delta = kept[i] if use[i] and kept[i].encoding != DENSE else base.encode(i, data, None, False)
                    was = was_then[i]
                else:
                    was = base.bytes[base.starts[i]:base.starts[i] + codec.nbytes].clone()
                    if base.skips_scan(i):  # as the stream does: whole unscanned, or no values where use[i] is not
                        assert base.take_whole(i, data)
                        scan = None
                    else:
                        scan = base.scan(i, data, delta=use[i])
                    delta = base.encode(i, data, scan, use[i])
                    assert not base.density.probe or (scan is None and delta.encoding == DENSE)
                base.sent(delta)
                if delta.encoding == DENSE:
                    fulls += 1
                    unpack_bucket(unpack, delta.payload, tensors)
                else:
                    deltas += 1
                    assert torch.equal(_destination_bytes(unpack, tensors), was), (run, event, i)
                    codec.apply(delta.encoding, delta.payload.clone(), delta.changed, tensors)
            if event == "send":
                base.finish(version, sum(c.nbytes for c in codecs), 0.0)
                held.version = version
                for unpack, data in zip(unpacks, version_bytes):
                    unpack_bucket(unpack, data, reference)
                assert mismatches(reference, tensors) == [], (run, version)
            else:  # the reference takes the whole version once the next send completes
                for unpack, data in zip(unpacks, version_bytes):
                    unpack_bucket(unpack, data, reference)
    assert deltas > 500 and fulls > 500 and whole_versions > 50 and prescans > 300, \
        (deltas, fulls, whole_versions, prescans)


def test_the_density_limit_follows_the_measured_times_in_random_orders():
    """DensityLimit over 3,000 random runs of timed sends (versions whole, and
    versions with delta buckets of random densities taking random times), checked
    against its contract after every event: the limit stays in [0, 1]; bytes alone
    choose (limit 1) before a whole version is timed; the reference is the least of
    the last 4 whole versions' seconds per byte; a delta version that changed
    something and was slower than that makes its densest density go whole, a
    faster one lets it go as a delta (but for the doubling after 16 versions
    without a move); one that changed nothing leaves the limit; the second delta
    version asks for a probe (every bucket whole) when both first ones took over
    0.15 of a full send's time (the first alone never does), and a whole version
    ends one."""
    from llamarl_core.sync.delta_pair import DensityLimit

    rng = random.Random(7)
    probes = 0
    for _ in range(3000):
        limit, fulls, first_ratios = DensityLimit(), [], []
        for _ in range(rng.randint(1, 60)):
            full_bytes = rng.randint(1, 1 << 30)
            seconds = rng.uniform(1e-4, 10.0)
            if limit.probe or rng.random() < 0.1:  # a version sent whole
                limit.observe(seconds, full_bytes, [])
                fulls = (fulls + [seconds / full_bytes])[-4:]
                assert limit.full_seconds_per_byte == min(fulls) and not limit.probe
                continue
            densities = [rng.choice([0.0, rng.random(), rng.random() * 0.01]) for _ in range(rng.randint(1, 4))]
            before, per_byte = limit.limit, limit.full_seconds_per_byte
            limit.observe(seconds, full_bytes, densities)
            densest, doubled = max(densities), limit.limit == min(1.0, max(2 * before, 1e-3)) != before
            if per_byte is None:
                assert limit.limit == before == 1.0 and not limit.probe
                continue
            ratio = seconds / (per_byte * full_bytes)
            first_ratios.append(ratio)
            if densest == 0:
                assert limit.limit == before or doubled
            elif ratio > 1:  # the deltas lost
                assert limit.limit <= before and densest > limit.limit
            else:
                assert limit.limit >= before and not densest > limit.limit
            assert 0.0 <= limit.limit <= 1.0
            if len(first_ratios) == 1:  # one dense delta version does not probe
                assert not limit.probe
            elif len(first_ratios) == 2:
                assert limit.probe == (min(first_ratios) > limit.FIRST_PROBE_ABOVE)
            if limit.probe:
                probes += 1
                assert limit.whole(0, 10)  # every bucket, unchanged ones too
    assert probes > 500
    assert not DensityLimit().whole(10, 10) and not DensityLimit().whole(0, 0)


def test_the_density_limit_settles_near_the_break_even_of_a_simulated_link():
    """A pair whose full send costs 1 s and whose delta costs 0.1 s + 1.6 s x the
    changed fraction (break-even at 56%), times noisy by +-10% and the first full
    send slowed 3x by set-up: over 200 versions of one density each, buckets go as
    deltas where they win and whole where they lose (after at most a few lost
    versions), and after a dense phase a sparse one goes back to deltas."""
    from llamarl_core.sync.delta_pair import DensityLimit

    rng = random.Random(3)

    def run(densities: list[float]) -> list[bool]:
        limit, deltas = DensityLimit(), []
        for i, density in enumerate(densities):
            delta = i > 0 and not limit.whole(int(density * 1000), 1000)
            cost = 0.1 + 1.6 * density if delta else (3.0 if i == 0 else 1.0)
            limit.observe(cost * rng.uniform(0.9, 1.1), 1000, [density] if delta else [])
            deltas.append(delta)
        return deltas

    for density, wins in [(0.01, True), (0.3, True), (0.45, True), (0.7, False), (0.95, False)]:
        deltas = run([density] * 200)
        share = sum(deltas[1:]) / 199
        assert (share > 0.85) if wins else (share < 0.15), (density, share)
    deltas = run([0.9] * 100 + [0.02] * 100)
    assert sum(deltas[:100]) < 15 and sum(deltas[-60:]) > 50, deltas


def test_deltas_point_to_point_land_every_version_whole(tmp_path):
    """Two FSDP trainer ranks send eight versions with delta=True, point to point
    (gloo) in 4 KiB buckets, to two tensor-parallel bf16 generator ranks, which
    relay each version, as deltas too, to a second replica as its buckets land: the
    first whole, then nothing changed, one element, a hundredth of the elements,
    -0.0 / NaN / inf written over finite values, a hundredth, everything (x1.5),
    a hundredth, under a fixed density limit of 0.5 (the version after everything
    changed goes whole unscanned). Every version equals the reference bit for bit
    on every receiver, including the one after a receiver changed an element of
    its own weights (the sender learns it from the checksum and sends that bucket
    whole), on both replicas. The senders scan buckets before the offer (sender
    0 only a version's first few, the rest as it sends them). send() returns the
    bytes put on the wire, last_send counts them; receivers read checksums only for
    versions where a bucket may go as a delta."""
    import datetime

    import torch.distributed as dist

    import delta_workers
    from helpers import run_processes

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    case = dict(tp=2, config_name="llama_gqa_bias", seed=7, limit=0.5)
    # Sender 0 keeps few deltas scanned before the offer (the rest scanned as they are sent), sender 1 all of them.
    jobs = [(delta_workers.sender, dict(port=store.port, rank=r, world=2, bucket_bytes=4096,
                                        prescan_share=0.01 if r == 0 else None, **case)) for r in range(2)]
    # Replica 0 writes each bucket in on its writer thread, some late; replica 1 on the receiving thread.
    jobs += [(delta_workers.receiver, dict(port=store.port, rank=r, replica=replica, num_replicas=2,
                                           write_here=replica == 1, slow_writes=replica == 0, **case))
             for replica in range(2) for r in range(2)]
    results = run_processes(jobs, timeout=240)
    senders, receivers = results[:2], results[2:]
    for index, got in enumerate(receivers):
        assert all(lines == [] for lines in got["mismatches"]), (f"replica {index // 2} rank {index % 2}", got)
    total = [{k: sum(s[v][k] for s in senders) for k in senders[0][v] if k != "version"}
             for v in range(len(senders[0]))]
    # Replica 0's relays send deltas too: what changed on the trainer side changes on the way to replica 1.
    fields = ("wire_bytes", "full_bytes", "changed", "dense_buckets", "delta_buckets", "full_receivers")
    relayed = [{k: sum(r["relayed"][v][k] for r in receivers[:2]) for k in fields} for v in range(len(total))]
    assert all(r["relayed"] == [] for r in receivers[2:])
    assert relayed[0]["full_receivers"] == 2 and relayed[0]["delta_buckets"] == 0, relayed[0]
    for v in (1, 2, 3):  # nothing, one element, a hundredth: no bucket whole, the same elements changed
        assert relayed[v]["dense_buckets"] == 0 and relayed[v]["changed"] == total[v]["changed"], (v, relayed, total)
        assert relayed[v]["wire_bytes"] <= 0.2 * relayed[v]["full_bytes"], (v, relayed[v])
    assert all(s["returned"] == s["wire_bytes"] for stats in senders for s in stats)
    first, nothing, one, hundredth, specials, _, everything, after = total
    assert first["delta_buckets"] == 0 and first["full_receivers"] == 4
    assert first["wire_bytes"] == first["full_bytes"] + 24 * first["dense_buckets"]  # each bucket described
    assert nothing["changed"] == 0 and nothing["dense_buckets"] == 0 and nothing["full_receivers"] == 0
    assert nothing["wire_bytes"] <= 0.02 * nothing["full_bytes"], nothing
    assert 1 <= one["changed"] <= 2, one  # a row replicated on both tensor-parallel ranks: twice
    assert hundredth["wire_bytes"] <= 0.2 * hundredth["full_bytes"], hundredth
    assert 0.005 < hundredth["changed"] / hundredth["elements"] < 0.02, hundredth
    # The two buckets the receivers changed behind the sync, one each (no other is dense by its size).
    assert specials["dense_buckets"] == 2 and specials["full_receivers"] == 0, specials
    assert everything["wire_bytes"] >= 0.9 * everything["full_bytes"], everything
    # Past the limit every bucket went whole, and the next version whole unscanned (its
    # header asked the receivers for the version word alone, no checksum): still bit for bit.
    assert everything["delta_buckets"] == 0 and after["delta_buckets"] == 0 and after["full_receivers"] == 0
    assert after["dense_buckets"] == after["unscanned_buckets"] == everything["dense_buckets"], (everything, after)
    assert everything["unscanned_buckets"] == 0 and all(s["density_limit"] == 0.5 for s in senders[0])
    # Checksums asked for only where some bucket could go as a delta: not the first version, not the one
    # after everything changed; nor, on replica 0, everything's own: the trainer ranks scanned it before
    # the offer (stream.prescan) and found every bucket past the limit (replica 0's relays scan as buckets
    # land). A receiver also reads ahead while a header is on its way (as far as it has come: timing), never
    # for the first version (it holds none): where checksums are asked for, each bucket is read once, ahead
    # or on the ask.
    assert sum(sum(got["early"]) for got in receivers) > 0  # the senders scan before their headers
    for index, got in enumerate(receivers):
        asked = [False] + [True] * (5 if index < 2 else 6) + [False] * (2 if index < 2 else 1)
        assert all(n == 0 for n, a in zip(got["checksums"], asked) if not a) and got["early"][0] == 0, (index, got)
        read = {n + e for n, e, a in zip(got["checksums"], got["early"], asked) if a}
        assert len(read) == 1 and read.pop() > 0, (index, got)


def test_a_refused_delta_bucket_tears_one_version_and_the_next_comes_whole():
    """Sender 0 describes one delta bucket of version 4 as holding one element more
    than it does: the receiver it goes to refuses it before writing it, takes the
    rest of both senders' streams off the wire, and raises SyncError (weights
    torn); the other receiver lands version 4. Sender 0 then sends that receiver
    version 5 whole (its word says it holds nothing of sender 0), and every later
    version lands bit for bit on both, deltas again from version 6. The same for
    a bucket whose write fails: on receiver 1 the copy of version 1's second
    bucket from sender 0 raises; version 1 fails there, sender 1's part landing
    whole, and version 2 comes whole from sender 0 only."""
    import datetime

    import torch.distributed as dist

    import delta_workers
    from helpers import run_processes

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    case = dict(tp=2, config_name="qwen2", seed=11)
    jobs = [(delta_workers.sender, dict(port=store.port, rank=r, world=2, bucket_bytes=8192,
                                        corrupt_version=4 if r == 0 else None, **case)) for r in range(2)]
    jobs += [(delta_workers.receiver, dict(port=store.port, rank=r, fail_write_version=1 if r == 1 else None, **case))
             for r in range(2)]
    results = run_processes(jobs, timeout=240)
    senders, receivers = results[:2], results[2:]
    receivers = [got["mismatches"] for got in receivers]
    refused = [rank for rank, versions in enumerate(receivers) if versions[3][:1] and "refused" in versions[3][0]]
    assert len(refused) == 1 and "bucket" in receivers[refused[0]][3][0], receivers
    assert len(receivers[1][0]) == 1 and "bucket 1 of version 1 from sender 0 could not be written in: RuntimeError" \
        in receivers[1][0][0], receivers[1][0]
    for rank, versions in enumerate(receivers):
        assert all(lines == [] for v, lines in enumerate(versions)
                   if not (v == 3 and rank in refused) and not (v == 0 and rank == 1)), versions
    assert senders[0][1]["full_receivers"] == 1 and senders[1][1]["full_receivers"] == 0  # version 2
    assert senders[0][4]["full_receivers"] == 1 and senders[1][4]["full_receivers"] == 0  # version 5
    assert all(s[5]["full_receivers"] == 0 and s[5]["delta_buckets"] > 0 for s in senders)  # version 6
