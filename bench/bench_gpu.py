"""`llamarl bench gpu`: the Triton kernels and the CUDA copy engine beside the
GPU's own limits, each measured in the same run.

Every figure is one row: `name, value, unit, limit, ratio, target`, its limit
measured in this run (llamarl_core/check/figures.py: the row, and the targets).
Parts (--parts):

  kernels  fp8 quantize: quantize_fp8 (Triton) of a 14336 x 4096 bf16 weight per
           tensor, channel and 128 x 128 block, check=False (kernels only, no host
           sync) and check=True (one host sync that raises on NaN / inf): bytes
           read + written (2 + 1 an element, + scales) per second, beside a copy
           of the same weight timed the same way (do_bench medians, L2 flushed).
           fp8 gemm: the generator's FP8 linear layer (per channel) at 1 and 4096
           tokens beside a bf16 GEMM of the same shapes. aipo: aipo_loss forward
           + backward on 4096 x 128256 bf16 logits (logits read twice, dlogits
           written: 6 bytes an element), and the same for every loss_type
           (batched (32, 128) rows, on-policy), beside a device copy of the same
           bytes (read + write counted), host-timed with a device sync as a
           training step pays it; the naive torch loss beside it.
           linear_aipo_loss (4096 tokens, hidden 4096, vocab 128256, bf16) beside
           its three GEMMs alone.
  sync     `llamarl bench sync --device cuda --transports cuda_ipc --fsdp 1 --tp 1`:
           WeightSender -> WeightReceiver in two processes over CUDA IPC, about 1
           GiB and 8 GiB, from bf16 and from fp32 (cast on the way), beside
           cudaMemcpy of the same bytes (torch's cast of the same values for
           fp32) in one process, with the generator's stall (its receive()); the
           1 GiB model from fp32 into FP8 linear weights (the senders quantize)
           beside the fp32 -> bf16 sync of the same weights.
--device cpu --small runs the same code at tiny shapes on the CPU (the tests use it
to check the rows; its figures mean nothing for a GPU).
"""

from __future__ import annotations

import argparse
import sys

import torch

from llamarl_core.bench import bench_sync
from llamarl_core.bench.harness import add_output_args, emit, record, share_secret, summarize, timed
from llamarl_core.check.figures import figure, rows_table
from llamarl_core.cli import HelpFormatter

# Shapes of each part: on a GPU, sizes that fill it; --small: tiny ones for a CPU run of the same code.
SHAPES = {
    "gpu": {"fp8": (14336, 4096), "gemm_tokens": (1, 4096), "aipo": (4096, 128256), "batched": (32, 128),
            "linear": (4096, 4096, 128256)},
    "small": {"fp8": (256, 512), "gemm_tokens": (1, 64), "aipo": (64, 1000), "batched": (2, 32),
              "linear": (64, 64, 1000)},
}
# The sync's sizes: bench_sync's default model (about 1 GiB in bf16) and an 8B-shaped
# Llama of 19 layers (8.2 GiB in bf16: "8 GiB per GPU"); --small: a tiny Llama.
SYNC_MODELS = {
    "gpu": {"1 GiB": [], "8 GiB": ["--hidden", "4096", "--intermediate", "14336", "--layers", "19", "--heads", "32",
                                   "--kv-heads", "8"]},
    "small": {"tiny": ["--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                        "--vocab", "256"]},
}


def host_timed(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` with the device synchronized around each call (harness.timed)."""
    return summarize(timed(fn, repeats, warmup, cuda=device.type == "cuda"))["median"]


def device_timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` in device time: do_bench (CUDA events, L2 flushed before
    each call) on a GPU; host-timed elsewhere."""
    if device.type != "cuda":
        return host_timed(fn, device, repeats)
    from triton.testing import do_bench

    return do_bench(fn, return_mode="median") / 1e3


def copy_limit(nbytes: int, device: torch.device, timer) -> float:
    """Bytes per second (read + written) of a device copy moving `nbytes` in all:
    nbytes / 2 read and nbytes / 2 written, timed by `timer(fn)`."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / timer(lambda: dst.copy_(src))


def fp8_rows(device: torch.device, shape: tuple[int, int], repeats: int) -> list[dict]:
    from llamarl_core.bench.bench_fp8 import quantize_bytes
    from llamarl_core.ops.fp8 import quantize_fp8

    n, k = shape
    w = (torch.randn(shape, device=device) * 3).to(torch.bfloat16)
    timer = lambda fn: device_timed(fn, device, repeats)  # noqa: E731
    limit = copy_limit(2 * w.nbytes, device, timer)  # a copy of the same weight, read + write
    rows = [figure(f"device copy of a {n}x{k} bf16 weight (the fp8 rows' limit)", limit / 1e9, "GB/s")]
    for granularity in ("tensor", "channel", "block"):
        nbytes = quantize_bytes(shape, torch.bfloat16, granularity)
        for check in (False, True):
            seconds = timer(lambda: quantize_fp8(w, granularity, check=check))
            rows.append(figure(f"fp8 quantize, per {granularity}, check={check}, {n}x{k} bf16",
                               nbytes / seconds / 1e9, "GB/s", limit / 1e9))
    return rows


def fp8_gemm_rows(device: torch.device, shape: tuple[int, int], tokens, repeats: int) -> list[dict]:
    """The generator's FP8 linear layer (Fp8Linear, per-channel scales): the FP8 GEMM
    and the dequantize path, each beside the bf16 GEMM of the same shapes (time)."""
    from llamarl_core.models.llama_generator import Fp8Linear
    from llamarl_core.ops.fp8 import quantize_fp8
    from llamarl_core.ops.fp8_linear import fp8_gemm_refusal

    n, k = shape
    refusal = fp8_gemm_refusal(torch.bfloat16, device, n, k)
    if refusal is not None:
        print(f"fp8 gemm rows skipped: {refusal}", file=sys.stderr)
        return []
    w = torch.randn(shape, device=device).to(torch.bfloat16)
    q, scale = quantize_fp8(w, "channel")
    layers = {}
    for gemm in ("fp8", "dequantize"):
        layer = Fp8Linear(k, n, False, "channel", (n,), torch.bfloat16, device, gemm=gemm)
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(scale)
        layers[gemm] = layer
    rows = []
    with torch.no_grad():
        for m in tokens:
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            bf16_ms = device_timed(lambda: torch.nn.functional.linear(x, w), device, repeats) * 1e3
            for gemm, layer in layers.items():
                ms = device_timed(lambda: layer(x), device, repeats) * 1e3
                rows.append(figure(f"Fp8Linear gemm={gemm}, {m} x {k} x {n}, per channel (limit: the bf16 GEMM)",
                                   ms, "ms", bf16_ms))
    return rows


def aipo_rows(device: torch.device, tokens: int, vocab: int, batched: tuple[int, int], repeats: int) -> list[dict]:
    """aipo_loss forward + backward, then each loss_type on batched rows, beside a
    device copy of the same bytes and (aipo) the naive torch loss."""
    from llamarl_core.ops.aipo import aipo_loss, aipo_loss_ref
    from llamarl_core.ops.objectives import LOSS_TYPES

    timer = lambda fn: host_timed(fn, device, repeats)  # noqa: E731
    gen = torch.Generator(device=device).manual_seed(0)

    def inputs(shape):
        logits = (torch.randn(*shape, vocab, device=device, generator=gen) * 2).to(torch.bfloat16)
        targets = torch.randint(0, vocab, shape, device=device, generator=gen)
        return logits, targets, -torch.rand(shape, device=device, generator=gen) * 9, torch.randn(shape, device=device,
                                                                                                 generator=gen)

    def step(loss, logits, *rest, **kw):
        def call():
            x = logits.detach().requires_grad_()
            out = loss(x, *rest, **kw)
            (out[0] if isinstance(out, tuple) else out).backward()
        return call

    flat = inputs((tokens,))
    nbytes = tokens * vocab * 6
    limit = copy_limit(nbytes, device, timer) / 1e9
    seconds = timer(step(aipo_loss, *flat))
    naive = timer(step(aipo_loss_ref, *flat, compute_dtype=torch.float32))
    rows = [figure(f"device copy of {nbytes / 2**30:.2f} GiB, read + write (the aipo rows' limit)", limit, "GB/s"),
            figure(f"aipo_loss fwd + bwd, {tokens} x {vocab} bf16", nbytes / seconds / 1e9, "GB/s", limit),
            figure("aipo_loss fwd + bwd time beside the naive torch loss (float32 log_softmax, autograd; limit: "
                   "its time)", seconds * 1e3, "ms", naive * 1e3)]
    del flat
    b, t = batched
    nbytes = b * t * vocab * 6
    rows_in = inputs((b, t))
    for loss_type in LOSS_TYPES:
        seconds = timer(step(aipo_loss, *rows_in, loss_type=loss_type))
        rows.append(figure(f"aipo_loss fwd + bwd, loss_type={loss_type}, ({b}, {t}) x {vocab} bf16",
                           nbytes / seconds / 1e9, "GB/s", limit))
    return rows


def linear_aipo_rows(device: torch.device, tokens: int, hidden: int, vocab: int, repeats: int) -> list[dict]:
    """linear_aipo_loss forward + backward (bf16, its default chunking) beside its three
    GEMMs alone on the same shapes, in TFLOP/s (6 x tokens x hidden x vocab)."""
    from llamarl_core.bench.bench_aipo_sweep import linear_rows

    def median_ms(fn):
        return device_timed(fn, device, repeats) * 1e3

    gemms, ours = linear_rows(tokens, hidden, vocab, [None], device, median_ms=median_ms)
    return [figure(f"linear_aipo_loss fwd + bwd, {tokens} tokens, hidden {hidden}, vocab {vocab}, bf16 "
                   "(limit: its three GEMMs alone)", ours["tflops"], "TFLOP/s", gemms["tflops"])]


def sync_rows(device: torch.device, models: dict[str, list[str]], repeats: int) -> list[dict]:
    """`llamarl bench sync` at each size of `models`, from bf16 and from fp32 (the
    cast path), beside its limit in the same run (cudaMemcpy of the same bytes;
    torch's cast of the same values for fp32), with the generator's stall; then
    the first model from fp32 into FP8 linear weights beside the fp32 -> bf16 sync."""
    transport = "cuda_ipc" if device.type == "cuda" else "shm"
    over = "CUDA IPC" if device.type == "cuda" else "shared memory"

    def bench(model, *extra):
        spec = bench_sync.parse_args(["--device", device.type, "--transports", transport, "--fsdp", "1", "--tp", "1",
                                      "--repeats", str(repeats), *extra, *model])
        return bench_sync.run(spec)

    rows, fp32_ms = [], None
    for size, model in models.items():
        for src_dtype in ("bf16", "fp32"):
            result = bench(model, "--src-dtype", src_dtype)
            engine = f"engine_{transport}"
            gib = result["model_bytes"] / 2**30
            peer = ("torch's cast" if src_dtype == "fp32" else "cudaMemcpy") if device.type == "cuda" else "memcpy"
            rows.append(figure(f"weight sync over {over}, {size} ({gib:.2f} GiB), {src_dtype} -> bf16 (limit: {peer} "
                               "of the same bytes, one process)", result["gbps"][engine], "GB/s",
                               result["gbps"]["memcpy"]))
            rows.append(figure(f"generator stall of that sync, {size}, {src_dtype} -> bf16",
                               result["stall_seconds"][engine]["median"] * 1e3, "ms"))
            if fp32_ms is None and src_dtype == "fp32":
                fp32_ms = result["seconds"][engine]["median"] * 1e3
    first = next(iter(models.values()))
    for granularity in ("tensor", "channel", "block"):
        result = bench(first, "--src-dtype", "fp32", "--fp8", granularity)
        ms = result["seconds"][f"engine_{transport}"]["median"] * 1e3
        rows.append(figure(f"FP8 weight sync over {over}, fp32 -> FP8 per {granularity} (senders quantize; limit: the "
                           "fp32 -> bf16 sync of the same weights)", ms, "ms", fp32_ms))
    return rows


def run(spec) -> dict:
    share_secret()
    device = torch.device(spec.device)
    size = "small" if spec.small else "gpu"
    shapes = SHAPES[size]
    rows = []
    if "kernels" in spec.parts:
        rows += fp8_rows(device, shapes["fp8"], spec.repeats)
        rows += fp8_gemm_rows(device, shapes["fp8"], shapes["gemm_tokens"], spec.repeats)
        rows += aipo_rows(device, *shapes["aipo"], shapes["batched"], spec.repeats)
        rows += linear_aipo_rows(device, *shapes["linear"], spec.repeats)
    if "sync" in spec.parts:
        rows += sync_rows(device, SYNC_MODELS[size], spec.repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "rows": rows}


def report(result: dict) -> str:
    return f"{result['device']}.\n\n{rows_table(result['rows'])}\n"


PARTS = ("kernels", "sync")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="llamarl bench gpu", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--repeats", type=int, default=10, help="timed calls of each host-timed step and sync")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: with --small, a run of the code")
    p.add_argument("--small", action="store_true", help="tiny shapes (a check of the code, not a measurement)")
    add_output_args(p)
    spec = p.parse_args(argv)
    parts = [part.strip() for part in spec.parts.split(",") if part.strip()]
    unknown = [part for part in parts if part not in PARTS]
    if unknown or not parts:
        p.error(f"--parts: {', '.join(unknown) or 'nothing given'} is not one of {', '.join(PARTS)}")
    if spec.repeats < 1:
        p.error(f"--repeats must be >= 1, got {spec.repeats}")
    spec.parts = parts
    return spec


def main(argv=None) -> int:
    spec = parse_args(sys.argv[1:] if argv is None else argv)
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("llamarl bench gpu --device cuda needs a CUDA device")
    result = run(spec)
    judged = {r["name"]: r["ratio"] for r in result["rows"] if r["ratio"] is not None}
    record(spec.record, "gpu", judged, {"device": result["device"]},
           "GPU kernels and copy engine (`llamarl bench gpu`)", report(result))
    emit(spec, result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
