"""`llamarl bench gpu`: the Triton kernels and the CUDA copy engine beside the
GPU's own copy bandwidth and the naive torch ops, measured in one run.

  copy           a 1 GiB device-to-device copy (torch copy_, cudaMemcpy): the
                 limit. GB/s counts bytes read + written.
  fp8 quantize   quantize_fp8 (Triton) of a 14336 x 4096 bf16 weight per tensor,
                 channel and 128 x 128 block: 2 bytes read + 1 written per
                 element (+ scales); check=False (kernels only, no host sync)
                 and the default check=True (one host sync that raises on NaN /
                 inf), in device time (triton.testing.do_bench medians, L2
                 flushed before each call); beside a copy of the same weight
                 timed the same way.
  fp8 gemm       the generator's FP8 linear layer (14336 x 4096, per channel)
                 at 1, 16, 256 and 4096 tokens: its FP8 GEMM and its dequantize
                 path beside a bf16 GEMM of the same shapes ("x limit": the bf16
                 time over theirs; GB/s: the weight's bytes over the time).
  aipo           aipo_loss forward + backward on bf16 logits (4096 tokens x vocab
                 128256): logits read twice, dlogits written once (6 bytes per
                 element); beside the naive torch loss (float32 log_softmax +
                 gather + autograd) on the same logits: time and peak memory;
                 then each log-prob kernel alone (`python -m
                 llamarl_core.bench.bench_aipo --gpu-sweep` times every
                 candidate config); linear_aipo_loss (4096 tokens, hidden
                 4096, vocab 128256, bf16) beside its three GEMMs alone.
  weight sync    `llamarl bench sync --device cuda`: WeightSender -> WeightReceiver
                 in two processes on GPU 0 over CUDA IPC, about 1 GiB and 8 GiB,
                 from bf16 and from fp32 (cast on the way), beside cudaMemcpy of
                 the same bytes (torch's cast of the same values for fp32) in one
                 process, with the generator's stall (its receive()); then the 1
                 GiB model from fp32 into FP8 linear weights (--fp8), GB/s over
                 the bytes it reads and writes, beside cudaMemcpy's bandwidth over
                 the same bytes.
Times are medians of CUDA-synchronized repeats after a warm-up (fp8: do_bench).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from llamarl_core.bench import bench_sync
from llamarl_core.bench.harness import add_output_args, record, share_secret, summarize, table
from llamarl_core.cli import HelpFormatter


def _time_cuda(fn, repeats: int, warmup: int = 2) -> dict:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return summarize(samples)


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _time_cuda(lambda: dst.copy_(src), repeats)["median"]


def fp8_rows(copy_bps: float, shape=(14336, 4096)) -> list[dict]:
    from triton.testing import do_bench

    from llamarl_core.bench.bench_fp8 import quantize_bytes
    from llamarl_core.ops.fp8 import quantize_fp8

    n, k = shape
    w = torch.randn(shape, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(w)
    copy_s = do_bench(lambda: dst.copy_(w), return_mode="median") / 1e3
    # The limit: a copy of the same weight timed the same way (do_bench: device time,
    # L2 flushed before each call), its bytes read + written.
    weight_copy_bps = 2 * w.nbytes / copy_s
    rows = [{"what": f"device copy of the same {n}x{k} bf16 weight (read + write; the FP8 rows' limit)",
             "seconds": copy_s, "gbps": weight_copy_bps / 1e9, "vs_copy": weight_copy_bps / copy_bps}]
    for granularity in ("tensor", "channel", "block"):
        nbytes = quantize_bytes(shape, torch.bfloat16, granularity)
        for check in (False, True):
            seconds = do_bench(lambda: quantize_fp8(w, granularity, check=check), return_mode="median") / 1e3
            how = "check=True (one host sync)" if check else "check=False (no host sync)"
            rows.append({"what": f"fp8 quantize {n}x{k} bf16, {granularity}, {how}", "seconds": seconds,
                         "gbps": nbytes / seconds / 1e9, "vs_copy": nbytes / seconds / weight_copy_bps})
    return rows


def fp8_gemm_rows(shape=(14336, 4096), tokens=(1, 16, 256, 4096)) -> list[dict]:
    """The generator's FP8 linear layer (Fp8Linear, per-channel scales) on a
    14336 x 4096 weight at decode and prefill sizes: the FP8 GEMM (fp8_linear:
    per-token activation quantization + torch._scaled_mm) and the dequantize
    path, each beside the bf16 GEMM of the same shapes (the peer: "x limit" is
    its time over theirs). GB/s: the weight's bytes read per second (1 a weight
    in FP8, 2 in bf16), which bounds a decode step."""
    from triton.testing import do_bench

    from llamarl_core.models.llama_generator import Fp8Linear
    from llamarl_core.ops.fp8 import quantize_fp8
    from llamarl_core.ops.fp8_linear import fp8_gemm_refusal

    n, k = shape
    refusal = fp8_gemm_refusal(torch.bfloat16, torch.device("cuda"), n, k)
    if refusal is not None:
        print(f"fp8 gemm rows skipped: {refusal}", file=sys.stderr)
        return []
    w = torch.randn(shape, device="cuda").to(torch.bfloat16)
    q, scale = quantize_fp8(w, "channel")
    layers = {}
    for gemm in ("fp8", "dequantize"):
        layer = Fp8Linear(k, n, False, "channel", (n,), torch.bfloat16, "cuda", gemm=gemm)
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(scale)
        layers[gemm] = layer
    rows = []
    with torch.no_grad():
        for m in tokens:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            bf16_s = do_bench(lambda: torch.nn.functional.linear(x, w), return_mode="median") / 1e3
            rows.append({"what": f"bf16 GEMM {m} x {k} x {n} (the FP8 rows' peer)", "seconds": bf16_s,
                         "gbps": w.nbytes / bf16_s / 1e9, "vs_copy": 1.0})
            for gemm, layer in layers.items():
                seconds = do_bench(lambda: layer(x), return_mode="median") / 1e3
                rows.append({"what": f"Fp8Linear gemm={gemm}, same shapes, per channel", "seconds": seconds,
                             "gbps": q.nbytes / seconds / 1e9, "vs_copy": bf16_s / seconds,
                             "limit": "the bf16 GEMM's speed"})
    return rows


def aipo_rows(copy_bps: float, repeats: int, tokens: int = 4096, vocab: int = 128256) -> list[dict]:
    from llamarl_core.ops.aipo import aipo_loss, aipo_loss_ref
    from llamarl_core.ops.logprob_launch import logprob_backward, logprob_forward

    logits = (torch.randn(tokens, vocab, device="cuda") * 2).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), device="cuda")
    behavior, advantages = -torch.rand(tokens, device="cuda") * 9, torch.randn(tokens, device="cuda")

    def fused():
        x = logits.detach().requires_grad_()
        aipo_loss(x, targets, behavior, advantages)[0].backward()

    def naive():
        x = logits.detach().requires_grad_()
        aipo_loss_ref(x, targets, behavior, advantages, compute_dtype=torch.float32).backward()

    rows, results = [], {}
    for name, fn in (("fused", fused), ("naive", naive)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        stats = _time_cuda(fn, repeats)
        results[name] = (stats["median"], (torch.cuda.max_memory_allocated() - base) / 2**20)
    nbytes = tokens * vocab * 6
    (fused_s, fused_mib), (naive_s, naive_mib) = results["fused"], results["naive"]
    rows.append({"what": f"aipo_loss fwd + bwd, {tokens} x {vocab} bf16", "seconds": fused_s,
                 "gbps": nbytes / fused_s / 1e9, "vs_copy": nbytes / fused_s / copy_bps,
                 "peak_mib": fused_mib, "vs_naive": naive_s / fused_s})
    rows.append({"what": "naive torch loss (float32 log_softmax, autograd), same logits", "seconds": naive_s,
                 "gbps": nbytes / naive_s / 1e9, "vs_copy": nbytes / naive_s / copy_bps, "peak_mib": naive_mib})
    # Each log-prob kernel alone (the default configs): the forward reads the logits
    # (2 bytes an element), the backward reads them and writes dlogits (4).
    lse = logprob_forward(logits, targets, 1.0, False)[0]
    coef = torch.randn(tokens, device="cuda") / tokens
    for name, fn, moved in (("forward", lambda: logprob_forward(logits, targets, 1.0, False), nbytes / 3),
                            ("backward", lambda: logprob_backward(logits, targets, lse, coef, 1.0), 2 * nbytes / 3)):
        seconds = _time_cuda(fn, repeats)["median"]
        rows.append({"what": f"log-prob {name} kernel alone, same logits", "seconds": seconds,
                     "gbps": moved / seconds / 1e9, "vs_copy": moved / seconds / copy_bps})
    return rows


def linear_aipo_rows(tokens: int = 4096, hidden: int = 4096, vocab: int = 128256) -> list[dict]:
    """linear_aipo_loss forward + backward (bf16, its default chunking: one chunk at
    these sizes, 1.05e9 bytes of logits under the 1 GiB default; more tokens take
    the float32 accumulator, RESULTS.md) beside its three GEMMs alone on the same
    shapes: "x limit" is the GEMMs' time over its own."""
    from llamarl_core.bench.bench_aipo import linear_rows

    gemms, ours = linear_rows(tokens, hidden, vocab, [None], torch.device("cuda"))
    flops = 6 * tokens * hidden * vocab
    return [{"what": f"linear_aipo_loss fwd + bwd, {tokens} tokens, hidden {hidden}, vocab {vocab}, bf16, one chunk "
                     "(vs its GEMMs)",
             "seconds": ours["ms"] / 1e3, "gbps": flops / ours["ms"] / 1e9, "unit": "TFLOP/s",
             "vs_copy": gemms["ms"] / ours["ms"], "peak_mib": ours["peak_mib"]},
            {"what": "its three GEMMs alone (the limit)", "seconds": gemms["ms"] / 1e3, "gbps": flops / gemms["ms"] / 1e9,
             "unit": "TFLOP/s", "vs_copy": 1.0}]


# The sync's sizes: the default bench model (about 1 GiB in bf16) and an 8B-shaped
# Llama of 19 layers (8.2 GiB in bf16: "8 GiB per GPU").
SYNC_MODELS = {"1 GiB": [], "8 GiB": ["--hidden", "4096", "--intermediate", "14336", "--layers", "19", "--heads", "32",
                                      "--kv-heads", "8"]}


def sync_rows(repeats: int) -> list[dict]:
    """`llamarl bench sync --device cuda --transports cuda_ipc --fsdp 1 --tp 1` at each
    size of SYNC_MODELS, from a bf16 and from an fp32 trainer (the cast path), each
    beside its limit in the same run: cudaMemcpy of the same bytes (bf16), torch's
    cast of the same values (fp32); with the generator's stall (its receive())."""
    rows = []
    for size, model in SYNC_MODELS.items():
        for src_dtype in ("bf16", "fp32"):
            spec = bench_sync.parse_args(["--device", "cuda", "--transports", "cuda_ipc", "--fsdp", "1", "--tp", "1",
                                          "--src-dtype", src_dtype, "--repeats", str(repeats), *model])
            result = bench_sync.run(spec)
            engine, limit = result["gbps"]["engine_cuda_ipc"], result["gbps"]["memcpy"]
            gib = result["model_bytes"] / 2**30
            limit_name = "torch cast fp32 -> bf16 of the same values" if src_dtype == "fp32" else "cudaMemcpy of the same bytes"
            rows.append({"what": f"weight sync over CUDA IPC, {gib:.1f} GiB, {src_dtype} -> bf16",
                         "seconds": result["seconds"]["engine_cuda_ipc"]["median"], "gbps": engine,
                         "vs_copy": engine / limit,
                         "stall_s": result["stall_seconds"]["engine_cuda_ipc"]["median"]})
            rows.append({"what": f"{limit_name}, one process ({gib:.1f} GiB; the limit)",
                         "seconds": result["seconds"]["memcpy"]["median"], "gbps": limit, "vs_copy": 1.0})
    return rows + fp8_sync_rows(repeats)


def fp8_sync_rows(repeats: int) -> list[dict]:
    """The 1 GiB model from an fp32 trainer into a generator holding its linear
    weights in FP8 (each granularity; the senders quantize, kernels/fp8_sync.py),
    beside cudaMemcpy's bandwidth over the bytes such a sync reads and writes."""
    rows = []
    for granularity in ("tensor", "channel", "block"):
        spec = bench_sync.parse_args(["--device", "cuda", "--transports", "cuda_ipc", "--fsdp", "1", "--tp", "1",
                                      "--src-dtype", "fp32", "--fp8", granularity, "--repeats", str(repeats),
                                      *SYNC_MODELS["1 GiB"]])
        result = bench_sync.run(spec)
        seconds, limit = result["seconds"]["engine_cuda_ipc"]["median"], result["seconds"]["memcpy"]["median"]
        traffic = bench_sync.fp8_sync_traffic(spec, bench_sync.model_config(spec))
        rows.append({"what": f"FP8 weight sync over CUDA IPC, {result['model_bytes'] / 2**30:.1f} GiB bf16-equivalent, "
                             f"fp32 -> FP8 {granularity} (senders quantize)",
                     "seconds": seconds, "gbps": traffic / seconds / 1e9, "vs_copy": limit / seconds,
                     "stall_s": result["stall_seconds"]["engine_cuda_ipc"]["median"]})
    return rows


def run(spec) -> dict:
    share_secret()
    copy_bps = copy_bandwidth(1 << 30, spec.repeats)
    rows = [{"what": "device-to-device copy, 1 GiB (read + write)", "seconds": None, "gbps": copy_bps / 1e9,
             "vs_copy": 1.0}]
    rows += fp8_rows(copy_bps)
    rows += fp8_gemm_rows()
    rows += aipo_rows(copy_bps, spec.repeats)
    rows += linear_aipo_rows()
    if not spec.no_sync:
        rows += sync_rows(spec.repeats)
    return {"device": torch.cuda.get_device_name(), "rows": rows}


def report(result: dict) -> str:
    lines = [["what", "GB/s", "x limit", "median ms", "stall ms", "peak MiB", "x naive"]]
    for r in result["rows"]:
        lines.append([r["what"], f"{r['gbps']:.0f}" + (f" {r['unit']}" if "unit" in r else ""), f"{r['vs_copy']:.2f}",
                      "" if r["seconds"] is None else f"{r['seconds'] * 1e3:.2f}",
                      f"{r['stall_s'] * 1e3:.2f}" if "stall_s" in r else "",
                      f"{r['peak_mib']:.0f}" if "peak_mib" in r else "", f"{r['vs_naive']:.2f}" if "vs_naive" in r else ""])
    return f"{result['device']}.\n\n{table(lines)}\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="llamarl bench gpu", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--repeats", type=int, default=10, help="timed calls of each kernel and copy")
    p.add_argument("--no-sync", action="store_true", help="skip the weight sync between processes")
    add_output_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    spec = parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        raise SystemExit("llamarl bench gpu needs a CUDA device")
    result = run(spec)
    record(spec.record, "gpu", {r["what"]: r["vs_copy"] for r in result["rows"]}, {"device": result["device"]},
           "GPU kernels and copy engine (`llamarl bench gpu`)", report(result))
    print(json.dumps(result, indent=2) if spec.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
