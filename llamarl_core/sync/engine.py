"""Execution of copy segments by the native engine (host threads or CUDA stream).

Python resolves every segment to absolute addresses once (a numpy table matching
csrc/copy_segments.h `CopySegment`); each execution is then one native call. On a
GPU a table used more than once is uploaded once (`CudaSegments`): each run is
then one launch of the copy kernel, which copies (and casts) every segment.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Iterable, Mapping

import numpy as np
import torch

from .._native import native, native_cuda
from .errors import SyncError, SyncTimeoutError
from .layout import Layout

KIND_COPY, KIND_F32_TO_BF16 = 0, 1

# A CUDA copy that has not completed after this long is reported, never waited on forever.
DEFAULT_COPY_TIMEOUT_S = 300.0


def default_num_threads() -> int:
    """Copy threads per call: LLAMARL_COPY_THREADS, else every core. On this kind of
    machine one thread copies 10-12 GB/s and two 15-19 GB/s (a 2-core VM, measured)."""
    value = os.environ.get("LLAMARL_COPY_THREADS")
    if value:
        threads = int(value)
        if threads < 1:
            raise ValueError(f"LLAMARL_COPY_THREADS must be >= 1, got {value!r}")
        return threads
    return os.cpu_count() or 1


def segment_table(segments: Iterable, src_base: Callable, dst_base: Callable) -> np.ndarray:
    """(n, 7) int64 table [src, src_pitch, dst, dst_pitch, width, height, kind] with
    absolute addresses `src_base(seg) + seg.src_offset`, `dst_base(seg) + seg.dst_offset`.
    Copy segments count their width in bytes, cast segments in elements."""
    rows = [
        (
            src_base(seg) + seg.src_offset, seg.src_pitch, dst_base(seg) + seg.dst_offset, seg.dst_pitch,
            seg.width if seg.cast else seg.width * seg.itemsize, seg.height,
            KIND_F32_TO_BF16 if seg.cast else KIND_COPY,
        )
        for seg in segments
    ]
    return np.array(rows, dtype=np.int64).reshape(len(rows), 7)


def check_local_tensors(layout: Layout, rank: int, tensors: Mapping[str, torch.Tensor] | None, side: str) -> None:
    """Every local tensor of `rank` (layout.local_tensor_specs) present, with its
    shape and dtype, contiguous, holding its values as bytes (not on the meta
    device, not a lazily negated or conjugated view, whose bytes are not its
    values); no unknown names. Raises ValueError naming it."""
    if tensors is None:
        raise ValueError(f"{side} rank {rank}: no tensors given")
    specs = layout.local_tensor_specs(rank)
    unknown = sorted(set(tensors) - set(specs))
    if unknown:
        raise ValueError(f"{side} rank {rank}: unknown parameter {unknown[0]!r} (not in the layout)")
    for name, (shape, dtype) in specs.items():
        if name not in tensors:
            raise ValueError(f"{side} rank {rank}: missing parameter {name!r}")
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{side} rank {rank}: {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        if tensor.dtype != dtype:
            raise ValueError(f"{side} rank {rank}: {name!r} has dtype {tensor.dtype}, expected {dtype}")
        if not tensor.is_contiguous():
            raise ValueError(f"{side} rank {rank}: {name!r} must be contiguous")
        if tensor.is_meta:
            raise ValueError(f"{side} rank {rank}: {name!r} is on the meta device (it holds no bytes)")
        if tensor.is_neg() or tensor.is_conj():
            raise ValueError(f"{side} rank {rank}: {name!r} is a lazily {'negated' if tensor.is_neg() else 'conjugated'}"
                             " view (its bytes are not its values): pass it resolved (resolve_neg / resolve_conj)")


def check_distinct_memory(tensors: Mapping[str, torch.Tensor], what: str, read_only: frozenset[str] = frozenset(),
                          advice: str = "register each parameter once, in memory of its own") -> None:
    """ValueError naming two tensors whose bytes overlap (one an alias of the
    other, or of a part of it: tied weights registered under two names): a sync
    would write both into the same bytes, or write what it reads. Tensors named
    in `read_only` (what a sync reads from) may share memory with one another,
    never with the others. `advice` ends the message."""
    spans = sorted((str(t.device), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
                   for name, t in tensors.items() if t.numel() and t.is_contiguous())  # others: refused as such
    # The spans reaching furthest so far on this device, of any tensor and of one written: (device, end, name).
    reach = reach_written = None
    for device, start, end, name in spans:
        written = name not in read_only
        before = reach if written else reach_written  # a written span meets any, a read one the written alone
        if before is not None and before[0] == device and start < before[1]:
            effect = "write both into the same bytes" if written and before[2] not in read_only else \
                "write bytes it reads"
            raise ValueError(f"{what}: {before[2]!r} and {name!r} share memory (one is an alias of the other): "
                             f"a sync would {effect}; {advice}")
        if reach is None or reach[0] != device or end > reach[1]:
            reach = (device, end, name)
        if written and (reach_written is None or reach_written[0] != device or end > reach_written[1]):
            reach_written = (device, end, name)


def tensors_device(tensors: Mapping[str, torch.Tensor], what: str) -> torch.device:
    """The one device all tensors live on (cpu when there are none)."""
    devices = {t.device for t in tensors.values() if t.numel()}
    if len(devices) > 1:
        raise ValueError(f"{what}: tensors on several devices {sorted(map(str, devices))}")
    return devices.pop() if devices else torch.device("cpu")


def storage_key(tensor: torch.Tensor) -> tuple:
    """What a segment table baked in about a tensor: its address, the size of its
    storage, shape and dtype. A different key means the table writes or reads
    memory the tensor no longer owns (vLLM's post-processing and weight reloads
    replace `param.data`; FSDP resizes storages to 0)."""
    return (tensor.data_ptr(), tensor.untyped_storage().nbytes(), tuple(tensor.shape), tensor.dtype)


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def table_bytes(table: np.ndarray) -> int:
    """Bytes a segment table writes (a cast segment writes 2 per element)."""
    if len(table) == 0:
        return 0
    unit = np.where(table[:, 6] == KIND_F32_TO_BF16, 2, 1)
    return int((table[:, 4] * table[:, 5] * unit).sum())


class CudaSegments:
    """A segment table resident on one GPU, for copies run many times: split into
    the copy kernel's pieces (csrc/copy_segments.h `CopyPiece`: 64 KiB of
    destination each, more past 4 GiB, aligned for 16-byte accesses where the
    tensors allow) and
    uploaded once, every segment validated first. `launch(stream)` then enqueues
    one kernel that copies every piece: no host synchronisation, no allocation, so
    it can be captured in a CUDA graph. The memory the table addresses must stay
    allocated (and the table alive) until every launch has run. `nbytes`: the
    bytes one run writes."""

    def __init__(self, table: np.ndarray, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"CudaSegments runs on a CUDA device, got {device}")
        self.device, self.index = device, _cuda_index(device)
        self.nbytes = table_bytes(table)
        pieces = _engine_call(native().split_pieces, np.ascontiguousarray(table, dtype=np.int64))
        self.num_pieces = len(pieces)
        self._pieces = torch.from_numpy(pieces).to(torch.device("cuda", self.index))

    def launch(self, stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue the copy on `stream` (default: the current stream), after what is
        queued there already. Outside a graph capture the piece table is recorded on
        `stream`, so the allocator keeps it until the copy has run even if this
        object is dropped first; a captured launch needs this object alive for as
        long as the graph is replayed."""
        stream = torch.cuda.current_stream(self.index) if stream is None else stream
        if not torch.cuda.is_current_stream_capturing():
            self._pieces.record_stream(stream)
        _engine_call(native_cuda().launch_pieces_cuda, self.index, stream.cuda_stream, self._pieces.data_ptr(),
                     self.num_pieces)

    def run(self, timeout_s: float = DEFAULT_COPY_TIMEOUT_S) -> int:
        """Copy once and wait for it: on this thread's copy stream (side_stream), which
        first waits for its current stream (so pending kernels, the optimizer's,
        finish writing the sources), waited for with `timeout_s`. Returns or raises
        only once nothing it queued is running. Returns the bytes written."""
        stream = side_stream(self.index)
        stream.wait_stream(torch.cuda.current_stream(self.index))
        self.launch(stream)
        _engine_call(native_cuda().wait_stream_cuda, self.index, stream.cuda_stream, timeout_s, self.nbytes)
        return self.nbytes


_SIDE_STREAMS = threading.local()


def side_stream(index: int) -> torch.cuda.Stream:
    """This thread's copy stream on GPU `index`, made once: threads that copy at once
    (relays) each have their own, and no copy waits on a stream that another
    thread's kernels keep busy."""
    streams = _SIDE_STREAMS.__dict__.setdefault("by_device", {})
    if index not in streams:
        streams[index] = torch.cuda.Stream(device=index)
    return streams[index]


def prepared_table(table: np.ndarray, device: torch.device) -> np.ndarray | CudaSegments:
    """A table as run_segment_table runs it best when it runs many times: uploaded
    once on a GPU (CudaSegments), the numpy table itself on the host."""
    return CudaSegments(table, device) if device.type == "cuda" else table


def run_segment_table(
    table: np.ndarray | CudaSegments,
    device: torch.device,
    num_threads: int | None = None,
    timeout_s: float = DEFAULT_COPY_TIMEOUT_S,
) -> int:
    """Execute a segment table on `device`'s engine; returns bytes written.

    CPU: memcpy threads. CUDA: a side stream that first waits for the current
    stream (so pending optimizer kernels finish writing the source), then one
    launch of the copy kernel (a numpy table is split and uploaded for the call; a
    CudaSegments was uploaded before), waited for with `timeout_s`. Returns or
    raises only once nothing it queued is running (see execute_segments_cuda).
    Raises SyncTimeoutError past `timeout_s`, SyncError when the engine fails.
    A process's first CUDA call initialises the engine's CUDA runtime, which can
    wait for work already queued on the device (it did on an H100) whatever
    `timeout_s` says.
    """
    if isinstance(table, CudaSegments):
        return table.run(timeout_s)
    if len(table) == 0:
        return 0
    if device.type == "cpu":
        return _engine_call(native().execute_segments_host, table, num_threads or default_num_threads())
    if device.type == "cuda":
        mod = native_cuda()
        index = _cuda_index(device)
        stream = side_stream(index)
        stream.wait_stream(torch.cuda.current_stream(index))
        return _engine_call(mod.execute_segments_cuda, table, index, stream.cuda_stream, timeout_s)
    raise ValueError(f"no copy engine for device {device}")


def _engine_call(fn: Callable, *args):
    """`fn(*args)` with the native engine's errors as the sync's own, so that callers
    catching SyncError (the executors) see them."""
    mod = native()
    try:
        return fn(*args)
    except mod.EngineTimeoutError as exc:
        raise SyncTimeoutError(str(exc)) from exc
    except mod.EngineError as exc:
        raise SyncError(str(exc)) from exc


def wait_for_queued_work(device: torch.device, deadline: float, what: str) -> None:
    """Wait, until `deadline` (time.monotonic), for the kernels queued so far on
    `device`'s current stream: an event recorded there now, polled. Raises
    SyncTimeoutError naming `what`. No-op on CPU, where nothing is queued."""
    if device.type != "cuda":
        return
    index = _cuda_index(device)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(index))
    # Polls 50 us apart, doubling up to 1 ms: a decode step takes 5-50 ms, so the
    # wait overshoots the step's end by at most 1 ms (under 20% of the shortest).
    pause = 50e-6
    while not done.query():
        if time.monotonic() > deadline:
            raise SyncTimeoutError(f"timed out waiting for {what}")
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
