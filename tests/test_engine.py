"""The native copy engine: segments, the fp32 -> bf16 cast, shared memory regions."""

import ctypes
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import stat
import struct

import numpy as np
import pytest
import torch

from llamarl_core._native import native, native_cuda
from llamarl_core.sync import SyncError, SyncTimeoutError
from llamarl_core.sync.engine import KIND_COPY, KIND_F32_TO_BF16, _engine_call, run_segment_table
from helpers import llamarl_shm_entries, run_with_small_dev_shm


def _rect_table(src: torch.Tensor, dst: torch.Tensor, rects, kind: int) -> np.ndarray:
    """Segments copying src[r0:r0+h, c0:c0+w] -> dst[R0:R0+h, C0:C0+w] for each rect."""
    rows = []
    for r0, c0, R0, C0, h, w in rects:
        rows.append((
            src[r0, c0:].data_ptr(), src.stride(0) * src.element_size(),
            dst[R0, C0:].data_ptr(), dst.stride(0) * dst.element_size(),
            w * (src.element_size() if kind == KIND_COPY else 1), h, kind,
        ))
    return np.array(rows, dtype=np.int64)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_strided_copy_matches_torch(num_threads, dtype):
    gen = torch.Generator().manual_seed(num_threads)
    # 1100 x 1031 fp32 is 4.5 MiB: large enough that the engine splits over threads.
    src = (torch.randn(1100, 1031, generator=gen) * 100).to(dtype)
    dst = torch.full((1200, 1100), 77, dtype=dtype)
    expected = dst.clone()
    rects = [(0, 0, 0, 0, 1100, 1031), (5, 7, 1101, 3, 97, 123), (1099, 1030, 1199, 1099, 1, 1)]
    for r0, c0, R0, C0, h, w in rects:
        expected[R0:R0 + h, C0:C0 + w] = src[r0:r0 + h, c0:c0 + w]
    written = native().execute_segments_host(_rect_table(src, dst, rects, KIND_COPY), num_threads)
    assert written == sum(h * w for *_, h, w in rects) * src.element_size()
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


def _special_fp32() -> torch.Tensor:
    """Values where fp32 -> bf16 rounding is delicate, plus random bits."""
    specials = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0,
                3.4028234663852886e38, -3.4028234663852886e38, 1e-45, -1e-45, 1.1754942e-38]
    bits = []
    for base in (0x3F800000, 0x7F7F0000, 0x00010000, 0xBF800000):
        bits += [base | 0x8000, base | 0x7FFF, base | 0x8001, base | 0x18000, base | 0xFFFF]
    gen = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (65536,), generator=gen, dtype=torch.int64)
    midpoints = torch.tensor(bits, dtype=torch.int64)
    all_bits = torch.cat([midpoints, random_bits]).to(torch.int32)
    return torch.cat([torch.tensor(specials, dtype=torch.float32), all_bits.view(torch.float32)])


@pytest.mark.parametrize("num_threads", [1, 2])
def test_cast_fp32_to_bf16_bitwise_equals_torch(num_threads):
    values = _special_fp32()
    n = values.numel() // 16 * 16
    src = values[:n].view(-1, 16).contiguous()
    dst = torch.full(src.shape, float("nan"), dtype=torch.bfloat16)
    table = _rect_table(src, dst, [(0, 0, 0, 0, src.shape[0], 16)], KIND_F32_TO_BF16)
    native().execute_segments_host(table, num_threads)
    expected = src.to(torch.bfloat16)
    # NaN payloads are not a contract: torch's own vectorised and scalar paths give
    # 0xFFFF and 0x7FC0. A NaN must stay a NaN; every other value bit for bit.
    nan = torch.isnan(src)
    assert torch.isnan(dst[nan].float()).all()
    diff = ((dst.view(torch.int16) != expected.view(torch.int16)) & ~nan).nonzero()
    assert len(diff) == 0, f"{len(diff)} values differ, first {src[tuple(diff[0])].item()!r}"
    assert nan.sum() > 100  # the random bits include NaN patterns, so the branch above is exercised


def test_the_cast_is_the_same_bits_at_every_vector_level(simd):
    """The host cast at each vector level the CPU has (host/simd.h: plain, AVX2, ...;
    the `simd` fixture), in rows of 1 to 40 elements from unaligned
    addresses (whole vectors and tails): torch's bf16 for every non-NaN value and
    0x7FC0 for every NaN, bit for bit (copy_segments.h float_to_bf16_rne)."""
    values = _special_fp32()
    expected = values.to(torch.bfloat16).view(torch.int16).clone()
    expected[torch.isnan(values)] = 0x7FC0
    raw = torch.zeros(4 * values.numel() + 4, dtype=torch.uint8)
    raw[1:1 + 4 * values.numel()] = values.view(torch.uint8)  # every row's fp32 one byte off alignment
    out = torch.zeros(2 * values.numel() + 2, dtype=torch.uint8)
    rng = random.Random(5)
    rows, at = [], 0
    while at < values.numel():
        width = min(rng.randint(1, 40), values.numel() - at)
        rows.append((raw.data_ptr() + 1 + 4 * at, 4 * width, out.data_ptr() + 1 + 2 * at, 2 * width, width, 1,
                     KIND_F32_TO_BF16))
        at += width
    native().execute_segments_host(np.array(rows, dtype=np.int64), 1)
    got = out[1:1 + 2 * values.numel()].clone().view(torch.int16)  # off alignment: copied first
    bad = (got != expected).nonzero()
    assert len(bad) == 0, (simd, len(bad), values[bad[0]].item())


def test_cast_of_each_special_value_alone():
    for value in _special_fp32()[:40].tolist():
        bits = torch.tensor([value], dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF
        got = native().float_to_bf16_bits(bits)
        as_bf16 = torch.tensor([got], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        if value != value:
            assert torch.isnan(as_bf16.float()).all()
            continue
        expected = torch.tensor([value], dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF
        assert got == expected, value


@pytest.mark.parametrize("row, message", [
    ((1, 0, 1, 0, -1, 1, KIND_COPY), "negative width"),
    ((1, 0, 1, 0, 1, 1, 5), "unknown kind"),
    ((0, 0, 1, 0, 8, 1, KIND_COPY), "null address"),
    ((1, 4, 1, 4, 8, 2, KIND_COPY), "pitch smaller than a row"),
])
def test_bad_segments_are_refused_before_any_copy(row, message):
    dst = torch.zeros(16, dtype=torch.uint8)
    src_keep = torch.ones(16, dtype=torch.uint8)
    good = (src_keep.data_ptr(), 16, dst.data_ptr(), 16, 16, 1, KIND_COPY)
    table = np.array([good, row], dtype=np.int64)
    with pytest.raises(RuntimeError, match=message):
        native().execute_segments_host(table, 1)
    assert int(dst.sum()) == 0  # the good segment before the bad one did not run either


def _run_pieces_on_host(pieces: np.ndarray) -> None:
    """What the CUDA copy kernel does with a piece table, one piece row at a time
    (copy_segments.h CopyPiece), with the host engine's own rounding for casts."""
    for src, src_pitch, dst, dst_pitch, width, height, kind, _ in pieces.tolist():
        for row in range(height):
            s, d = src + row * src_pitch, dst + row * dst_pitch
            if kind == KIND_COPY:
                ctypes.memmove(d, s, width)
                continue
            bits = np.frombuffer((ctypes.c_uint8 * (4 * width)).from_address(s), dtype=np.uint32)
            out = np.frombuffer((ctypes.c_uint8 * (2 * width)).from_address(d), dtype=np.uint16)
            out[:] = [native().float_to_bf16_bits(int(b)) for b in bits]


def _random_rects(gen: torch.Generator, src_shape, dst_shape, count: int, max_side: int):
    """`count` random rectangles (r0, c0, R0, C0, h, w) inside both shapes, every
    destination element written at most once (rows of the destination never shared)."""
    rects, next_row = [], 0
    for _ in range(count):
        h = int(torch.randint(1, max_side, (1,), generator=gen))
        w = int(torch.randint(1, max_side, (1,), generator=gen))
        if next_row + h > dst_shape[0]:
            break
        r0 = int(torch.randint(0, src_shape[0] - h + 1, (1,), generator=gen))
        c0 = int(torch.randint(0, src_shape[1] - w + 1, (1,), generator=gen))
        C0 = int(torch.randint(0, dst_shape[1] - w + 1, (1,), generator=gen))
        rects.append((r0, c0, next_row, C0, h, w))
        next_row += h
    return rects


@pytest.mark.parametrize("seed", range(6))
def test_pieces_write_exactly_what_the_segments_write(seed):
    """The CUDA copy kernel's pieces, run one by one on the host, leave the
    destination exactly as the host engine does (every byte, casts bit for bit),
    on random rectangles at random alignments; each piece keeps the alignment its
    access width needs and stays within its size."""
    gen = torch.Generator().manual_seed(seed)
    kind = KIND_F32_TO_BF16 if seed % 2 else KIND_COPY
    src_dtype = torch.float32 if kind == KIND_F32_TO_BF16 else [torch.uint8, torch.bfloat16, torch.float32][seed % 3]
    dst_dtype = torch.bfloat16 if kind == KIND_F32_TO_BF16 else src_dtype
    # Wide rows (a contiguous rectangle is one long row, cut into 64 KiB pieces) and narrow ones.
    src = (torch.randn(300, 9000, generator=gen) * 100).to(src_dtype)
    full_rows = [(0, 0, 0, 0, 8, 9000)]  # whole rows of both: merged into one row
    rects = full_rows + _random_rects(gen, (300, 9000), (400, 9000), 40, 200)
    by_engine = torch.full((400, 9000), 7, dtype=dst_dtype)
    by_pieces = by_engine.clone()
    engine_table = _rect_table(src, by_engine, rects, kind)
    native().execute_segments_host(engine_table, 1)
    pieces = native().split_pieces(_rect_table(src, by_pieces, rects, kind))
    _run_pieces_on_host(pieces)
    assert torch.equal(by_pieces.view(torch.uint8), by_engine.view(torch.uint8))
    out_bytes = np.where(pieces[:, 6] == KIND_F32_TO_BF16, 2, 1)
    assert (pieces[:, 4] * pieces[:, 5] * out_bytes).sum() == sum(h * w for *_, h, w in rects) * by_engine.element_size()
    assert (pieces[:, 4] * out_bytes * pieces[:, 5] <= 64 << 10).all()  # every piece within 64 KiB
    for src_at, src_pitch, dst_at, dst_pitch, width, height, piece_kind, vec in pieces.tolist():
        in_bytes, out_unit = (4, 2) if piece_kind == KIND_F32_TO_BF16 else (1, 1)
        assert width % vec == 0
        assert src_at % (vec * in_bytes) == 0 and dst_at % (vec * out_unit) == 0
        if height > 1:
            assert src_pitch % (vec * in_bytes) == 0 and dst_pitch % (vec * out_unit) == 0
    if kind == KIND_COPY and src_dtype != torch.uint8:
        assert (pieces[:, 7] > 1).all()  # element-aligned tensors never fall to byte accesses


def test_pieces_of_a_large_table_stay_few_and_line_aligned():
    """Past 4 GiB a piece grows (at most 65536 per table) by whole 64 KiB: pieces
    of a contiguous run start on 128-byte lines (splitting touches no memory, so
    the addresses need not be real)."""
    total = int(8.2 * 2**30) // 16 * 16
    pieces = native().split_pieces(np.array([(1 << 40, 0, 1 << 41, 0, total, 1, KIND_COPY)], dtype=np.int64))
    assert len(pieces) <= 65536
    assert (pieces[:-1, 4] % (64 << 10) == 0).all() and (pieces[:, 2] % 128 == 0).all()
    assert pieces[:, 4].sum() == total


def test_pieces_refuse_bad_segments_and_misaligned_fp32():
    dst = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="segment 0: null address"):
        native().split_pieces(np.array([(0, 0, dst.data_ptr(), 16, 16, 1, KIND_COPY)], dtype=np.int64))
    src = torch.zeros(64, dtype=torch.uint8)
    misaligned = np.array([(src.data_ptr() + 1, 0, dst.data_ptr(), 0, 4, 1, KIND_F32_TO_BF16)], dtype=np.int64)
    with pytest.raises(RuntimeError, match="needs 4-byte aligned fp32 rows"):
        native().split_pieces(misaligned)
    assert native().split_pieces(np.zeros((0, 7), dtype=np.int64)).shape == (0, 8)


def test_table_shape_is_checked():
    with pytest.raises(RuntimeError, match=r"shape \(n, 7\)"):
        native().execute_segments_host(np.zeros((2, 6), dtype=np.int64), 1)


def _peer_reads(pid: int, fd: int, name: str, nbytes: int, queue) -> None:
    from llamarl_core._native import native as load

    region = load().SharedMemoryRegion.open(pid, fd, name, nbytes)
    view = torch.frombuffer(region, dtype=torch.uint8)
    total = int(view.to(torch.int64).sum())
    view[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)  # written back through the mapping
    del view
    region.close()
    queue.put(total)


def test_shared_memory_region_between_processes():
    region = native().SharedMemoryRegion.create(1 << 20)
    assert region.is_owner and region.nbytes == 1 << 20
    assert region.name.startswith("/llamarl-") and len(region.name.rsplit("-", 1)[1]) == 32
    assert region.name != native().SharedMemoryRegion.create(64).name
    # Unlinked at creation: nothing in /dev/shm, even while it is in use.
    assert region.name.lstrip("/") not in os.listdir("/dev/shm")
    assert stat.S_IMODE(os.fstat(region.fd).st_mode) == 0o600
    view = torch.frombuffer(region, dtype=torch.uint8)
    view.copy_(torch.arange(1 << 20, dtype=torch.int64).remainder(251).to(torch.uint8))
    expected_total = int(view.to(torch.int64).sum())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peer_reads, args=(os.getpid(), region.fd, region.name, region.nbytes, queue))
    proc.start()
    total = queue.get(timeout=60)
    proc.join(timeout=30)
    assert total == expected_total
    assert view[:4].tolist() == [1, 2, 3, 4]
    assert proc.exitcode == 0


def test_open_refuses_a_wrong_name_or_size():
    region = native().SharedMemoryRegion.create(4096)
    with pytest.raises(RuntimeError, match="expected"):
        native().SharedMemoryRegion.open(os.getpid(), region.fd, "/llamarl-not-this-one", 4096)
    with pytest.raises(RuntimeError, match="expected 8192"):
        native().SharedMemoryRegion.open(os.getpid(), region.fd, region.name, 8192)
    with pytest.raises(RuntimeError, match="cannot read"):
        native().SharedMemoryRegion.open(2**22 + 12345, 3, region.name, 4096)
    assert llamarl_shm_entries() == []


_REGION_ON_SMALL_DEV_SHM = """
import json, os, torch
from llamarl_core._native import native
out = {}
try:
    region = native().SharedMemoryRegion.create(8 << 20)
    torch.frombuffer(region, dtype=torch.uint8).fill_(1)  # what a sender does next (SIGBUS before the fix)
    out["created"] = region.nbytes
except native().EngineError as exc:
    out["error"] = str(exc)
fs = os.statvfs("/dev/shm")
out["free_after"] = fs.f_bavail * fs.f_frsize
small = native().SharedMemoryRegion.create(512 << 10)  # what fits still works
out["small_sum"] = int(torch.frombuffer(small, dtype=torch.uint8).fill_(3).to(torch.int64).sum())
print(json.dumps(out))
"""


def test_region_larger_than_dev_shm_raises_naming_needed_and_free_bytes():
    """An 8 MiB region on a 1 MiB /dev/shm: a clean EngineError at creation, nothing
    left allocated; before posix_fallocate the region was created and the first
    write killed the process with SIGBUS."""
    proc = run_with_small_dev_shm(_REGION_ON_SMALL_DEV_SHM, "1M")
    assert proc.returncode == 0, (
        f"child exited with {proc.returncode} ({-signal.SIGBUS} is SIGBUS): {proc.stderr[-2000:]}"
    )
    out = json.loads(proc.stdout)
    assert "created" not in out, out
    assert re.search(r"needs 8388608 bytes, /dev/shm has 1048576 bytes free", out["error"]), out["error"]
    assert "--shm-size" in out["error"] and "p2p" in out["error"]
    assert out["free_after"] == 1 << 20  # the failed allocation left nothing behind
    assert out["small_sum"] == 3 * (512 << 10)


def test_cuda_backend_is_built_and_fails_clearly_without_a_device():
    mod = native()
    if shutil.which("nvcc") and os.environ.get("LLAMARL_SKIP_CUDA", "0") in ("", "0"):
        assert mod.built_with_cuda, "nvcc is on PATH but the CUDA sources were not built"
    elif not mod.built_with_cuda:
        with pytest.raises(RuntimeError, match="built without its CUDA backend"):
            native_cuda()
        return
    if torch.cuda.is_available():
        pytest.skip("a device is present")
    assert mod.cuda_device_count() == 0
    with pytest.raises(RuntimeError, match="no CUDA device"):
        native_cuda()
    with pytest.raises(RuntimeError, match="no CUDA device"):
        mod.cuda_device_uuid(0)


def test_run_segment_table_refuses_unknown_devices():
    with pytest.raises(ValueError, match="no copy engine"):
        run_segment_table(np.zeros((1, 7), dtype=np.int64), torch.device("meta"))


def test_engine_errors_reach_callers_as_sync_errors():
    """The executors catch SyncError: a failing copy must be one, a late one a SyncTimeoutError."""
    dst = torch.zeros(16, dtype=torch.uint8)
    bad = np.array([(0, 0, dst.data_ptr(), 16, 16, 1, KIND_COPY)], dtype=np.int64)
    with pytest.raises(SyncError, match="segment 0: null address") as raised:
        run_segment_table(bad, torch.device("cpu"), 1)
    assert not isinstance(raised.value, SyncTimeoutError)
    assert isinstance(raised.value.__cause__, native().EngineError)
    assert issubclass(native().EngineTimeoutError, native().EngineError)

    def late():
        raise native().EngineTimeoutError("CUDA copy of 8 bytes on device 0 did not complete within 0.1 s")

    with pytest.raises(SyncTimeoutError, match="did not complete within 0.1 s"):
        _engine_call(late)


# What `CMAKE_CUDA_ARCHITECTURES` defaults to (A100, A10, L40S, H100, B200): machine code for each.
DEFAULT_CUDA_ARCHS = (80, 86, 89, 90, 100)


def _fatbin_entries(path: str) -> list[tuple[int, int, bytes]]:
    """(kind, sm, payload) of each image in the module's .nv_fatbin section: kind 1
    is PTX, 2 is a cubin (the fatbin layout cuobjdump reads; headers are little-endian)."""
    data = open(path, "rb").read()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]
    entries = []
    for name_off, _, _, _, offset, size in sections:
        name = data[names_at + name_off : data.index(b"\0", names_at + name_off)]
        if name != b".nv_fatbin":
            continue
        pos, end = offset, offset + size
        while pos + 16 <= end:
            magic, _, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
            assert magic == 0xBA55ED50, hex(magic)
            entry = pos + header_size
            while entry < pos + header_size + fat_size:
                kind, _, entry_header, payload_size, _, _, _, _, sm = struct.unpack_from("<HHIQIIHHI", data, entry)
                entries.append((kind, sm, data[entry + entry_header : entry + entry_header + payload_size]))
                entry += entry_header + payload_size
            pos = -(-(pos + header_size + fat_size) // 8) * 8
    return entries


def test_cuda_build_holds_the_copy_kernel_for_every_default_architecture():
    mod = native()
    if not mod.built_with_cuda:
        pytest.skip("built without the CUDA backend")
    if "CUDAARCHS" in os.environ:
        pytest.skip(f"built for CUDAARCHS={os.environ['CUDAARCHS']}")
    entries = _fatbin_entries(mod.__file__)
    cubins = {sm for kind, sm, payload in entries if kind == 2 and b"copy_pieces_kernel" in payload}
    assert cubins == set(DEFAULT_CUDA_ARCHS), sorted(cubins)
    assert {sm for kind, sm, _ in entries if kind == 1} == {max(DEFAULT_CUDA_ARCHS)}  # PTX for newer GPUs
