"""`llamarl bench aipo`: peak memory and time of the AIPO loss, forward + backward.

Same inputs, same run, each variant in its own process (so its peak is its own),
num_tokens 4096, vocab 32000 and 128256, hidden 2048 for the linear variants:
  aipo_loss          llamarl, from logits (the CPU path here)
  naive_logits       log_softmax + gather + autograd on the same logits (float32)
  linear_aipo_loss   llamarl, from hidden states and the lm-head weight, chunked
  naive_linear       hidden @ weight.T, then the naive loss, autograd
  liger_grpo         Liger-Kernel's chunked LigerFusedLinearGRPOLoss (if installed:
                     pip install liger-kernel), beta 0, the peer users would pick
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


def parse_args(argv):
    p = argparse.ArgumentParser(prog="llamarl bench aipo", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens in the batch")
    p.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256], help="vocabulary sizes, one run each")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (the linear variants' lm-head input)")
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS, help="the losses to time")
    p.add_argument("--repeats", type=int, default=1, help="timed calls after one warm-up call")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    add_output_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    spec = parse_args(sys.argv[1:] if argv is None else argv)
    if spec.worker:
        print(json.dumps(worker(spec.worker, spec.tokens, spec.vocabs[0], spec.hidden, spec.repeats)))
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
