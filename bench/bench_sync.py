"""`llamarl bench sync`: weight-sync bandwidth between real processes.

One process per rank on this machine: FSDP trainer ranks -> TP generator ranks of
a Llama-shaped model (default about 1 GiB in bf16, FSDP 2 -> TP 2). In the same
run it measures, on the same bytes:
  memcpy          one flat copy of the model's bytes in one process (the limit)
  engine (shm)    WeightSender / WeightReceiver over shared memory (the default)
  engine (p2p)    the same plan over torch.distributed gloo point-to-point
  gloo broadcast  trainer rank 0 broadcasts each full tensor to the generator
                  ranks (what NCCL-broadcast frameworks do)
  mp shared       trainer shards shared one buffer per tensor through
                  torch.multiprocessing; generator ranks copy their slices with
                  torch (receiver-side copies only: the peer is not charged for
                  any hand-shake)
GB/s = model bytes (the Hugging Face parameters in the generator dtype) / time
of one sync, from the first rank starting to the last one finishing.

With --device cuda every rank holds its tensors on GPU 0 (one process per rank,
so the engine goes over CUDA IPC) and the limit is a device-to-device copy of
the same bytes in one process (cudaMemcpy); the host-only peers are skipped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from llamarl_core.sync import WeightReceiver, WeightSender, hf_llama_fsdp, hf_llama_shapes, plan_transfer, vllm_llama_tp

from llamarl_core.bench.harness import add_model_args, add_output_args, record, summarize, table
from llamarl_core.cli import HelpFormatter

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Each rank of every method waits at most this long for a signal.
_WAIT = datetime.timedelta(seconds=300)


def model_config(args) -> SimpleNamespace:
    return SimpleNamespace(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        tie_word_embeddings=False, model_type="llama",
    )


def model_bytes(config, dtype: torch.dtype) -> int:
    return sum(math.prod(s) for s in hf_llama_shapes(config).values()) * dtype.itemsize


def _connect(port: int) -> dist.Store:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_WAIT)


def _timed_rounds(store: dist.Store, method: str, who: str, rounds: int, step) -> None:
    """Run `step(i)` when the parent says go, and post (start, end) for each round."""
    for i in range(rounds):
        store.wait([f"{method}/go/{i}"], _WAIT)
        start = time.perf_counter()
        step(i)
        store.set(f"{method}/time/{i}/{who}", f"{start},{time.perf_counter()}")


def _random_shards(layout, rank: int, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return {n: torch.randn(layout.local_shape(n, rank), generator=gen).to(s.dtype).to(device)
            for n, s in layout.params.items()}


def _zeros(layout, rank: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {n: torch.zeros(layout.local_shape(n, rank), dtype=s.dtype, device=device) for n, s in layout.params.items()}


def _engine_rank(port, role, rank, spec, transport, rounds, threads) -> None:
    torch.set_num_threads(1)
    store, config = _connect(port), model_config(spec)
    method = f"engine_{transport}"
    if role == "src":
        layout = hf_llama_fsdp(config, spec.fsdp, DTYPES[spec.src_dtype])
        ep = WeightSender(store, layout, rank, _random_shards(layout, rank, 0, spec.device), name=method,
                          transport=transport, timeout=300, num_threads=threads)
        _timed_rounds(store, method, f"src{rank}", rounds, lambda i: ep.send(i))
    else:
        layout = vllm_llama_tp(config, spec.tp, torch.bfloat16)
        ep = WeightReceiver(store, layout, rank, _zeros(layout, rank, spec.device), name=method, transport=transport,
                            timeout=300)
        _timed_rounds(store, method, f"dst{rank}", rounds, lambda i: ep.receive())
    store.wait([f"{method}/finish"], _WAIT)
    ep.close()


def _broadcast_rank(port, rank, spec, rounds) -> None:
    """Rank 0 holds the full Hugging Face tensors; ranks 1.. are generator ranks."""
    torch.set_num_threads(1)
    store, config = _connect(port), model_config(spec)
    group = dist.ProcessGroupGloo(dist.PrefixStore("bcast/pg/", store), rank, 1 + spec.tp, _WAIT)
    gen = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(shape, generator=gen).to(torch.bfloat16) if rank == 0 else torch.empty(shape, dtype=torch.bfloat16)
               for shape in hf_llama_shapes(config).values()]

    def step(_):
        for t in tensors:
            group.broadcast(t, 0).wait()

    _timed_rounds(store, "bcast", f"rank{rank}", rounds, step)
    store.wait(["bcast/finish"], _WAIT)


def _shared_views(plan, shared: dict[int, dict[str, torch.Tensor]], params: dict[str, torch.Tensor], rank: int):
    """(dst view, src view) pairs for every segment into `rank`, as torch tensors."""
    def view(t: torch.Tensor, offset: int, pitch: int, width: int, height: int) -> torch.Tensor:
        item = t.element_size()
        return t.view(-1).as_strided((height, width), (pitch // item, 1), offset // item)

    pairs = []
    for src in plan.senders_of(rank):
        for seg in plan.pair_segments(src, rank):
            pairs.append((
                view(params[seg.dst_name], seg.dst_offset, seg.dst_pitch, seg.width, seg.height),
                view(shared[src][seg.src_name], seg.src_offset, seg.src_pitch, seg.width, seg.height),
            ))
    return pairs


def _mp_shared_rank(port, role, rank, spec, rounds, queues) -> None:
    torch.set_num_threads(1)
    store, config = _connect(port), model_config(spec)
    src_layout = hf_llama_fsdp(config, spec.fsdp, DTYPES[spec.src_dtype])
    if role == "src":
        shards = _random_shards(src_layout, rank, 0)
        for t in shards.values():
            t.share_memory_()
        for q in queues:
            q.put((rank, shards))
        store.wait(["mp/finish"], _WAIT)  # keep the shared tensors alive until every copy is done
        return
    dst_layout = vllm_llama_tp(config, spec.tp, torch.bfloat16)
    plan = plan_transfer(src_layout, dst_layout)
    shared = dict(queues[rank].get(timeout=300) for _ in range(spec.fsdp))
    pairs = _shared_views(plan, shared, _zeros(dst_layout, rank), rank)

    def step(_):
        for dst, src in pairs:
            dst.copy_(src)

    _timed_rounds(store, "mp", f"dst{rank}", rounds, step)
    store.wait(["mp/finish"], _WAIT)


def _wait_for_ranks(store, keys: list[str], procs: list, what: str) -> None:
    """Wait for `keys`, failing at once if a rank dies (and after _WAIT at most)."""
    deadline = time.monotonic() + _WAIT.total_seconds()
    # Polled with check(), not a short store.wait(): each wait that times out logs a
    # "[c10d] ... timed out" warning (46 in a default run, every one expected). The
    # figures come from the ranks' own timestamps, so a 20 ms poll does not touch them.
    while not store.check(keys):
        dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: ranks exited with {dead} or timed out")
        time.sleep(0.02)


def _run_method(store, method: str, procs: list, who: list[str], rounds: int, warmup: int) -> list[float]:
    """Start the ranks, drive the rounds, return the sync times after warm-up."""
    for p in procs:
        p.start()
    times = []
    try:
        for i in range(rounds):
            store.set(f"{method}/go/{i}", "1")
            keys = [f"{method}/time/{i}/{w}" for w in who]
            _wait_for_ranks(store, keys, procs, method)
            spans = [tuple(map(float, store.get(k).decode().split(","))) for k in keys]
            times.append(max(e for _, e in spans) - min(s for s, _ in spans))
        store.set(f"{method}/finish", "1")
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
                p.join()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"{method}: a rank exited with {failed}")
    return times[warmup:]


def measure_memcpy(nbytes: int, repeats: int, device: str = "cpu") -> list[float]:
    """One flat copy of `nbytes` in this process (torch copy_): with every core on
    the host, cudaMemcpy device to device on a GPU."""
    torch.set_num_threads(os.cpu_count() or 1)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    dst.copy_(src)  # touch every page first
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return samples


def run(spec) -> dict:
    config = model_config(spec)
    nbytes = model_bytes(config, torch.bfloat16)
    rounds = spec.warmup + spec.repeats
    # The limit is sampled before and after the other methods and pooled, so that
    # drift of this shared machine during the run hits both sides alike.
    memcpy = measure_memcpy(nbytes, rounds, spec.device)[spec.warmup:]
    results = {}
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=_WAIT)
    ctx = tmp.get_context("spawn")
    threads = spec.threads or max(1, (os.cpu_count() or 1) // spec.fsdp)
    for transport in spec.transports:
        method = f"engine_{transport}"
        procs = [ctx.Process(target=_engine_rank, args=(store.port, "src", r, spec, transport, rounds, threads))
                 for r in range(spec.fsdp)]
        procs += [ctx.Process(target=_engine_rank, args=(store.port, "dst", r, spec, transport, rounds, threads))
                  for r in range(spec.tp)]
        who = [f"src{r}" for r in range(spec.fsdp)] + [f"dst{r}" for r in range(spec.tp)]
        results[method] = _run_method(store, method, procs, who, rounds, spec.warmup)
    if spec.device == "cpu":  # host-side peers
        procs = [ctx.Process(target=_broadcast_rank, args=(store.port, r, spec, rounds)) for r in range(1 + spec.tp)]
        results["gloo_broadcast"] = _run_method(store, "bcast", procs, [f"rank{r}" for r in range(1 + spec.tp)],
                                                rounds, spec.warmup)
        queues = [ctx.Queue() for _ in range(spec.tp)]
        procs = [ctx.Process(target=_mp_shared_rank, args=(store.port, "src", r, spec, rounds, queues))
                 for r in range(spec.fsdp)]
        procs += [ctx.Process(target=_mp_shared_rank, args=(store.port, "dst", r, spec, rounds, queues))
                  for r in range(spec.tp)]
        results["mp_shared"] = _run_method(store, "mp", procs, [f"dst{r}" for r in range(spec.tp)], rounds,
                                           spec.warmup)
    results = {"memcpy": memcpy + measure_memcpy(nbytes, rounds, spec.device)[spec.warmup:], **results}
    stats = {name: summarize(samples) for name, samples in results.items()}
    gbps = {name: nbytes / s["median"] / 1e9 for name, s in stats.items()}
    engine = next((gbps[m] for m in ("engine_auto", "engine_shm", "engine_cuda_ipc") if m in gbps), None)
    ratios = {}
    if engine is not None:
        ratios["engine_vs_memcpy"] = engine / gbps["memcpy"]
        for peer in ("gloo_broadcast", "mp_shared"):
            if peer in gbps:
                ratios[f"engine_vs_{peer}"] = engine / gbps[peer]
    if "engine_p2p" in gbps:
        ratios["p2p_vs_gloo_broadcast"] = gbps["engine_p2p"] / gbps["gloo_broadcast"]
    return {
        "model_bytes": nbytes,
        "config": {k: v for k, v in vars(config).items()},
        "fsdp": spec.fsdp, "tp": spec.tp, "src_dtype": spec.src_dtype, "copy_threads_per_sender": threads,
        "device": spec.device, "repeats": spec.repeats,
        "seconds": stats, "gbps": gbps, "ratios": ratios,
    }


LABELS = {
    "memcpy": "memcpy, one process (limit)",
    "engine_auto": "llamarl engine (shared memory)",
    "engine_shm": "llamarl engine (shared memory)",
    "engine_cuda_ipc": "llamarl engine (CUDA IPC)",
    "engine_p2p": "llamarl engine (gloo point-to-point)",
    "gloo_broadcast": "gloo broadcast of full tensors",
    "mp_shared": "torch.multiprocessing shared tensors",
}


def report(result: dict) -> str:
    rows = [["method", "GB/s", "median s", "min s", "max s"]]
    for name, s in result["seconds"].items():
        label = LABELS[name]
        if result["device"] == "cuda":  # what the same methods are on a GPU
            label = {"memcpy": "cudaMemcpy device to device, one process (limit)",
                     "engine_auto": LABELS["engine_cuda_ipc"]}.get(name, label)
        rows.append([label, f"{result['gbps'][name]:.2f}", f"{s['median']:.4f}", f"{s['min']:.4f}", f"{s['max']:.4f}"])
    ratios = "\n".join(f"- {k.replace('_', ' ')}: {v:.2f}x" for k, v in result["ratios"].items())
    head = (f"Model {result['model_bytes'] / 2**30:.3f} GiB bf16 ({result['config']['num_hidden_layers']} layers, "
            f"hidden {result['config']['hidden_size']}), FSDP {result['fsdp']} ({result['src_dtype']}) -> TP {result['tp']} (bf16), "
            f"tensors on {result['device']}, {result['repeats']} timed syncs each "
            f"(memcpy: {result['seconds']['memcpy']['n']}, before and after).")
    return f"{head}\n\n{table(rows)}\n\n{ratios}\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="llamarl bench sync", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--into", choices=["vllm"],
                   help="into a running vLLM engine instead, beside vLLM's own paths (llamarl bench sync --into vllm --help)")
    add_model_args(p, hidden=2048, intermediate=5632, layers=9, size="1.00 GiB in bf16")
    p.add_argument("--fsdp", type=int, default=2, help="trainer ranks")
    p.add_argument("--tp", type=int, default=2, help="generator tensor-parallel ranks")
    p.add_argument("--src-dtype", choices=sorted(DTYPES), default="bf16", help="the trainer's dtype (generator: bf16)")
    p.add_argument("--transports", nargs="+", default=["auto", "p2p"], choices=["auto", "shm", "cuda_ipc", "p2p"],
                   help="the transports to time, one run each")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where every rank holds its tensors (cuda: GPU 0, one process per rank)")
    p.add_argument("--threads", type=int, default=0, help="copy threads per sender (default: cores / senders)")
    p.add_argument("--warmup", type=int, default=2, help="untimed syncs first (the first ones run 30-50%% slower)")
    p.add_argument("--repeats", type=int, default=5, help="timed syncs of each method")
    add_output_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--into" in argv or any(a.startswith("--into=") for a in argv):
        from llamarl_core.bench.bench_sync_vllm import main as into_main

        return into_main(argv)
    spec = parse_args(argv)
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA device")
    result = run(spec)
    section = (f"Weight sync: {result['model_bytes'] / 2**30:.2f} GiB, FSDP {spec.fsdp} {spec.src_dtype} -> "
               f"TP {spec.tp} bf16 (`llamarl bench sync`)")
    record(spec.record, "sync", {f"{k}_gbps": v for k, v in result["gbps"].items()} | result["ratios"],
           {"fsdp": spec.fsdp, "tp": spec.tp, "bytes": result["model_bytes"], "src_dtype": spec.src_dtype}, section,
           report(result))
    print(json.dumps(result, indent=2) if spec.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
