"""`llamarl bench aipo`: time and peak memory of each policy loss type, forward +
backward, beside the naive torch loss and Liger-Kernel's GRPO loss.

For every objective of ops/objectives.py (--loss-types, default all: aipo, ppo,
ppo_tis, icepop, seq_tis, seq_mis, geo_mask, gspo, cispo, sapo, vespo), on the
same batched (B, T) inputs (one sequence a row, 10% of the tokens masked;
old_logprobs for the types that read them), measured in the same run:
  aipo_loss          llamarl, from logits (B, T, vocab)
  naive_logits       the same objective written naively: log_softmax + gather +
                     autograd in the logits' dtype (aipo_loss_ref, compute_dtype=None)
  linear_aipo_loss   llamarl, from hidden states (B, T, hidden) and the lm-head
                     weight (vocab, hidden), chunked
  naive_linear       hidden @ weight.T, then the naive loss
  liger_grpo         Liger-Kernel's chunked LigerFusedLinearGRPOLoss (if installed:
                     pip install liger-kernel), beta 0, token-mean ("bnpo"), set up
                     as its users would for each objective (LIGER_PEERS): the
                     clipped ratio from old_logprobs (ppo, ppo_tis, gspo at
                     importance_sampling_level "sequence"), its loss_type "cispo",
                     and the behaviour correction computed beside it from
                     old_logprobs, as TRL does, and passed as vllm_is_ratio (aipo,
                     ppo_tis, icepop, seq_tis, seq_mis, geo_mask). With old_logprobs
                     equal to the learner's, each gives our objective's gradients
                     (its loss value is the surrogate's: no loss diff for it). Its
                     loss math is torch.compile'd on CUDA (its default) and not on
                     CPU unless --liger-compile on: there inductor takes 10-15 s a
                     configuration on 2 cores, and the call was no faster compiled.
Ratios are ours over the peer measured in the same run (below 1: ours is faster
or smaller). `loss diff`: |ours - naive| / |naive|, a check that both computed
the same objective.

Each variant runs in its own process, with its inputs allocated and one warm-up
call made before any timed call; the processes take turns, one call at a time,
in rounds over the loss types and variants (--repeats rounds), so that other
work on the machine falls on all of them alike. Peak memory: on CPU
the resident set size sampled every millisecond during the timed call, minus
the RSS just before it, with MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors
go back to the OS; on CUDA torch.cuda.max_memory_allocated() minus the memory
allocated before the call. Both include the gradients each method returns
(logits'; hidden's and the weight's); `working` in --json subtracts them. Time:
wall clock of forward + backward (CUDA synchronized), the median of --repeats
(--stat min: the fastest, the call least slowed by other work on the machine).

With --gpu-sweep (a CUDA device; `python -m llamarl_core.bench.bench_aipo
--gpu-sweep`): each candidate config of the log-prob kernels (BLOCK_V, warps,
rows per program, 1-D or 2-D backward grid), forward and backward timed alone
on bf16 logits (4096 x 128256, 16384 x 32000) beside a copy of the same bytes,
aipo_loss forward + backward at the defaults, and linear_aipo_loss (4096 tokens,
hidden 4096, vocab 128256, bf16) by chunk size beside its three GEMMs alone.
Medians of triton.testing.do_bench (CUDA events).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time

import torch

from llamarl_core.bench.bench_aipo_sweep import SWEEP_CHUNK_MIB, gpu_sweep, sweep_report
from llamarl_core.bench.harness import add_output_args, at_least, emit, record, summarize, table
from llamarl_core.cli import HelpFormatter
from llamarl_core.ops.objectives import DEFAULTS, LOSS_TYPES, OLD_POLICY_TYPES

VARIANTS = ["aipo_loss", "naive_logits", "linear_aipo_loss", "naive_linear", "liger_grpo"]
LOGITS_VARIANTS = ("aipo_loss", "naive_logits")
# (ours, peer): the ratios printed.
PEERS = (("aipo_loss", "naive_logits"), ("linear_aipo_loss", "naive_linear"), ("linear_aipo_loss", "liger_grpo"))
# How each objective is set up on LigerFusedLinearGRPOLoss (see _liger_loss).
LIGER_PEERS = {
    "aipo": "vllm_is_ratio min(exp(old - b), 4); no old_per_token_logps (ratio 1)",
    "ppo": "old_per_token_logps, eps 0.2 / 0.2",
    "ppo_tis": "old_per_token_logps, eps 0.2 / 0.2, vllm_is_ratio min(exp(old - b), 4)",
    "icepop": "vllm_is_ratio exp(old - b), 0 outside [0.5, 5]; ratio 1",
    "seq_tis": "vllm_is_ratio per row min(exp(sum(old - b)), 2); ratio 1",
    "seq_mis": "vllm_is_ratio per row exp(sum(old - b)), 0 above 3; ratio 1",
    "geo_mask": "vllm_is_ratio min(exp(old - b), 2), 0 where the row's geometric mean is outside [0.999, 1.001]; "
                "ratio 1",
    "gspo": "old_per_token_logps, importance_sampling_level sequence, eps 3e-4 / 4e-4",
    "cispo": 'old_per_token_logps, loss_type "cispo", epsilon_high 5 (weights clipped at 1 + 4)',
}
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


class PeakCUDA:
    """torch.cuda.max_memory_allocated() over the block, with the memory allocated
    before it as the base (the CUDA work synchronized at both ends)."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated()


def _dtype(spec) -> torch.dtype:
    if spec.dtype == "auto":
        return torch.bfloat16 if spec.device == "cuda" else torch.float32
    return getattr(torch, spec.dtype)


def _liger_compiled(spec) -> bool:
    return spec.liger_compile == "on" or (spec.liger_compile == "auto" and spec.device == "cuda")


def _inputs(spec, vocab: int, linear: bool, seed: int = 0) -> dict:
    """Batched (B, T) inputs: logits (B, T, vocab), or hidden (B, T, hidden) and the
    weight (vocab, hidden), in the bench's dtype on its device; old log-probs near
    the learner's (noise 0.01), behaviour ones near those (0.05), so that ratios,
    clips and masks act as in training; one advantage a row."""
    gen = torch.Generator().manual_seed(seed)
    device, dtype = torch.device(spec.device), _dtype(spec)
    b, t, h = spec.batch, spec.seq_len, spec.hidden
    data = {
        "targets": torch.randint(0, vocab, (b, t), generator=gen),
        "advantages": torch.randn(b, generator=gen),
        "mask": (torch.rand(b, t, generator=gen) > 0.1).float(),
    }
    if linear:
        data["hidden"] = torch.randn(b, t, h, generator=gen) / h**0.25
        data["weight"] = torch.randn(vocab, h, generator=gen) / h**0.25
    else:
        data["logits"] = torch.randn(b, t, vocab, generator=gen) * 2
    data = {k: v.to(device, dtype) if v.is_floating_point() and k in ("logits", "hidden", "weight") else v.to(device)
            for k, v in data.items()}
    with torch.no_grad():  # the learner's log-probs, a row at a time
        learner = torch.empty(b, t, device=device)
        for row in range(b):
            logits = data["logits"][row] if not linear else data["hidden"][row] @ data["weight"].t()
            learner[row] = logits.float().log_softmax(-1).gather(-1, data["targets"][row].unsqueeze(-1)).squeeze(-1)
        del logits
    noise = torch.randn(2, b, t, generator=gen).to(device)
    data["old"] = learner + 0.01 * noise[0]
    data["behavior"] = (data["old"] + 0.05 * noise[1]).clamp(max=0.0)
    return data


def _liger_loss(loss_type: str, h: torch.Tensor, w: torch.Tensor, d: dict, compiled: bool) -> torch.Tensor:
    """LigerFusedLinearGRPOLoss set up for `loss_type` (LIGER_PEERS), with our
    defaults (objectives.DEFAULTS). The corrections Liger does not compute itself
    are TRL's: from the trainer's old log-probs over the sampler's, passed as
    vllm_is_ratio; they are computed here, inside the timed call."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    if loss_type not in LIGER_PEERS:
        raise ValueError(f"Liger-Kernel has no peer of loss_type {loss_type!r}")
    p = DEFAULTS[loss_type]
    old, m = d["old"], d["mask"]
    kwargs = dict(beta=0.0, use_ref_model=False, compiled=compiled, loss_type="bnpo")
    if "eps_low" in p:
        kwargs.update(epsilon_low=p["eps_low"], epsilon_high=p["eps_high"])
    if loss_type == "gspo":
        kwargs["importance_sampling_level"] = "sequence"
    if loss_type == "cispo":  # Liger's CISPO clips the weight at epsilon_high itself
        kwargs.update(loss_type="cispo", epsilon_high=1 + p["eps_high"])
    ratio = None
    with torch.no_grad():
        log_r = old - d["behavior"]
        if loss_type in ("aipo", "ppo_tis"):
            ratio = torch.exp(log_r).clamp(max=p["rho"])
        elif loss_type == "icepop":
            r = torch.exp(log_r)
            ratio = torch.where((r >= p["mask_low"]) & (r <= p["mask_high"]), r, 0.0)
        elif loss_type in ("seq_tis", "seq_mis", "geo_mask"):
            s = (log_r * m).sum(-1, keepdim=True)
            if loss_type == "seq_tis":
                ratio = torch.exp(s).clamp(max=p["rho"])
            elif loss_type == "seq_mis":
                ratio = torch.where((torch.exp(s) >= p["mask_low"]) & (torch.exp(s) <= p["mask_high"]),
                                    torch.exp(s), 0.0)
            else:
                mean = torch.exp(s / m.sum(-1, keepdim=True).clamp(min=1.0))
                keep = (mean >= p["mask_low"]) & (mean <= p["mask_high"])
                ratio = torch.exp(log_r).clamp(max=p["rho"]) * keep
    loss_fn = LigerFusedLinearGRPOLoss(**kwargs)
    return loss_fn(h, w, d["targets"], m, d["advantages"],
                   old_per_token_logps=old if loss_type in OLD_POLICY_TYPES else None, vllm_is_ratio=ratio)[0]


def _step(variant: str, loss_type: str, d: dict, liger_compiled: bool = False):
    """One forward + backward of `variant` on `loss_type`: (loss, the gradients it produced)."""
    from llamarl_core.ops.aipo import aipo_loss, aipo_loss_ref, linear_aipo_loss

    common = (d["targets"], d["behavior"], d["advantages"], d["mask"])
    kw = dict(loss_type=loss_type, old_logprobs=d["old"] if loss_type in OLD_POLICY_TYPES else None)
    if variant in LOGITS_VARIANTS:
        x = d["logits"].detach().requires_grad_()
        if variant == "aipo_loss":
            loss = aipo_loss(x, *common, **kw)[0]
        else:
            loss = aipo_loss_ref(x, *common, compute_dtype=None, **kw)
        loss.backward()
        return loss.detach(), [x.grad]
    h, w = d["hidden"].detach().requires_grad_(), d["weight"].detach().requires_grad_()
    if variant == "linear_aipo_loss":
        loss = linear_aipo_loss(h, w, *common, **kw)[0]
    elif variant == "naive_linear":
        loss = aipo_loss_ref(h @ w.t(), *common, compute_dtype=None, **kw)
    else:
        loss = _liger_loss(loss_type, h, w, d, liger_compiled)
    loss.backward()
    return loss.detach(), [h.grad, w.grad]


def _ops_path(device: torch.device) -> str:
    from llamarl_core.ops._launch import use_interpreter

    if device.type == "cuda":
        return "Triton kernels"
    return "Triton interpreter" if use_interpreter() else "CPU torch path"


def serve(variant: str, vocab: int, spec) -> None:
    """The worker process of `variant`: allocates the inputs, makes one warm-up call
    and says it is ready, then times one call of each loss type it reads on stdin
    (one a line; compiled Liger makes one more call first at each type's first
    request: each configuration compiles at its first call) and answers a JSON
    line for each. Anything else the process prints goes to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def answer(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    device = torch.device(spec.device)
    if device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    liger_compiled = variant == "liger_grpo" and _liger_compiled(spec)
    data = _inputs(spec, vocab, variant not in LOGITS_VARIANTS)
    del _step(variant, spec.loss_types[0], data, liger_compiled)[1][:]  # first-call allocations
    answer({"path": _ops_path(device) if variant in ("aipo_loss", "linear_aipo_loss") else None,
            "liger_compiled": liger_compiled if variant == "liger_grpo" else None})
    compiled = set()
    for line in sys.stdin:
        loss_type = line.strip()
        if liger_compiled and loss_type not in compiled:
            del _step(variant, loss_type, data, liger_compiled)[1][:]
            compiled.add(loss_type)
        gc.collect()
        with (PeakCUDA() if device.type == "cuda" else PeakRSS()) as mem:
            start = time.perf_counter()
            loss, grads = _step(variant, loss_type, data, liger_compiled)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        grad_bytes = sum(g.numel() * g.element_size() for g in grads)
        del grads
        if device.type == "cuda":
            torch.cuda.empty_cache()  # what this process holds idle, the others may use
        answer({"seconds": seconds, "peak_bytes": mem.peak - mem.base, "working_bytes": mem.peak - mem.base - grad_bytes,
                "loss": loss.item()})


class _Worker:
    """A variant's worker process (serve()), started and waited for ready."""

    def __init__(self, variant: str, vocab: int, spec, env: dict):
        import tempfile

        self.variant, self.vocab = variant, vocab
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(_worker_command(variant, vocab, spec), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.stderr.seek(0)
            raise RuntimeError(f"{self.variant} at vocab {self.vocab} failed:\n"
                               f"{self.stderr.read().decode(errors='replace')[-3000:]}")
        return json.loads(line)

    def call(self, loss_type: str) -> dict:
        try:
            self.proc.stdin.write(loss_type + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: _read says why
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait()
        self.stderr.close()


def unavailable(variant: str) -> str | None:
    """Why `variant` cannot run here (None: it can)."""
    if variant != "liger_grpo":
        return None
    try:
        import inspect

        import liger_kernel.chunked_loss as chunked
    except ImportError:
        return "liger_kernel is not installed in this environment (pip install liger-kernel)"
    params = inspect.signature(chunked.LigerFusedLinearGRPOLoss.__init__).parameters
    if "importance_sampling_level" not in params or \
            "vllm_is_ratio" not in inspect.signature(chunked.LigerFusedLinearGRPOLoss.forward).parameters:
        return "the installed liger-kernel has no importance_sampling_level / vllm_is_ratio (0.6.2 or later needed)"
    return None


def _worker_command(variant: str, vocab: int, spec) -> list[str]:
    return [sys.executable, "-m", "llamarl_core.bench.bench_aipo", "--worker", variant, "--vocabs", str(vocab),
            "--batch", str(spec.batch), "--seq-len", str(spec.seq_len), "--hidden", str(spec.hidden),
            "--loss-types", *spec.loss_types, "--device", spec.device, "--dtype", spec.dtype,
            "--liger-compile", spec.liger_compile]


def run(spec) -> dict:
    rows, skipped, paths, liger_compiled = [], {}, set(), None
    load_start = os.getloadavg()[0]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    env.pop("TRITON_INTERPRET", None)  # on CPU the CPU path, not the interpreter
    for variant in spec.variants:
        reason = unavailable(variant)
        if reason:
            skipped[variant] = reason
    for vocab in spec.vocabs:
        # Every variant's process alive at once, each started after the last is ready;
        # their calls interleaved (rounds of every loss type and variant), so that
        # other work on the machine falls on them alike.
        workers = []
        try:
            for variant in spec.variants:
                if variant not in skipped:
                    workers.append(_Worker(variant, vocab, spec, env))
            # Liger has no peer of some objectives (sapo, vespo): not run there, "not run" in the table.
            calls = {(w.variant, t): [] for w in workers for t in spec.loss_types
                     if w.variant != "liger_grpo" or t in LIGER_PEERS}
            for _ in range(spec.repeats):
                for loss_type in spec.loss_types:
                    for w in workers:
                        if (w.variant, loss_type) in calls:
                            calls[(w.variant, loss_type)].append(w.call(loss_type))
        finally:
            for w in workers:
                w.close()
        for (variant, loss_type), results in calls.items():
            rows.append({"variant": variant, "loss_type": loss_type, "vocab": vocab,
                         "seconds": summarize([r["seconds"] for r in results]),
                         "peak_bytes": max(r["peak_bytes"] for r in results),
                         "working_bytes": max(r["working_bytes"] for r in results), "loss": results[-1]["loss"]})
        for w in workers:
            if w.ready["path"]:
                paths.add(w.ready["path"])
            if w.ready["liger_compiled"] is not None:
                liger_compiled = w.ready["liger_compiled"]
    by = {(r["variant"], r["loss_type"], r["vocab"]): r for r in rows}
    ratios = {}
    for vocab in spec.vocabs:
        for loss_type in spec.loss_types:
            for ours, peer in PEERS:
                a, b = by.get((ours, loss_type, vocab)), by.get((peer, loss_type, vocab))
                if a and b:
                    ratios[f"{loss_type}: {ours} vs {peer} @ {vocab}"] = {
                        "time": a["seconds"][spec.stat] / b["seconds"][spec.stat],
                        "peak": a["peak_bytes"] / max(b["peak_bytes"], 1),
                        "working": a["working_bytes"] / max(b["working_bytes"], 1),
                        "loss_diff": abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-30),
                    }
    where = torch.cuda.get_device_name() if spec.device == "cuda" else f"cpu, {os.cpu_count()} threads"
    return {"rows": rows, "ratios": ratios, "skipped": skipped, "where": where, "device": spec.device,
            "load_average": [load_start, os.getloadavg()[0]], "stat": spec.stat, "repeats": spec.repeats,
            "dtype": str(_dtype(spec)).removeprefix("torch."), "ops_path": sorted(paths), "batch": spec.batch,
            "seq_len": spec.seq_len, "hidden": spec.hidden, "loss_types": list(spec.loss_types),
            "liger_compiled": liger_compiled}


def report(result: dict) -> str:
    rows = {(r["variant"], r["loss_type"], r["vocab"]): r for r in result["rows"]}
    b, t, h = result["batch"], result["seq_len"], result["hidden"]
    missing = "not run"

    def cell(variant, loss_type, vocab, what):
        r = rows.get((variant, loss_type, vocab))
        if r is None:
            return missing
        return f"{r['seconds'][result['stat']]:.3f}" if what == "s" else f"{r['peak_bytes'] / 2**20:.0f}"

    def ratio(ours, peer, loss_type, vocab, what):
        v = result["ratios"].get(f"{loss_type}: {ours} vs {peer} @ {vocab}")
        if v is None:
            return missing
        return f"{v[what]:.1e}" if what == "loss_diff" else f"{v[what]:.2f}"

    size = 4 if result["dtype"] == "float32" else 2
    out = [f"Forward + backward of each loss type on batched ({b}, {t}) inputs ({b * t} tokens, 10% masked, one "
           f"sequence a row), {result['dtype']} on {result['where']}; llamarl's ops ran: "
           f"{', '.join(result['ops_path']) or 'none'}. Time: seconds, the {result['stat']} of "
           f"{result['repeats']} timed call(s); peak: MiB "
           f"beyond the inputs, the returned gradients included; x: ours over the peer (below 1: ours faster / "
           f"smaller). Load average (1 min) {result['load_average'][0]:.2f} at the start, "
           f"{result['load_average'][1]:.2f} at the end: other work on the machine slows what runs beside it."]
    for vocab in dict.fromkeys(r["vocab"] for r in result["rows"]):
        logits = [["loss type", "aipo_loss s", "naive s", "time x", "aipo_loss MiB", "naive MiB", "peak x",
                   "loss diff"]]
        linear = [["loss type", "linear s", "naive s", "Liger s", "x naive", "x Liger", "linear MiB", "naive MiB",
                   "Liger MiB", "x naive", "x Liger"]]
        for lt in result["loss_types"]:
            logits.append([lt, cell("aipo_loss", lt, vocab, "s"), cell("naive_logits", lt, vocab, "s"),
                           ratio("aipo_loss", "naive_logits", lt, vocab, "time"),
                           cell("aipo_loss", lt, vocab, "m"), cell("naive_logits", lt, vocab, "m"),
                           ratio("aipo_loss", "naive_logits", lt, vocab, "peak"),
                           ratio("aipo_loss", "naive_logits", lt, vocab, "loss_diff")])
            linear.append([lt] + [cell(v, lt, vocab, "s") for v in ("linear_aipo_loss", "naive_linear", "liger_grpo")]
                          + [ratio("linear_aipo_loss", p, lt, vocab, "time") for p in ("naive_linear", "liger_grpo")]
                          + [cell(v, lt, vocab, "m") for v in ("linear_aipo_loss", "naive_linear", "liger_grpo")]
                          + [ratio("linear_aipo_loss", p, lt, vocab, "peak") for p in ("naive_linear", "liger_grpo")])
        grad_logits = b * t * vocab * size / 2**20
        grad_linear = (b * t * h + vocab * h) * size / 2**20
        if any(row[1:] != [missing] * (len(row) - 1) for row in logits[1:]):
            out.append(f"From logits, vocab {vocab} (the gradient returned: {grad_logits:.0f} MiB):\n\n{table(logits)}")
        if any(row[1:] != [missing] * (len(row) - 1) for row in linear[1:]):
            diffs = [result["ratios"][k]["loss_diff"] for lt in result["loss_types"]
                     if (k := f"{lt}: linear_aipo_loss vs naive_linear @ {vocab}") in result["ratios"]]
            diff = f"; loss diff vs naive at most {max(diffs):.1e}" if diffs else ""
            out.append(f"From hidden states, hidden {h}, vocab {vocab} (the gradients returned: {grad_linear:.0f} "
                       f"MiB{diff}):\n\n{table(linear)}")
    if "liger_grpo" in result["skipped"]:
        out.append(f"Liger-Kernel not measured: {result['skipped']['liger_grpo']}.")
    elif result["liger_compiled"] is not None:
        state = "torch.compile'd" if result["liger_compiled"] else "not compiled (--liger-compile on to compile it)"
        out.append("Liger-Kernel: LigerFusedLinearGRPOLoss, loss math " + state + "; set up per type as:\n"
                   + "\n".join(f"- {lt}: {LIGER_PEERS.get(lt, 'no peer in Liger: not run')}"
                               for lt in result["loss_types"]))
    return "\n\n".join(out) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="llamarl bench aipo", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--batch", type=at_least(1), default=8, help="rows (sequences) in the batch, B")
    p.add_argument("--seq-len", type=at_least(1), default=128, help="tokens a row, T")
    p.add_argument("--vocabs", type=at_least(1), nargs="+", default=[32000], help="vocabulary sizes, one run each")
    p.add_argument("--hidden", type=at_least(1), default=512, help="hidden size (the linear variants' lm-head input)")
    p.add_argument("--loss-types", nargs="+", default=list(LOSS_TYPES), choices=LOSS_TYPES, metavar="TYPE",
                   help=f"the objectives to time (default all: {', '.join(LOSS_TYPES)})")
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS, help="the losses to time")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the inputs and the losses run")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="the logits' / hidden states' and weight's dtype (auto: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--repeats", type=at_least(1), default=1,
                   help="rounds of timed calls: each loss type of each variant, once a round")
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="the statistic of the timed calls shown and used in the ratios (min: the fastest call)")
    p.add_argument("--liger-compile", choices=["auto", "on", "off"], default="auto",
                   help="torch.compile Liger's loss math (auto: on cuda only, see above)")
    p.add_argument("--gpu-sweep", action="store_true",
                   help="on a CUDA device: time every candidate config of the log-prob kernels and "
                        "linear_aipo_loss by chunk size (see above); the other options but --json / --record are unused")
    p.add_argument("--sweep-chunks-mib", type=at_least(1), nargs="+", default=list(SWEEP_CHUNK_MIB),
                   help="--gpu-sweep: linear_aipo_loss chunk sizes, MiB of bf16 logits")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    add_output_args(p)
    spec = p.parse_args(argv)
    if not spec.gpu_sweep and spec.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    return spec


def main(argv=None) -> int:
    spec = parse_args(sys.argv[1:] if argv is None else argv)
    if spec.worker:
        serve(spec.worker, spec.vocabs[0], spec)
        return 0
    if spec.gpu_sweep:
        if not torch.cuda.is_available():
            raise SystemExit("bench_aipo --gpu-sweep needs a CUDA device")
        result = gpu_sweep(spec)
        figures = {f"{r['shape']} {r['what']} ms": r["ms"] for r in result["kernels"]}
        figures.update({f"{r['what']} ms": r["ms"] for r in result["linear"]})
        record(spec.record, "aipo_sweep", figures, {"device": result["device"], "triton": result["triton"]},
               "AIPO log-prob kernels and linear_aipo_loss on a GPU (`bench_aipo --gpu-sweep`)", sweep_report(result))
        emit(spec, result, sweep_report(result))
        return 0
    result = run(spec)
    figures = {}
    for r in result["rows"]:
        key = f"{r['variant']}/{r['loss_type']}@{r['vocab']}"
        figures[f"{key}_s"] = r["seconds"][spec.stat]
        figures[f"{key}_peak_mib"] = r["peak_bytes"] / 2**20
    params = {"batch": spec.batch, "seq_len": spec.seq_len, "hidden": spec.hidden, "device": spec.device,
              "dtype": result["dtype"], "stat": spec.stat, "repeats": spec.repeats}
    record(spec.record, "aipo", figures, params, "AIPO loss (`llamarl bench aipo`)", report(result))
    emit(spec, result, report(result))
    return 0


if __name__ == "__main__":
    from llamarl_core.cli import run_command

    run_command(main)  # its workers too: each ends without the interpreter's teardown of torch
