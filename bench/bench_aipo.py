"""`llamarl bench aipo`: peak memory and time of the AIPO loss, forward + backward.

Same inputs, same run, each variant in its own process (so its peak is its own),
num_tokens 4096, vocab 32000 and 128256, hidden 2048 for the linear variants:
  aipo_loss          llamarl, from logits (the CPU path here)
  naive_logits       log_softmax + gather + autograd on the same logits (float32)
  linear_aipo_loss   llamarl, from hidden states and the lm-head weight, chunked
  naive_linear       hidden @ weight.T, then the naive loss, autograd
  liger_grpo         Liger-Kernel's chunked LigerFusedLinearGRPOLoss (if installed:
                     pip install liger-kernel), beta 0, the peer users would pick
With --gpu-sweep (a CUDA device; `python -m llamarl_core.bench.bench_aipo
--gpu-sweep`): each candidate config of the log-prob kernels (BLOCK_V, warps,
rows per program, 1-D or 2-D backward grid), forward and backward timed alone
on bf16 logits (4096 x 128256, 16384 x 32000) beside a copy of the same bytes,
aipo_loss forward + backward at the defaults, and linear_aipo_loss (4096 tokens,
hidden 4096, vocab 128256, bf16) by chunk size beside its three GEMMs alone.
Medians of triton.testing.do_bench (CUDA events).

Peak memory: resident set size sampled every millisecond during the timed call,
minus the RSS just before it (inputs already allocated), with
MALLOC_MMAP_THRESHOLD_=65536 so freed tensors go back to the OS. Every method
must also return the weight's gradient (vocab x hidden float32: 1 GiB at vocab
128256), which is included; `working` subtracts the gradients it returns.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import torch

from llamarl_core.bench.harness import add_output_args, record, summarize, table
from llamarl_core.cli import HelpFormatter

VARIANTS = ["aipo_loss", "naive_logits", "linear_aipo_loss", "naive_linear", "liger_grpo"]
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """Samples this process's RSS every millisecond while active."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _inputs(tokens: int, vocab: int, hidden: int, linear: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    data = {
        "targets": torch.randint(0, vocab, (tokens,), generator=gen),
        "behavior": -torch.rand(tokens, generator=gen) * 5,
        "advantages": torch.randn(tokens, generator=gen),
        "mask": (torch.rand(tokens, generator=gen) > 0.1).float(),
    }
    if linear:
        data["hidden"] = torch.randn(tokens, hidden, generator=gen) / hidden**0.25
        data["weight"] = torch.randn(vocab, hidden, generator=gen) / hidden**0.25
    else:
        data["logits"] = torch.randn(tokens, vocab, generator=gen) * 2
    return data


def _step(variant: str, d: dict):
    """One forward + backward; returns the gradients the method produced."""
    from llamarl_core.ops.aipo import aipo_loss, aipo_loss_ref, linear_aipo_loss

    common = (d["targets"], d["behavior"], d["advantages"], d["mask"])
    if variant in ("aipo_loss", "naive_logits"):
        x = d["logits"].requires_grad_()
        loss = aipo_loss(x, *common)[0] if variant == "aipo_loss" else aipo_loss_ref(x, *common, compute_dtype=None)
        loss.backward()
        grads = [x.grad]
        x.grad = None
        return grads
    h, w = d["hidden"].requires_grad_(), d["weight"].requires_grad_()
    if variant == "linear_aipo_loss":
        loss = linear_aipo_loss(h, w, *common)[0]
    elif variant == "naive_linear":
        loss = aipo_loss_ref(h @ w.t(), *common, compute_dtype=None)
    else:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="grpo")
        loss = loss_fn(h.unsqueeze(0), w, d["targets"].unsqueeze(0), d["mask"].unsqueeze(0), d["advantages"][:1],
                       old_per_token_logps=d["behavior"].unsqueeze(0))[0]
    loss.backward()
    grads = [h.grad, w.grad]
    h.grad = w.grad = None
    return grads


def worker(variant: str, tokens: int, vocab: int, hidden: int, repeats: int) -> dict:
    torch.set_num_threads(os.cpu_count() or 1)
    linear = variant not in ("aipo_loss", "naive_logits")
    data = _inputs(tokens, vocab, hidden, linear)
    del _step(variant, data)[:]  # warm-up (first-call allocations, Liger's compilation)
    times, peaks, working = [], [], []
    for _ in range(repeats):
        with PeakRSS() as rss:
            start = time.perf_counter()
            grads = _step(variant, data)
            times.append(time.perf_counter() - start)
        grad_bytes = sum(g.numel() * g.element_size() for g in grads)
        peaks.append(rss.peak - rss.base)
        working.append(rss.peak - rss.base - grad_bytes)
        del grads
    return {"variant": variant, "vocab": vocab, "tokens": tokens, "hidden": hidden if linear else None,
            "seconds": summarize(times), "peak_bytes": max(peaks), "working_bytes": max(working)}


def _available(variant: str) -> bool:
    if variant != "liger_grpo":
        return True
    try:
        import liger_kernel.chunked_loss  # noqa: F401
    except ImportError:
        return False
    return True


def run(spec) -> dict:
    rows, skipped = [], []
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    env.pop("TRITON_INTERPRET", None)  # the CPU path, not the interpreter
    for vocab in spec.vocabs:
        for variant in spec.variants:
            if not _available(variant):
                skipped.append(variant)
                continue
            cmd = [sys.executable, "-m", "llamarl_core.bench.bench_aipo", "--worker", variant, "--tokens",
                   str(spec.tokens), "--vocabs", str(vocab), "--hidden", str(spec.hidden), "--repeats", str(spec.repeats)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
            if out.returncode != 0:
                raise RuntimeError(f"{variant} at vocab {vocab} failed:\n{out.stderr[-3000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    ratios = {}
    for vocab in spec.vocabs:
        by = {r["variant"]: r for r in rows if r["vocab"] == vocab}
        for ours, naive in (("aipo_loss", "naive_logits"), ("linear_aipo_loss", "naive_linear"), ("linear_aipo_loss", "liger_grpo")):
            if ours in by and naive in by:
                a, b = by[ours], by[naive]
                ratios[f"{ours} vs {naive} @ {vocab}"] = {
                    "time": a["seconds"]["median"] / b["seconds"]["median"],
                    "peak": a["peak_bytes"] / b["peak_bytes"],
                    "working": a["working_bytes"] / max(b["working_bytes"], 1),
                }
    return {"rows": rows, "ratios": ratios, "skipped": sorted(set(skipped)), "threads": os.cpu_count()}


def report(result: dict) -> str:
    lines = [["variant", "vocab", "median s", "peak MiB", "working MiB"]]
    for r in result["rows"]:
        lines.append([r["variant"], str(r["vocab"]), f"{r['seconds']['median']:.2f}", f"{r['peak_bytes'] / 2**20:.0f}",
                      f"{r['working_bytes'] / 2**20:.0f}"])
    ratios = "\n".join(f"- {k}: time {v['time']:.2f}x, peak memory {v['peak']:.3f}x, working memory {v['working']:.3f}x"
                       for k, v in result["ratios"].items())
    skipped = f"\nskipped (not installed): {', '.join(result['skipped'])}\n" if result["skipped"] else ""
    return f"Forward + backward, {result['rows'][0]['tokens']} tokens, {result['threads']} threads.\n\n{table(lines)}\n\n{ratios}\n{skipped}"


# ----------------------------------------------------------------------------- GPU sweep (--gpu-sweep)

# The log-prob kernels are timed on bf16 logits of these (tokens, vocab);
# linear_aipo_loss beside its three GEMMs at (tokens, hidden, vocab), bf16, for
# each chunk size (MiB of logits per chunk; 1024 MiB holds the whole batch).
SWEEP_SHAPES = ((4096, 128256), (16384, 32000))
SWEEP_LINEAR = (4096, 4096, 128256)
SWEEP_CHUNK_MIB = (128, 256, 512, 1024)
# (block_v, rows, num_warps) candidates: 4 to 32 values a thread, one row or a few;
# the backward's also with a 2-D grid (vocabulary split until there are this many
# programs). They include the GPU_CONFIGS defaults for large vocabularies.
_SWEEP_LAUNCHES = ((1024, 1, 4), (2048, 1, 4), (2048, 1, 8), (4096, 1, 4), (4096, 1, 8), (4096, 1, 16),
                   (8192, 1, 8), (8192, 1, 16), (1024, 4, 4), (2048, 2, 8), (2048, 4, 8))
_SWEEP_MIN_PROGRAMS = (0, 8192, 32768)


def sweep_configs() -> tuple[list, list]:
    """(forward candidates, backward candidates), LogprobConfigs."""
    from llamarl_core.ops.logprob_launch import LogprobConfig

    return ([LogprobConfig(b, r, w) for b, r, w in _SWEEP_LAUNCHES],
            [LogprobConfig(b, r, w, p) for b, r, w in _SWEEP_LAUNCHES for p in _SWEEP_MIN_PROGRAMS])


def sweep_variants() -> list:
    """Each candidate's forward and backward launch on small CPU bf16 tensors standing
    in for CUDA ones, for llamarl_core.ops.kernel_check (tests/test_aipo.py
    compiles them for sm_90). The backward's grid does not change what compiles."""
    from llamarl_core.ops.logprob_launch import logprob_launches

    logits = torch.empty((4, SWEEP_SHAPES[0][1]), dtype=torch.bfloat16)
    targets = torch.empty(4, dtype=torch.int64)
    lse, logp, coef = (torch.empty(4, dtype=torch.float32) for _ in range(3))
    variants = []
    for config in sweep_configs()[0]:
        fwd, bwd = logprob_launches(logits, targets, lse, logp, None, coef, torch.empty_like(logits), 0.7, config,
                                    config)
        tag = f"BLOCK_V {config.block_v}, {config.rows} rows, {config.num_warps} warps"
        variants += [(f"sweep forward, {tag}", fwd), (f"sweep backward, {tag}", bwd)]
    return variants


def _median_ms(fn) -> float:
    """Median of CUDA-event-timed calls (triton.testing.do_bench: L2 flushed before each)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def _config_name(config) -> str:
    grid = "" if config.min_programs == 0 else f", >= {config.min_programs} programs"
    return f"BLOCK_V {config.block_v}, {config.rows} rows, {config.num_warps} warps{grid}"


def _kernel_rows(tokens: int, vocab: int, device: torch.device) -> list[dict]:
    """Each candidate's forward and backward alone, beside a copy of the logits'
    bytes; `max diff` against the default configs' outputs catches a broken one."""
    from llamarl_core.ops.aipo import aipo_loss
    from llamarl_core.ops.logprob_launch import logprob_configs, logprob_launches

    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(tokens, vocab, device=device, generator=gen) * 2).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    coef = torch.randn(tokens, device=device, generator=gen) / tokens
    lse, logp, ent = (torch.empty(tokens, device=device) for _ in range(3))
    dlogits = torch.empty_like(logits)
    nbytes = logits.numel() * logits.element_size()
    copy_ms = _median_ms(lambda: dlogits.copy_(logits))

    def row(what, ms, moved, **extra):
        return {"what": what, "ms": ms, "gbps": moved / ms / 1e6, "vs_copy": moved / ms * copy_ms / (2 * nbytes),
                **extra}

    rows = [row("copy (read + write)", copy_ms, 2 * nbytes)]
    defaults = logprob_configs(vocab, tokens, on_gpu=True)
    forward, backward = logprob_launches(logits, targets, lse, logp, ent, coef, dlogits, 1.0, *defaults)
    rows.append(row(f"forward + entropy, default: {_config_name(defaults[0])}",
                    _median_ms(lambda: forward.launch(logits.device)), nbytes))
    backward.launch(logits.device)
    ref_lse, ref_grad = lse.clone(), dlogits.clone()
    forwards, backwards = sweep_configs()
    for config in forwards:
        launch = logprob_launches(logits, targets, lse, logp, None, coef, dlogits, 1.0, config, config)[0]
        lse.fill_(float("nan"))
        ms = _median_ms(lambda: launch.launch(logits.device))
        rows.append(row(f"forward, {_config_name(config)}", ms, nbytes, kernel="forward",
                        diff=(lse - ref_lse).abs().max().item()))
    lse.copy_(ref_lse)
    for config in backwards:
        launch = logprob_launches(logits, targets, lse, logp, None, coef, dlogits, 1.0, config, config)[1]
        dlogits.fill_(float("nan"))
        ms = _median_ms(lambda: launch.launch(logits.device))
        rows.append(row(f"backward, {_config_name(config)}", ms, 2 * nbytes, kernel="backward",
                        diff=(dlogits.float() - ref_grad.float()).abs().max().item()))
    del dlogits, ref_grad
    behavior, advantages = -torch.rand(tokens, device=device) * 9, torch.randn(tokens, device=device)

    def loss_step():
        x = logits.detach().requires_grad_()
        aipo_loss(x, targets, behavior, advantages)[0].backward()

    rows.append(row("aipo_loss fwd + bwd (6 bytes an element)", _median_ms(loss_step), 3 * nbytes))
    for r in rows:
        r["shape"] = f"{tokens} x {vocab}"
    return rows


def _peak_mib(fn, device: torch.device) -> float | None:
    """MiB allocated at the peak of fn() beyond what was before, on CUDA; None elsewhere."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def linear_rows(tokens: int, hidden: int, vocab: int, chunks_mib, device: torch.device) -> list[dict]:
    """linear_aipo_loss forward + backward for each chunk size beside its three
    GEMMs alone on the same shapes (bf16 outputs, as autograd would give)."""
    from llamarl_core.ops.aipo import linear_aipo_loss

    gen = torch.Generator(device=device).manual_seed(1)
    h = (torch.randn(tokens, hidden, device=device, generator=gen) / hidden**0.25).to(torch.bfloat16)
    w = (torch.randn(vocab, hidden, device=device, generator=gen) / hidden**0.25).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    behavior, advantages = -torch.rand(tokens, device=device) * 9, torch.randn(tokens, device=device)
    logits = torch.empty(tokens, vocab, device=device, dtype=torch.bfloat16)

    def gemms():
        torch.matmul(h, w.t(), out=logits)  # logits = h @ W^T
        return logits @ w, logits.t() @ h  # grad_h = dlogits @ W, grad_W = dlogits^T @ h

    gemm_ms = _median_ms(gemms)
    del logits
    name = f"{tokens} tokens, hidden {hidden}, vocab {vocab}, bf16"
    rows = [{"what": f"three GEMMs alone, {name}", "ms": gemm_ms, "vs_gemms": 1.0,
             "tflops": 6 * tokens * hidden * vocab / gemm_ms / 1e9}]
    for mib in chunks_mib:  # None: linear_aipo_loss's own default
        chunk = None if mib is None else max(1, (mib << 20) // (vocab * 2))

        def step():
            hx, wx = h.detach().requires_grad_(), w.detach().requires_grad_()
            linear_aipo_loss(hx, wx, targets, behavior, advantages, chunk_size=chunk)[0].backward()

        peak_mib = _peak_mib(step, device)  # also the warm-up
        ms = _median_ms(step)
        size = "the default chunk" if chunk is None else f"chunk {mib} MiB ({min(chunk, tokens)} tokens)"
        rows.append({"what": f"linear_aipo_loss, {size}", "ms": ms,
                     "vs_gemms": ms / gemm_ms, "tflops": 6 * tokens * hidden * vocab / ms / 1e9,
                     "peak_mib": peak_mib})
    return rows


def gpu_sweep(spec, device=torch.device("cuda"), shapes=SWEEP_SHAPES, linear=SWEEP_LINEAR) -> dict:
    """Every candidate config of the log-prob kernels on each of `shapes`, and
    linear_aipo_loss by chunk size beside its GEMMs at `linear`: see
    sweep_report(). (tests/test_aipo.py runs it on tiny CPU tensors in the
    interpreter.)"""
    import triton

    kernels = [row for tokens, vocab in shapes for row in _kernel_rows(tokens, vocab, device)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return {"device": name, "triton": triton.__version__, "torch": torch.__version__, "kernels": kernels,
            "linear": linear_rows(*linear, spec.sweep_chunks_mib, device)}


def sweep_report(result: dict) -> str:
    lines = [["shape", "what", "ms", "GB/s", "x copy", "max diff"]]
    for r in result["kernels"]:
        lines.append([r["shape"], r["what"], f"{r['ms']:.3f}", f"{r['gbps']:.0f}", f"{r['vs_copy']:.2f}",
                      f"{r['diff']:.1e}" if "diff" in r else ""])
    best = []
    for shape in dict.fromkeys(r["shape"] for r in result["kernels"]):
        for kernel in ("forward", "backward"):
            candidates = [r for r in result["kernels"] if r["shape"] == shape and r.get("kernel") == kernel]
            top = min(candidates, key=lambda r: r["ms"])
            best.append(f"- best {kernel} at {shape}: {top['what'].split(', ', 1)[1]} ({top['vs_copy']:.2f}x copy)")
    linear = [["what", "ms", "x GEMMs", "TFLOP/s", "peak MiB"]]
    for r in result["linear"]:
        linear.append([r["what"], f"{r['ms']:.2f}", f"{r['vs_gemms']:.2f}", f"{r['tflops']:.0f}",
                       "" if r.get("peak_mib") is None else f"{r['peak_mib']:.0f}"])
    return (f"{result['device']}, Triton {result['triton']}, torch {result['torch']}. GB/s: bytes read + written "
            f"(forward: logits once; backward: logits and dlogits).\n\n{table(lines)}\n\n" + "\n".join(best)
            + f"\n\n{table(linear)}\n")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="llamarl bench aipo", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens in the batch")
    p.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256], help="vocabulary sizes, one run each")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (the linear variants' lm-head input)")
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS, help="the losses to time")
    p.add_argument("--repeats", type=int, default=1, help="timed calls after one warm-up call")
    p.add_argument("--gpu-sweep", action="store_true",
                   help="on a CUDA device: time every candidate config of the log-prob kernels and "
                        "linear_aipo_loss by chunk size (see above); the other options but --json / --record are unused")
    p.add_argument("--sweep-chunks-mib", type=int, nargs="+", default=list(SWEEP_CHUNK_MIB),
                   help="--gpu-sweep: linear_aipo_loss chunk sizes, MiB of bf16 logits")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    add_output_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    spec = parse_args(sys.argv[1:] if argv is None else argv)
    if spec.worker:
        print(json.dumps(worker(spec.worker, spec.tokens, spec.vocabs[0], spec.hidden, spec.repeats)))
        return 0
    if spec.gpu_sweep:
        if not torch.cuda.is_available():
            raise SystemExit("bench_aipo --gpu-sweep needs a CUDA device")
        result = gpu_sweep(spec)
        figures = {f"{r['shape']} {r['what']} ms": r["ms"] for r in result["kernels"]}
        figures.update({f"{r['what']} ms": r["ms"] for r in result["linear"]})
        record(spec.record, "aipo_sweep", figures, {"device": result["device"], "triton": result["triton"]},
               "AIPO log-prob kernels and linear_aipo_loss on a GPU (`bench_aipo --gpu-sweep`)", sweep_report(result))
        print(json.dumps(result, indent=2) if spec.json else sweep_report(result))
        return 0
    result = run(spec)
    figures = {}
    for r in result["rows"]:
        key = f"{r['variant']}@{r['vocab']}"
        figures[f"{key}_s"] = r["seconds"]["median"]
        figures[f"{key}_peak_mib"] = r["peak_bytes"] / 2**20
    record(spec.record, "aipo", figures, {"tokens": spec.tokens, "hidden": spec.hidden},
           "AIPO loss (`llamarl bench aipo`)", report(result))
    print(json.dumps(result, indent=2) if spec.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
