"""`llamarl bench fp8`: FP8 weight quantization throughput.

On the same bf16 weights, in the same run:
  torch copy       w.clone(): read 2 + write 2 bytes per element, the memory limit
  CPU path         quantize_fp8(backend="torch"): chunked, what runs on CPU
  torch reference  quantize_fp8_ref: whole-tensor float32 temporaries
  (--gpu) Triton kernel vs a device-to-device copy of the same tensor
GB/s = bytes / time with bytes = numel * (2 read + 1 written) + 4 * number of scales
(the copy: numel * 4).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from llamarl_core.bench.harness import add_output_args, record, summarize, table
from llamarl_core.cli import HelpFormatter
from llamarl_core.ops.fp8 import quantize_fp8, quantize_fp8_ref, scale_shape

# Llama-3-8B-shaped projections: q/o (4096 x 4096), gate/up (14336 x 4096), down (4096 x 14336).
DEFAULT_SHAPES = ["4096x4096", "14336x4096", "4096x14336"]


def _time(fn, repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return samples


def run(spec) -> dict:
    rows = []
    for text in spec.shapes:
        n, k = (int(x) for x in text.split("x"))
        w = torch.randn(n, k).to(torch.bfloat16)
        for granularity in spec.granularities:
            quant_bytes = n * k * 3 + 4 * max(1, torch.Size(scale_shape((n, k), granularity)).numel())
            methods = {
                "torch copy": (lambda: w.clone(), n * k * 4),
                "CPU path": (lambda: quantize_fp8(w, granularity, backend="torch"), quant_bytes),
                "torch reference": (lambda: quantize_fp8_ref(w, granularity), quant_bytes),
            }
            if spec.gpu:
                wg = w.cuda()
                methods["GPU d2d copy"] = (lambda: wg.clone(), n * k * 4)
                methods["GPU Triton"] = (lambda: quantize_fp8(wg, granularity), quant_bytes)
            for method, (fn, nbytes) in methods.items():
                stats = summarize(_time(fn, spec.repeats))
                rows.append({"shape": text, "granularity": granularity, "method": method, "bytes": nbytes,
                             "seconds": stats, "gbps": nbytes / stats["median"] / 1e9})
    ratios = {}
    for r in rows:
        if r["method"] == "CPU path":
            peers = {p["method"]: p["gbps"] for p in rows if p["shape"] == r["shape"] and p["granularity"] == r["granularity"]}
            key = f"{r['shape']} {r['granularity']}"
            ratios[key] = {"cpu_path_vs_reference": r["gbps"] / peers["torch reference"],
                           "cpu_path_vs_copy": r["gbps"] / peers["torch copy"]}
            if "GPU Triton" in peers:
                ratios[key]["triton_vs_d2d_copy"] = peers["GPU Triton"] / peers["GPU d2d copy"]
    return {"threads": torch.get_num_threads(), "rows": rows, "ratios": ratios}


def report(result: dict) -> str:
    lines = [["shape", "granularity", "method", "GB/s", "median s"]]
    for r in result["rows"]:
        lines.append([r["shape"], r["granularity"], r["method"], f"{r['gbps']:.2f}", f"{r['seconds']['median']:.4f}"])
    ratios = "\n".join(
        f"- {key}: " + ", ".join(f"{name.replace('_', ' ')} {value:.2f}x" for name, value in vals.items())
        for key, vals in result["ratios"].items()
    )
    return f"bf16 weights, {result['threads']} torch threads.\n\n{table(lines)}\n\n{ratios}\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="llamarl bench fp8", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="NxK weight shapes")
    p.add_argument("--granularities", nargs="+", default=["tensor", "channel", "block"], help="FP8 scale granularities")
    p.add_argument("--repeats", type=int, default=3, help="timed calls of each method")
    p.add_argument("--gpu", action="store_true", help="also time the Triton kernel against a d2d copy")
    add_output_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    spec = parse_args(sys.argv[1:] if argv is None else argv)
    if spec.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device")
    result = run(spec)
    figures = {f"{r['shape']}_{r['granularity']}_{r['method'].replace(' ', '_')}_gbps": r["gbps"] for r in result["rows"]}
    record(spec.record, "fp8", figures, {"threads": result["threads"]}, "FP8 weight quantization (`llamarl bench fp8`)",
           report(result))
    print(json.dumps(result, indent=2) if spec.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
