"""The delta codec of one point-to-point bucket (llamarl_core/sync/delta.py): for the
buckets of real plans (FSDP trainer -> tensor-parallel bf16 and FP8 generators, fused
q/k/v and gate/up, GQA heads replicated, padded vocabulary, MoE experts) and random
change patterns, a delta applied into a receiver that holds the base leaves every
destination byte equal to what a full send of the new version writes."""

import random

import numpy as np
import pytest
import torch

from helpers import random_destination, small_config, unpack_bucket
from sync_checks import mismatches
from llamarl_core.sync import Layout, ParamSpec, Replicate, Shard, plan_transfer
from llamarl_core.sync.delta import DENSE, MASK, RUNS, BucketCodec, bucket_checksum
from llamarl_core.sync.endpoint import packed
from llamarl_core.sync.engine import run_segment_table
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp


def _plans():
    """(name, plan) of a few layouts, with small buckets so that segments are cut
    and buckets mix tensors (and, for FP8, itemsizes: FP8 weights, fp32 scales)."""
    llama = small_config("llama_gqa_bias")
    qwen = small_config("qwen2")
    yield "llama fsdp3 -> tp2 bf16", plan_transfer(hf_llama_fsdp(llama, 3, torch.float32),
                                                   vllm_llama_tp(llama, 2, torch.bfloat16), bucket_bytes=3000)
    yield "qwen2 fsdp2 -> tp1 fp32", plan_transfer(hf_llama_fsdp(qwen, 2, torch.float32),
                                                   vllm_llama_tp(qwen, 1, torch.float32), bucket_bytes=5000)
    # A column-split trainer into a row-split generator: each segment's rows lie apart in the destination.
    yield "cols2 -> rows3 bf16", plan_transfer(
        Layout(2, [ParamSpec("w", (30, 40), torch.float32, Shard(1)), ParamSpec("b", (40,), torch.float32, Shard(0))]),
        Layout(3, [ParamSpec("w", (30, 40), torch.bfloat16, Shard(0)), ParamSpec("b", (40,), torch.bfloat16,
                                                                                  Replicate())]), bucket_bytes=700)
    yield "llama fsdp3 -> tp2 fp8 block", plan_transfer(
        hf_llama_fsdp(llama, 3, torch.float32), vllm_llama_tp(llama, 2, torch.bfloat16, fp8="block"),
        bucket_bytes=2000)


PLANS = list(_plans())


def _buckets(per_plan=8):
    """(label, destination layout, receiver rank, bucket): `per_plan` buckets of
    each plan, drawn at random (seeded), and each plan's buckets that mix itemsizes."""
    rng = random.Random(0)
    for name, plan in PLANS:
        every = [(f"{name} {src}->{dst} #{i}", plan.dst_layout, dst, bucket)
                 for (src, dst), buckets in plan.buckets.items() for i, bucket in enumerate(buckets)]
        mixed = [case for case in every if len({seg.itemsize for seg in case[3]}) > 1]
        apart = [case for case in every if any(seg.height > 1 and seg.dst_pitch != seg.width * seg.itemsize
                                              for seg in case[3])]
        yield from rng.sample(every, min(per_plan, len(every))) + mixed[:2] + apart[:2]


BUCKETS = list(_buckets())


def _wrapped(value):
    """An int as the signed 64-bit int it is modulo 2**64."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _elements(codec, data):
    """The bucket's bytes split per element."""
    out = []
    for start, end, size, _ in codec.stretches:
        out += [data[i:i + size] for i in range(start, end, size)]
    return out


def _changed(rng, codec, base, pattern):
    """New bytes: `base` with the elements `pattern` picks changed."""
    new = base.clone()
    elements = _elements(codec, new)
    n = len(elements)
    if pattern == "none":
        picked = []
    elif pattern == "one":
        picked = [rng.randrange(n)]
    elif pattern == "every":
        picked = range(n)
    elif pattern == "runs":
        start = rng.randrange(n)
        picked = list(range(start, min(n, start + rng.randint(1, 9)))) + rng.sample(range(n), min(n, 3))
    else:  # a random fraction
        picked = rng.sample(range(n), rng.randint(1, n))
    for i in picked:
        element = elements[i]
        special = rng.random() < 0.3 and element.numel() in (2, 4)
        if special:  # -0.0 for +0.0 (the sign byte alone), or a NaN / inf bit pattern
            element.copy_(torch.tensor([rng.choice([-0.0, float("nan"), float("inf"), -float("inf")])],
                                       dtype=torch.bfloat16 if element.numel() == 2 else torch.float32).view(torch.uint8))
        if not special or torch.equal(element, base[element.data_ptr() - new.data_ptr():][:element.numel()]):
            element[rng.randrange(element.numel())] ^= rng.randint(1, 255)  # at least one bit differs
    return new


@pytest.mark.parametrize("pattern", ["none", "one", "every", "runs", "random"])
def test_a_delta_applied_onto_its_base_equals_a_full_send(pattern):
    rng = random.Random(pattern)
    seen, auto_sizes = set(), []
    for index, (label, layout, rank, bucket) in enumerate(BUCKETS):
        _, unpack = packed(bucket)
        codec = BucketCodec(unpack)
        on_torch = BucketCodec(unpack, native_host=False)  # the path a GPU's tensors take
        base = torch.randint(0, 256, (codec.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(index))
        new = _changed(rng, codec, base, pattern)
        mask = codec.changed_mask(new, base)
        expected_changed = sum(not torch.equal(a, b) for a, b in zip(_elements(codec, new), _elements(codec, base)))
        assert int(mask.sum()) == expected_changed, label
        scan, torch_scan = codec.scan(new, base), on_torch.scan(new, base)
        assert (scan.changed, scan.runs, scan.value_bytes) == \
            (torch_scan.changed, torch_scan.runs, torch_scan.value_bytes) and torch.equal(scan.bits, torch_scan.bits)
        assert scan.checksum_change == _wrapped(bucket_checksum(new) - bucket_checksum(base)), label
        full = random_destination(layout, rank, index)
        unpack_bucket(unpack, new, full)
        for encoding in (None, MASK, RUNS, DENSE):
            delta = codec.diff(new, base, encoding)
            assert delta.changed == expected_changed and delta.elements == codec.elements
            torch_delta = on_torch.diff(new, base, encoding)
            assert delta.encoding == torch_delta.encoding and torch.equal(delta.payload, torch_delta.payload), label
            for applier in (codec, on_torch):
                held = random_destination(layout, rank, index)  # the receiver's other bytes: kept as they were
                unpack_bucket(unpack, base, held)
                assert codec.destination_checksum(held) == bucket_checksum(base), label
                if delta.encoding == DENSE:
                    assert torch.equal(delta.payload, new)
                    unpack_bucket(unpack, delta.payload, held)
                else:
                    # What crosses the wire is bytes: the receiver decodes its own copy.
                    wrote = applier.apply(delta.encoding, delta.payload.clone(), delta.changed, held)
                    assert wrote == codec._values_nbytes(torch.nonzero(mask).reshape(-1)) == scan.value_bytes
                assert mismatches(full, held) == [], (label, encoding, pattern, applier.native_host)
                assert codec.destination_checksum(held) == bucket_checksum(new), label
            if encoding is None:
                seen.add(delta.encoding)
                auto_sizes.append(delta.nbytes)
                sizes = [codec.diff(new, base, e).nbytes for e in (DENSE, MASK, RUNS)]
                assert delta.nbytes == min(sizes), (label, sizes)
        kept = base.clone()
        codec.scan(new, kept, update_base=True)  # the sender's base takes the version it sends
        assert torch.equal(kept, new), label
    if pattern == "none":  # a run count alone (8 bytes), or a mask of zeros where it is shorter
        assert seen <= {MASK, RUNS} and max(auto_sizes) <= 8
    if pattern == "every":
        assert seen == {DENSE}


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["none", "one", "every", "runs", "random"])
def test_on_a_gpu_the_codec_equals_the_hosts(pattern):
    """The codec on a GPU's tensors (torch ops: a GPU sender's scan and encode, a
    GPU receiver's checksums and apply) against the host's native codec on the
    same bytes: the same changed elements, each encoding's payload bit for bit,
    the same checksums, and a delta applied into the receiver's GPU tensors equal
    to a full send of the new bytes; the sender's base on the GPU takes them."""
    cuda = torch.device("cuda")
    rng = random.Random(pattern)
    for index, (label, layout, rank, bucket) in enumerate(BUCKETS):
        _, unpack = packed(bucket)
        codec = BucketCodec(unpack)
        base = torch.randint(0, 256, (codec.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(index))
        new = _changed(rng, codec, base, pattern)
        scan, gpu_scan = codec.scan(new, base), codec.scan(new.to(cuda), base.to(cuda))
        assert (scan.changed, scan.runs, scan.value_bytes) == (gpu_scan.changed, gpu_scan.runs, gpu_scan.value_bytes)
        assert torch.equal(scan.bits, gpu_scan.bits.cpu()), label
        assert bucket_checksum(new.to(cuda)) == bucket_checksum(new), label
        full = random_destination(layout, rank, index)
        unpack_bucket(unpack, new, full)
        for encoding in (MASK, RUNS):
            delta, gpu_delta = codec.diff(new, base, encoding), codec.diff(new.to(cuda), base.to(cuda), encoding)
            assert gpu_delta.payload.is_cuda and torch.equal(delta.payload, gpu_delta.payload.cpu()), label
            held = random_destination(layout, rank, index)
            unpack_bucket(unpack, base, held)
            held = {name: t.to(cuda) for name, t in held.items()}
            assert codec.destination_checksum(held) == bucket_checksum(base), label
            assert codec.apply(delta.encoding, gpu_delta.payload.clone(), delta.changed, held) == scan.value_bytes
            assert mismatches(full, {name: t.cpu() for name, t in held.items()}) == [], (label, encoding)
            assert codec.destination_checksum(held) == bucket_checksum(new), label
        kept = base.to(cuda)
        codec.scan(new.to(cuda), kept, update_base=True)
        assert torch.equal(kept.cpu(), new), label


def test_native_and_torch_codecs_agree_on_unaligned_layouts(simd):
    """Buckets drawn at random (elements of 1, 2, 4 and 8 bytes, stretches that
    start and end off 8-byte words and 64-byte blocks, long stretches of whole
    blocks, a last partial word) and changes drawn at random (none, one element, a
    run, a fraction, all): at each vector level of the host, the native codec and
    the torch one find the same elements, runs, bytes and checksum change, make the
    same payloads, and apply them alike; the scan's base update leaves the base
    equal to the new bytes."""
    from llamarl_core.sync.plan import Segment

    rng = random.Random(11)
    kinds = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    for case in range(300):
        segments, offset = [], 0
        for j in range(rng.randint(1, 6)):
            size, width, height = rng.choice([1, 2, 4, 8]), rng.randint(1, rng.choice([9, 200])), rng.randint(1, 3)
            segments.append(Segment(src_rank=0, src_name="s", src_offset=offset, src_pitch=width * size, dst_rank=0,
                                    dst_name=f"t{j}", dst_offset=0, dst_pitch=width * size, width=width,
                                    height=height, itemsize=size, cast=False, source=None))
            offset += width * height * size
        native_codec, torch_codec = BucketCodec(segments), BucketCodec(segments, native_host=False)
        gen = torch.Generator().manual_seed(case)
        base = torch.randint(0, 256, (offset,), dtype=torch.uint8, generator=gen)
        new = base.clone()
        flips = torch.rand(offset, generator=gen) < rng.choice([0.0, 0.001, 0.05, 0.3, 1.0])
        if rng.random() < 0.2:  # one run of bytes, across blocks
            start = rng.randrange(offset)
            flips[start:start + rng.randint(1, 300)] = True
        new[flips] ^= torch.randint(1, 256, (int(flips.sum()),), dtype=torch.uint8, generator=gen)
        scans = [c.scan(new, base) for c in (native_codec, torch_codec)]
        assert (scans[0].changed, scans[0].runs, scans[0].value_bytes) == \
            (scans[1].changed, scans[1].runs, scans[1].value_bytes) and torch.equal(scans[0].bits, scans[1].bits)
        assert scans[0].checksum_change == _wrapped(bucket_checksum(new) - bucket_checksum(base)), case
        for encoding in (MASK, RUNS):
            deltas = [c.encode(new, scan, encoding) for c, scan in zip((native_codec, torch_codec), scans)]
            assert torch.equal(deltas[0].payload, deltas[1].payload), (case, encoding)
            landed = []
            for c in (native_codec, torch_codec):
                held = {seg.dst_name: base[seg.src_offset:seg.src_offset + seg.nbytes].clone().view(kinds[seg.itemsize])
                        for seg in segments}
                c.apply(encoding, deltas[0].payload.clone(), deltas[0].changed, held)
                landed.append(torch.cat([held[seg.dst_name].view(torch.uint8) for seg in segments]))
            assert torch.equal(landed[0], new) and torch.equal(landed[1], new), (case, encoding)
        kept = base.clone()
        native_codec.scan(new, kept, update_base=True)
        assert torch.equal(kept, new), case


def test_the_native_runs_equal_the_torch_ones_across_mask_blocks(simd):
    """The host's runs of a scan's bitmask (csrc/host/delta_scan.cpp, at each vector
    level, which pairs the starts and stops of 64 mask words at a time) equal the
    torch codec's: masks of several such blocks at densities from none to all, runs
    across a block's edge, a run to the end of a whole last word or of a partial
    one; a wrong run count is refused."""
    from llamarl_core._native import native
    from llamarl_core.sync.delta import _pack_bits

    gen = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    for case in range(60):
        elements = rng.choice([1, 63, 64, 4096, 4097, 64 * 64 * 3, rng.randint(1, 20000)])
        mask = torch.rand(elements, generator=gen) < rng.choice([0.0, 0.01, 0.3, 0.9, 1.0])
        for edge in rng.sample(range(0, elements, 4096), min(2, len(range(0, elements, 4096)))):
            mask[max(0, edge - rng.randint(1, 70)):edge + rng.randint(1, 70)] = True  # across a block's edge
        if rng.random() < 0.3:
            mask[-rng.randint(1, min(elements, 100)):] = True  # a run to the end
        want = BucketCodec._runs(mask)
        bits = _pack_bits(mask)
        out = torch.full((want.shape[0] * 2 + 1,), -7, dtype=torch.int32)
        native().delta_runs_host(bits.data_ptr(), elements, out.data_ptr(), want.shape[0], 4)
        assert torch.equal(out[:-1].view(-1, 2).to(torch.int64), want), (case, elements)
        assert out[-1] == -7, case  # nothing written past the runs
        if want.shape[0]:  # one run fewer than there are: refused, none written past the count
            short = torch.full((want.shape[0] * 2 - 1,), -7, dtype=torch.int32)
            with pytest.raises(RuntimeError, match="runs, the scan counted"):
                native().delta_runs_host(bits.data_ptr(), elements, short.data_ptr(), want.shape[0] - 1, 4)
            assert short[-1] == -7, case


def test_a_scan_through_the_pack_table_equals_one_of_the_packed_bytes(simd):
    """The sender's scan straight from its tensors (BucketCodec.scan_packing: the
    pack table read 64 KiB at a time, the staging buffer left unwritten) finds what
    a scan of the packed bytes finds (bits, counts, values, checksum change, the
    base it leaves), at each vector level: random pack tables of byte copies (1, 2,
    4, 8-byte elements) and fp32 -> bf16 casts, rows apart in their sources, odd
    sizes that put later elements across 64-byte blocks and 4 KiB chunks, small
    buckets and ones of several chunks."""
    from llamarl_core.sync.engine import KIND_COPY, KIND_F32_TO_BF16
    from llamarl_core.sync.plan import Segment

    rng = random.Random(5)
    for case in range(60):
        big = case % 4 == 0
        sources, rows, segments, position = [], [], [], 0
        for j in range(rng.randint(2, 6)):
            cast = rng.random() < 0.3 or (big and j == 1)
            size = 2 if cast else 1 if big and j == 0 else rng.choice([1, 2, 4, 8])
            width = 2 * rng.randint(0, 20) + 1 if big and j == 0 else rng.randint(20000, 40000) if big and j == 1 \
                else rng.randint(1, 9000 if big else 40)
            height = 1 if big and j == 0 else rng.randint(1, 5)  # big: an odd first piece, then a cast across chunks
            src_row = width * (4 if cast else size)
            pitch = src_row + rng.choice([0, 0, 4, 12])
            source = torch.randn(pitch * height // 4 + 1).view(torch.uint8)
            if not cast:
                source.copy_(torch.randint(0, 256, source.shape, dtype=torch.uint8))
            sources.append(source)
            rows.append((source.data_ptr(), pitch, position, width * size, width if cast else width * size, height,
                         KIND_F32_TO_BF16 if cast else KIND_COPY))
            segments.append(Segment(src_rank=0, src_name="s", src_offset=position, src_pitch=width * size,
                                    dst_rank=0, dst_name=f"t{j}", dst_offset=0, dst_pitch=width * size, width=width,
                                    height=height, itemsize=size, cast=False))
            position += width * height * size
        codec = BucketCodec(segments)

        def table(staging):
            return np.array([(src, pitch, staging.data_ptr() + at, dst_pitch, width, height, kind)
                             for src, pitch, at, dst_pitch, width, height, kind in rows], dtype=np.int64)

        packed_bytes = torch.zeros(position, dtype=torch.uint8)
        run_segment_table(table(packed_bytes), torch.device("cpu"), 1)
        base = packed_bytes.clone()
        flips = torch.rand(position) < rng.choice([0.0, 0.001, 0.05, 0.5, 1.0])
        base[flips] ^= 1
        staging = torch.full((position,), 77, dtype=torch.uint8)
        kept = [base.clone(), base.clone()]
        want = codec.scan(packed_bytes, kept[0], update_base=True)
        got = codec.scan_packing(table(staging), staging, kept[1], update_base=True)
        assert (got.changed, got.runs, got.value_bytes, got.checksum_change) == \
            (want.changed, want.runs, want.value_bytes, want.checksum_change), case
        assert torch.equal(got.bits, want.bits) and torch.equal(got.values, want.values), case
        assert torch.equal(kept[0], packed_bytes) and torch.equal(kept[1], packed_bytes), case
        assert bool((staging == 77).all()), case
        both = torch.zeros(position, dtype=torch.uint8)  # a bucket sent whole unscanned: staging and base packed
        assert codec.pack_base(table(staging), staging, both, threads=rng.choice([1, 3])) == \
            bucket_checksum(packed_bytes), case
        assert torch.equal(staging, packed_bytes) and torch.equal(both, packed_bytes), case
    shifted = torch.zeros(position + 1, dtype=torch.uint8)[1:]  # a table that does not write `staging`
    with pytest.raises(ValueError, match="does not write the packed bytes"):
        codec.scan_packing(table(shifted), staging, base.clone())
    with pytest.raises(ValueError, match="does not write the packed bytes"):
        codec.pack_base(table(shifted), staging, base.clone())


def test_a_scan_split_over_threads_equals_one_on_one_thread(simd):
    """A bucket of 13 MiB scanned on 3 threads (parts of whole 64 KiB blocks),
    with and without the pack table, finds what one thread finds: float32
    elements from byte 0 (a part's first element follows the part before's last),
    from byte 3 after 3 one-byte elements (one straddles every part boundary), and
    bf16 cast from float32 from byte 3; changes at random, at each boundary, and a
    run across each; packing staging and the base at once, on 3 threads, equals the
    pack. A scan through the table without its values makes no delta."""
    from llamarl_core.sync.engine import KIND_COPY, KIND_F32_TO_BF16
    from llamarl_core.sync.plan import Segment

    gen = torch.Generator().manual_seed(3)
    for prefix, size in ((0, 4), (3, 4), (3, 2)):
        count = 13 * (1 << 20) // size
        segments = [Segment(0, "s", 0, prefix, 0, "a", 0, prefix, prefix, 1, 1, False)] if prefix else []
        segments.append(Segment(0, "s", prefix, size * count, 0, "b", 0, size * count, count, 1, size, False))
        codec = BucketCodec(segments)
        source = torch.randint(0, 256, (prefix + 4 * count,), dtype=torch.uint8, generator=gen)
        staging = torch.empty(codec.nbytes, dtype=torch.uint8)
        rows = [(source.data_ptr(), prefix, staging.data_ptr(), prefix, prefix, 1, KIND_COPY)] if prefix else []
        rows.append((source.data_ptr() + prefix, 4 * count, staging.data_ptr() + prefix, size * count,
                     count if size == 2 else 4 * count, 1, KIND_F32_TO_BF16 if size == 2 else KIND_COPY))
        table = np.array(rows, dtype=np.int64)
        new = torch.empty_like(staging)  # the packed bytes
        run_segment_table(table.copy() + np.array([0, 0, new.data_ptr() - staging.data_ptr(), 0, 0, 0, 0]),
                          torch.device("cpu"), 1)
        edges = range(1 << 16, codec.nbytes, 1 << 16)
        for change in ("random", "edges", "runs"):
            base = new.clone()
            if change == "random":
                flips = torch.rand(codec.nbytes, generator=gen) < 0.01
            else:
                flips = torch.zeros(codec.nbytes, dtype=torch.bool)
                for edge in edges:
                    if change == "edges":
                        flips[edge + 1] = True  # a byte of the element across the edge (from byte 3), past it
                    else:
                        flips[edge - 40:edge + 40] = True
            base[flips] ^= 0x40
            want_base = base.clone()
            want = codec.scan(new, want_base, update_base=True)
            for scan_with in ("bytes", "pack"):
                kept, label = base.clone(), (prefix, size, change, scan_with)
                got = codec.scan(new, kept, update_base=True, threads=3) if scan_with == "bytes" else \
                    codec.scan_packing(table, staging, kept, update_base=True, threads=3)
                assert (got.changed, got.runs, got.value_bytes, got.checksum_change) == \
                    (want.changed, want.runs, want.value_bytes, want.checksum_change), label
                assert torch.equal(got.bits, want.bits) and torch.equal(got.values, want.values), label
                assert torch.equal(kept, new), label
        both = torch.zeros_like(new)  # whole unscanned: the bucket packed into staging and the base at once
        assert codec.pack_base(table, staging, both, threads=3) == bucket_checksum(new), (prefix, size)
        assert torch.equal(staging, new) and torch.equal(both, new), (prefix, size)
    bare = codec.scan_packing(table, staging, base.clone(), values=False)
    assert bare.values is None and bare.changed == want.changed
    with pytest.raises(ValueError, match="without its values"):
        codec.encode(staging, bare, RUNS)
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        codec.scan(new, base, threads=0)


def test_buckets_mix_itemsizes_and_tensors():
    """The cases above cover what the codec must handle: buckets of several tensors,
    FP8 weights (1 byte) beside their fp32 scales in one bucket, segments cut
    mid-tensor, rows apart in the destination (tensor-parallel shards)."""
    sizes = {tuple(s[2] for s in BucketCodec(packed(b)[1]).stretches) for _, _, _, b in BUCKETS}
    assert any(len(set(s)) > 1 for s in sizes) and {1, 2, 4} <= {x for s in sizes for x in s}
    assert any(len({seg.dst_name for seg in b}) > 1 for _, _, _, b in BUCKETS)
    assert any(seg.height > 1 and seg.dst_pitch != seg.width * seg.itemsize for _, _, _, b in BUCKETS for seg in b)


def test_the_checksum_tells_apart_another_base():
    label, layout, rank, bucket = BUCKETS[0]
    codec = BucketCodec(packed(bucket)[1])
    base = torch.randint(0, 256, (codec.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    held = random_destination(layout, rank, 0)
    unpack_bucket(codec.segments, base, held)
    rng = random.Random(0)
    for _ in range(200):
        other = base.clone()
        i, j = rng.sample(range(codec.nbytes), 2)
        if rng.random() < 0.5:
            other[i] ^= rng.randint(1, 255)  # one byte changed
        elif other[i] != other[j]:
            other[i], other[j] = other[j].clone(), other[i].clone()  # two bytes swapped
        else:
            continue
        assert bucket_checksum(other) != bucket_checksum(base)
    # Patterns a position-weighted linear sum misses (the changes and their moments sum to zero).
    for pattern in ({10: 1, 14: -2, 18: 1}, {0: 1, 1: -1, 9: -1, 10: 1}):
        other = base.clone()
        for at, change in pattern.items():
            other[at] = 100 + change
            base[at] = 100
        assert bucket_checksum(other) != bucket_checksum(base), pattern
    # ... and a linear sum with odd weights: the same top bit flipped up in one word and down
    # in another (two fp32 signs: +-2**63 weighted by odd numbers cancel mod 2**64); two
    # words swapped; a word's halves swapped.
    words = base[:codec.nbytes // 8 * 8].view(torch.int64)
    for _ in range(50):
        i, j = rng.sample(range(words.numel()), 2)
        other = base.clone()
        flips = other[:words.numel() * 8].view(torch.int64)
        words[i] &= (1 << 63) - 1
        words[j] |= -(1 << 63)
        flips[i], flips[j] = words[i] | -(1 << 63), words[j] & ((1 << 63) - 1)
        assert bucket_checksum(other) != bucket_checksum(base)
        other = base.clone()
        swaps = other[:words.numel() * 8].view(torch.int64)
        if words[i] != words[j]:
            swaps[i], swaps[j] = words[j].clone(), words[i].clone()
            assert bucket_checksum(other) != bucket_checksum(base)
        other = base.clone()
        halves = other[:words.numel() * 8].view(torch.int32)
        if halves[2 * i] != halves[2 * i + 1]:
            halves[2 * i], halves[2 * i + 1] = halves[2 * i + 1].clone(), halves[2 * i].clone()
            assert bucket_checksum(other) != bucket_checksum(base)
    unpack_bucket(codec.segments, base, held)
    first = codec.segments[0]
    tensor = held[first.dst_name].view(-1).view(torch.uint8)
    tensor[first.dst_offset] ^= 1  # the receiver's bytes changed outside the sync
    assert codec.destination_checksum(held) != bucket_checksum(base)


def test_bad_payloads_are_refused_with_nothing_written():
    label, layout, rank, bucket = BUCKETS[1]
    codec = BucketCodec(packed(bucket)[1])
    base = torch.zeros(codec.nbytes, dtype=torch.uint8)
    new = base.clone()
    new[::7] = 1
    held = random_destination(layout, rank, 3)
    before = {k: v.clone() for k, v in held.items()}
    mask_delta, runs_delta = codec.diff(new, base, MASK), codec.diff(new, base, RUNS)
    runs = runs_delta.payload[8:8 + 16].clone().view(torch.int32)
    swapped = runs_delta.payload.clone()
    swapped[8:8 + 16] = runs.flip(0).view(-1, 2).flip(1).reshape(-1).view(torch.uint8)  # two runs out of order
    cases = [
        (MASK, mask_delta.payload[:-1], mask_delta.changed, "elements and"),
        (MASK, mask_delta.payload[:3], mask_delta.changed, "shorter than its mask"),
        (MASK, mask_delta.payload, mask_delta.changed + 1, "which says it holds"),
        (RUNS, runs_delta.payload[:5], runs_delta.changed, "shorter than its run count"),
        (RUNS, runs_delta.payload[:20], runs_delta.changed, "says it holds"),
        (RUNS, swapped, runs_delta.changed, "not increasing"),
        (DENSE, new, 0, "MASK .* or RUNS"),
    ]
    for applier in (codec, BucketCodec(packed(bucket)[1], native_host=False)):
        for encoding, payload, changed, match in cases:
            with pytest.raises(ValueError, match=match):
                applier.apply(encoding, payload, changed, held)
            assert mismatches(before, held) == []
    with pytest.raises(ValueError, match="bucket's .* bytes as a contiguous 1-D uint8"):
        codec.diff(new[:-1], base)
    with pytest.raises(ValueError, match="encoding must be one of"):
        codec.diff(new, base, 7)
    with pytest.raises(ValueError, match="contiguous"):  # native code reads it by address
        codec.diff(torch.zeros(2 * codec.nbytes, dtype=torch.uint8)[::2], base)


def _reference_checksum(data: bytes, first: int) -> int:
    """csrc/host/checksum.h's sum in plain Python ints: each 8-byte word the bytes
    touch (bytes at positions 8w .. 8w + 7, little-endian, absent ones zero), masked
    by its key w * K, the product of the masked word's halves plus the word with
    its halves swapped, summed mod 2**64, as a signed int."""
    mask = (1 << 64) - 1
    words: dict[int, int] = {}
    for i, byte in enumerate(data):
        w, at = divmod(first + i, 8)
        words[w] = words.get(w, 0) | byte << (8 * at)
    total = 0
    for w, value in words.items():
        masked = value ^ ((w * 0x9E3779B97F4A7C15) & mask)
        swapped = (value >> 32) | ((value & 0xFFFFFFFF) << 32)
        total = (total + (masked & 0xFFFFFFFF) * (masked >> 32) + swapped) & mask
    return total - (1 << 64) if total >= 1 << 63 else total


def test_the_native_checksum_equals_the_torch_one(simd):
    """The host's checksum (csrc/host/checksum.cpp, at each vector level), the
    torch ops a GPU runs (delta._DeviceSum, run here on the CPU) and a plain-Python
    reference give the same sum, on random bytes and on runs of one value, from any first position,
    in one row or cut into rows that split words."""
    from llamarl_core._native import native
    from llamarl_core.sync.delta import _checksum_rows, _DeviceSum

    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for size, first in [(1, 0), (7, 3), (77, 0), (5000, 12345), (1 << 16, 2**40 + 5)]:
        for data in (torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen),
                     torch.full((size,), 255, dtype=torch.uint8)):
            want = _reference_checksum(bytes(data.tolist()), first) if size <= 5000 else None
            row = np.array([[data.data_ptr(), size, size, 1, first]], dtype=np.int64)
            got = native().checksum_rows_host(row)
            cuts = sorted({0, size, *(rng.randrange(size + 1) for _ in range(5))})
            rows = np.array([[data.data_ptr() + a, b - a, b - a, 1, first + a] for a, b in zip(cuts, cuts[1:])],
                            dtype=np.int64)
            total = _DeviceSum(torch.device("cpu"))
            for a, b in zip(cuts, cuts[1:]):
                total.add(data[a:b], first + a)
            assert got == native().checksum_rows_host(rows) == total.value(), (size, first, cuts)
            assert want is None or got == want, (size, first)
    # Rows apart, in a tensor that starts inside its storage (a parameter that is a view).
    view = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=gen)[100:].view(torch.int16)
    rows = [(view, 7, 50, 30, 20), (view, 1500, 40, 40, 3), (view, 4000, 0, 0, 0)]
    cpu = torch.device("cpu")
    stream = b"".join(bytes(view.view(torch.uint8)[o + r * p:o + r * p + n].tolist())
                      for _, o, p, n, h in rows for r in range(h))
    assert _checksum_rows(rows, cpu, host=True) == _checksum_rows(rows, cpu, host=False) == \
        _reference_checksum(stream, 0)
    for bad in [(view, 4890, 10, 10, 2), (view, -1, 1, 1, 1), (view[::2], 0, 1, 1, 1)]:
        with pytest.raises(ValueError, match="outside its"):
            _checksum_rows([bad], cpu)

