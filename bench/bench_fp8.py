"""`llamarl bench fp8`: FP8 weight quantization throughput.

On the same bf16 weights, in the same run:
  torch copy       w.clone(): read 2 + write 2 bytes per element, the memory limit
  CPU path         quantize_fp8(backend="torch"): chunked, what runs on CPU
  torch reference  quantize_fp8_ref: whole-tensor float32 temporaries
  (--gpu) Triton kernel vs a device-to-device copy of the same tensor
GB/s = bytes / time with bytes = numel * (2 read + 1 written) + 4 * number of scales
(the copy: numel * 4).

--gpu-sweep (a CUDA device): every candidate tiling of ops.fp8_launch.SWEEP_TILINGS per
granularity, unchecked (no host sync), on a 14336 x 4096 and a 4096 x 14336 bf16
weight and a 14336 x 4096 float32 one, beside a device copy of the same weight
in the same run (GB/s: bytes read + written; a float32 weight reads 4 bytes per
element), each output checked bit for bit against quantize_fp8_ref; medians of
triton.testing.do_bench (L2 flushed before each call). The best candidate per
granularity is what GPU_TILINGS should hold.
"""

from __future__ import annotations

import argparse
import sys

import torch

from llamarl_core.bench.harness import add_output_args, emit, record, summarize, table, timed
from llamarl_core.cli import HelpFormatter
from llamarl_core.ops.fp8 import GRANULARITIES, quantize_fp8, quantize_fp8_ref, scale_shape
from llamarl_core.ops.fp8_launch import SWEEP_TILINGS, launch_quantize_fp8

# Llama-3-8B-shaped projections: q/o (4096 x 4096), gate/up (14336 x 4096), down (4096 x 14336).
DEFAULT_SHAPES = ["4096x4096", "14336x4096", "4096x14336"]


# The sweep's weights: Llama-3-8B's gate / up and down projections, and gate / up in float32.
SWEEP_WEIGHTS = [((14336, 4096), torch.bfloat16), ((4096, 14336), torch.bfloat16), ((14336, 4096), torch.float32)]


def quantize_bytes(shape: tuple[int, int], dtype: torch.dtype, granularity: str) -> int:
    """Bytes a quantization moves: w read, one byte a code written, the scales written."""
    n, k = shape
    num_scales = max(1, torch.Size(scale_shape(shape, granularity)).numel())
    return n * k * (torch.empty((), dtype=dtype).element_size() + 1) + 4 * num_scales


def run(spec) -> dict:
    rows = []
    for text in spec.shapes:
        n, k = (int(x) for x in text.split("x"))
        w = torch.randn(n, k).to(torch.bfloat16)
        for granularity in spec.granularities:
            quant_bytes = quantize_bytes((n, k), torch.bfloat16, granularity)
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
                stats = summarize(timed(fn, spec.repeats))
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


def gpu_sweep(granularities=GRANULARITIES, rep_ms: int = 100) -> list[dict]:
    """Time every SWEEP_TILINGS candidate (launch_quantize_fp8: no check, no host
    sync) on SWEEP_WEIGHTS beside a device copy of the same weight; check each
    output bit for bit against the reference. One row per (weight, candidate)."""
    from triton.testing import do_bench

    rows = []
    for (n, k), dtype in SWEEP_WEIGHTS:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)).to(dtype)
        weight = f"{n}x{k} {str(dtype).removeprefix('torch.')}"
        wg, copy = w.cuda(), torch.empty((n, k), dtype=dtype, device="cuda")
        copy_ms = do_bench(lambda: copy.copy_(wg), rep=rep_ms, return_mode="median")
        rows.append({"weight": weight, "granularity": "", "config": "device copy (read + write)", "ms": copy_ms,
                     "gbps": 2 * wg.nbytes / copy_ms / 1e6, "vs_copy": 1.0, "exact": True})
        copy_gbps = rows[-1]["gbps"]
        for granularity in granularities:
            q_ref, scale_ref = quantize_fp8_ref(w, granularity)
            q_ref, scale_ref = q_ref.view(torch.uint8).cuda(), scale_ref.cuda()
            nbytes = quantize_bytes((n, k), dtype, granularity)
            for tiling in SWEEP_TILINGS[granularity]:
                q, scale = launch_quantize_fp8(wg, granularity, tiling=tiling)
                exact = torch.equal(q.view(torch.uint8), q_ref) and torch.equal(scale, scale_ref)
                ms = do_bench(lambda: launch_quantize_fp8(wg, granularity, tiling=tiling), rep=rep_ms,
                              return_mode="median")
                gbps = nbytes / ms / 1e6
                rows.append({"weight": weight, "granularity": granularity, "config": tiling.describe(granularity),
                             "ms": ms, "gbps": gbps, "vs_copy": gbps / copy_gbps, "exact": exact})
            del q_ref, scale_ref
    return rows


def sweep_report(rows: list[dict]) -> str:
    lines = [["weight", "granularity", "config", "us", "GB/s", "x copy", "bits"]]
    for r in rows:
        lines.append([r["weight"], r["granularity"], r["config"], f"{r['ms'] * 1e3:.1f}", f"{r['gbps']:.0f}",
                      f"{r['vs_copy']:.2f}", "exact" if r["exact"] else "DIFFER"])
    return f"{torch.cuda.get_device_name()}: FP8 tilings, unchecked (check=False), do_bench medians.\n\n{table(lines)}\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="llamarl bench fp8", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="NxK weight shapes")
    p.add_argument("--granularities", nargs="+", default=["tensor", "channel", "block"], help="FP8 scale granularities")
    p.add_argument("--repeats", type=int, default=3, help="timed calls of each method")
    p.add_argument("--gpu", action="store_true", help="also time the Triton kernel against a d2d copy")
    p.add_argument("--gpu-sweep", action="store_true",
                   help="time every candidate tiling (ops.fp8_launch.SWEEP_TILINGS) on a CUDA device instead")
    p.add_argument("--sweep-rep-ms", type=int, default=100, help="do_bench time per candidate in the sweep (ms)")
    add_output_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    spec = parse_args(sys.argv[1:] if argv is None else argv)
    if (spec.gpu or spec.gpu_sweep) and not torch.cuda.is_available():
        raise SystemExit(f"{'--gpu-sweep' if spec.gpu_sweep else '--gpu'} needs a CUDA device")
    if spec.gpu_sweep:
        rows = gpu_sweep(spec.granularities, spec.sweep_rep_ms)
        figures = {f"{r['weight']} {r['granularity']} {r['config']}": r["vs_copy"] for r in rows}
        record(spec.record, "fp8_sweep", figures, {"device": torch.cuda.get_device_name()},
               "FP8 tiling sweep (`llamarl bench fp8 --gpu-sweep`)", sweep_report(rows))
        emit(spec, rows, sweep_report(rows))
        return 0 if all(r["exact"] for r in rows) else 1
    result = run(spec)
    figures = {f"{r['shape']}_{r['granularity']}_{r['method'].replace(' ', '_')}_gbps": r["gbps"] for r in result["rows"]}
    record(spec.record, "fp8", figures, {"threads": result["threads"]}, "FP8 weight quantization (`llamarl bench fp8`)",
           report(result))
    emit(spec, result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
