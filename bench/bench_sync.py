"""`llamarl bench sync`: weight-sync bandwidth between real processes.

One process per rank on this machine: FSDP trainer ranks -> TP generator ranks of
a Llama-shaped model (default about 1 GiB in bf16, FSDP 2 -> TP 2). In the same
run it measures, on the same bytes:
  memcpy          the model's bytes copied by as many processes and threads as
                  the senders copy with (the limit)
  engine (shm)    WeightSender / WeightReceiver over shared memory (the default)
  engine (p2p)    the same plan over torch.distributed gloo point-to-point
  gloo broadcast  trainer rank 0 broadcasts each full tensor to the generator
                  ranks (what NCCL-broadcast frameworks do)
  mp shared       trainer shards shared one buffer per tensor through
                  torch.multiprocessing; generator ranks copy their slices with
                  torch (receiver-side copies only: the peer is not charged for
                  any hand-shake)
GB/s = model bytes (the Hugging Face parameters in the generator dtype) / time
of one sync, from the first rank starting to the last one finishing. Every
method's processes live through the whole run and their rounds are interleaved
(round i of each before round i + 1 of any): this shared machine's drift hits
them alike.

With --replicas R1 R2 .. it syncs one version into R generator replicas instead
(the trainer ranks send to replica 0, which relays down a binary tree), beside
R x the one-replica time of the same run (the naive per-replica send) and a
memcpy of R x the model's bytes by as many processes and threads as the engine
copies with, its rounds interleaved with the engine's (see run_replicas).

With --device cuda every rank holds its tensors on GPU 0 (one process per rank,
so the engine goes over CUDA IPC) and the limit is a device-to-device copy of
the same bytes in one process (cudaMemcpy; with --src-dtype fp32, torch's cast of
the same values to bf16); the host-only peers are skipped. The table also gives
each sync's longest receive(), the generator's stall (pause to resume).

With --fp8 GRANULARITY the generator holds its linear weights in FP8 (the senders
quantize: llamarl_core/sync/fp8.py) and only the engine is timed; its limit is the
copy bandwidth of the limit above, measured in the same run, applied to the bytes
such a sync must move at least: the trainer's tensors read once, the generator's
tensors (FP8 weights, scales, the rest in bf16) written once.

With --hosts it syncs across network-namespace hosts over links shaped to
--link-rate instead, beside the line rate and a gloo broadcast
(llamarl_core.bench.bench_sync_hosts).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401  (tensors through the mp_shared peer's queues)

from llamarl_core import forkserver
from llamarl_core.sync import WeightReceiver, WeightSender, plan_transfer
from llamarl_core.models.llama_family import hf_llama_shapes
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp

from llamarl_core.bench.versions import fraction_arg, load_versions, perturb, version_loader, version_shards
from llamarl_core.bench.harness import (add_model_args, add_output_args, at_least, check_model_args, emit, record,
                                       share_secret, summarize, table)
from llamarl_core.cli import HelpFormatter

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Each rank of every method waits at most this long for a signal.
_WAIT = datetime.timedelta(seconds=300)


def model_config(args) -> SimpleNamespace:
    """The Llama-family config the bench syncs: the --delta-versions folders' own, or
    one of the --hidden ... --vocab sizes."""
    if getattr(args, "delta_versions", None):
        return SimpleNamespace(**load_versions(args.delta_versions[0])[0])
    return SimpleNamespace(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        tie_word_embeddings=False, model_type="llama",
    )


def model_bytes(config, dtype: torch.dtype) -> int:
    return sum(math.prod(s) for s in hf_llama_shapes(config).values()) * dtype.itemsize


def _connect(store_at: str) -> dist.Store:
    """A client of the parent's Store at "HOST:PORT"."""
    host, port = store_at.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=_WAIT)


def _timed_rounds(store: dist.Store, method: str, who: str, rounds: int, step, prepare=None) -> None:
    """Run `step(i)` when the parent says go, and post (start, end) for each round;
    `prepare(i)` untimed, before round i: after round i - 1's end and before its
    time is posted, which the parent waits for before it times any other round."""
    if prepare is not None:
        prepare(0)
    for i in range(rounds):
        store.wait([f"{method}/go/{i}"], _WAIT)
        start = time.perf_counter()
        step(i)
        end = time.perf_counter()
        if prepare is not None and i + 1 < rounds:
            prepare(i + 1)
        store.set(f"{method}/time/{i}/{who}", f"{start},{end}")


def _random_shards(layout, rank: int, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Rank `rank`'s shards of `layout`, normal values drawn on `device` itself (on a GPU
    an 8 GiB model's draws take milliseconds; on one CPU thread they took tens of seconds)."""
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    return {n: torch.randn(layout.local_shape(n, rank), generator=gen, device=device).to(s.dtype)
            for n, s in layout.params.items()}


def _zeros(layout, rank: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {n: torch.zeros(shape, dtype=dtype, device=device) for n, (shape, dtype) in
            layout.local_tensor_specs(rank).items()}


def _engine_rank(store_at, role, rank, spec, transport, rounds, threads, replica=0, num_replicas=1, method=None,
                 relay_threads=None, delta_fraction=None, delta_versions=None) -> None:
    """One trainer ("src") or generator ("dst") rank of the engine. With
    `num_replicas` > 1 the generator rank belongs to `replica` and relays each
    version it receives with `relay_threads` copy threads. With `delta_fraction`
    the trainer ranks send deltas, that fraction of their elements changed before
    every round after the first (untimed); with `delta_versions` (a folder of
    save_versions) they send deltas of version i of that run in round i (loaded
    before it, untimed). Both post every round's SendStats."""
    torch.set_num_threads(1)
    store, config = _connect(store_at), model_config(spec)
    method = method or f"engine_{transport}"
    if role == "src":
        dtype = DTYPES[spec.src_dtype]
        layout = hf_llama_fsdp(config, spec.fsdp, dtype)
        delta = delta_fraction is not None or delta_versions is not None
        if delta_versions is not None:
            files = load_versions(delta_versions)[1]
            shards = version_shards(files, 0, spec.fsdp, rank, dtype)
            prepare = version_loader(files, shards, spec.fsdp, rank, dtype)
        else:
            shards = _random_shards(layout, rank, 0, spec.device)
            prepare = None if delta_fraction is None else \
                (lambda i: i and perturb(shards, delta_fraction, 1000 * i + rank))
        ep = WeightSender(store, layout, rank, shards, name=method, transport=transport, timeout=300,
                          num_threads=threads, delta=delta)
        sent = []

        def step(i):
            ep.send(i)
            sent.append(dataclasses.asdict(ep.last_send))

        _timed_rounds(store, method, f"src{rank}", rounds, step, prepare)
        if delta:
            store.set(f"{method}/stats/{rank}", json.dumps(sent))
    else:
        layout = vllm_llama_tp(config, spec.tp, torch.bfloat16, fp8=spec.fp8)
        relay = {} if relay_threads is None else {"num_threads": relay_threads}
        ep = WeightReceiver(store, layout, rank, _zeros(layout, rank, spec.device), name=method, transport=transport,
                            timeout=300, replica=replica, num_replicas=num_replicas, **relay)
        _timed_rounds(store, method, f"dst{replica}.{rank}", rounds, lambda i: ep.receive())
    store.wait([f"{method}/finish"], _WAIT)
    ep.close()


def _engine_ranks(spec, num_replicas: int, make) -> tuple[list, list[str]]:
    """One engine method: its processes and the names they post times under, the
    fsdp trainer ranks then each replica's tp generator ranks. make(role, rank,
    replica) creates the process of one rank (not started)."""
    procs = [make("src", rank, 0) for rank in range(spec.fsdp)]
    procs += [make("dst", rank, replica) for replica in range(num_replicas) for rank in range(spec.tp)]
    who = [f"src{rank}" for rank in range(spec.fsdp)]
    who += [f"dst{replica}.{rank}" for replica in range(num_replicas) for rank in range(spec.tp)]
    return procs, who


def _broadcast_rank(store_at, rank, spec, rounds, receivers=None, method="bcast") -> None:
    """Rank 0 holds the full Hugging Face tensors; ranks 1.. are the generator ranks
    (`receivers` of them: spec.tp unless told)."""
    torch.set_num_threads(1)
    store, config = _connect(store_at), model_config(spec)
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"{method}/pg/", store), rank, 1 + (receivers or spec.tp), _WAIT)
    gen = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(shape, generator=gen).to(torch.bfloat16) if rank == 0 else torch.empty(shape, dtype=torch.bfloat16)
               for shape in hf_llama_shapes(config).values()]

    def step(_):
        for t in tensors:
            group.broadcast(t, 0).wait()

    _timed_rounds(store, method, f"rank{rank}", rounds, step)
    store.wait([f"{method}/finish"], _WAIT)


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


def _mp_shared_rank(store_at, role, rank, spec, rounds, queues) -> None:
    torch.set_num_threads(1)
    store, config = _connect(store_at), model_config(spec)
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


def _run_methods(store, methods: dict[str, tuple[list, list[str]]], rounds: int, warmup: int,
                 stalls: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Start every method's ranks, then drive round i of each method in turn before
    round i + 1 of any: methods sampled in the same stretch of this shared
    machine's drift. `methods`: name -> (processes, the names they post times
    under). Returns name -> the sync times after warm-up. With `stalls`, also fills
    stalls[name] with each round's longest receive() (the generator ranks, "dst...",
    from the call to its return: the time a generator cannot sample)."""
    procs = [p for ps, _ in methods.values() for p in ps]
    for p in procs:
        p.start()
    times = {method: [] for method in methods}
    try:
        for i in range(rounds):
            for method, (_, who) in methods.items():
                store.set(f"{method}/go/{i}", "1")
                keys = [f"{method}/time/{i}/{w}" for w in who]
                _wait_for_ranks(store, keys, procs, method)
                spans = [tuple(map(float, store.get(k).decode().split(","))) for k in keys]
                times[method].append(max(e for _, e in spans) - min(s for s, _ in spans))
                receives = [e - s for (s, e), w in zip(spans, who) if w.startswith("dst")]
                if stalls is not None and receives and i >= warmup:
                    stalls.setdefault(method, []).append(max(receives))
        for method in methods:
            store.set(f"{method}/finish", "1")
    except BaseException:
        for p in procs:  # the others would wait out their timeouts for a round that will not come
            if p.is_alive():
                p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
                p.join()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"{', '.join(methods)}: a rank exited with {failed}")
    return {method: samples[warmup:] for method, samples in times.items()}


def _copy_buffers(nbytes: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A random source and a destination of `nbytes`, every page already touched."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    dst.copy_(src)
    return src, dst


def measure_memcpy(nbytes: int, repeats: int, device: str = "cpu", src_dtype: torch.dtype = torch.bfloat16) -> list[float]:
    """One flat copy of `nbytes` in this process (torch copy_): with every core on
    the host, cudaMemcpy device to device on a GPU. With an fp32 `src_dtype`, a
    cast instead: nbytes / 2 fp32 values into bf16 (torch's own cast kernel, the
    limit of a sync that casts)."""
    torch.set_num_threads(os.cpu_count() or 1)
    src, dst = _copy_buffers(nbytes, device)
    if src_dtype == torch.float32:
        src = torch.randn(nbytes // 2, device=device)
        dst = dst.view(torch.bfloat16)
        dst.copy_(src)
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


def _memcpy_rank(store_at, rank, nbytes, threads, rounds, method) -> None:
    """One process of a multi-process memcpy limit: copies its `nbytes` with
    `threads` torch threads on each round the parent starts."""
    torch.set_num_threads(threads)
    store = _connect(store_at)
    src, dst = _copy_buffers(nbytes)
    _timed_rounds(store, method, f"rank{rank}", rounds, lambda i: dst.copy_(src))
    store.wait([f"{method}/finish"], _WAIT)


def _memcpy_ranks(ctx, store_at: str, spec, nbytes: int, threads: int, rounds: int, method: str):
    """The limit as a method: `nbytes` copied by fsdp processes of `threads` threads
    each, the copy concurrency of the senders."""
    share = -(-nbytes // spec.fsdp)
    return ([ctx.Process(target=_memcpy_rank, args=(store_at, rank, share, threads, rounds, method))
             for rank in range(spec.fsdp)], [f"rank{rank}" for rank in range(spec.fsdp)])


def _sender_threads(spec) -> int:
    """Copy threads per trainer rank: --threads, else the cores shared among the senders."""
    return spec.threads or max(1, (os.cpu_count() or 1) // spec.fsdp)


def run(spec) -> dict:
    """Every method's rounds interleaved (round i of each before round i + 1 of any).
    On the host the limit is a memcpy of the model's bytes by as many processes and
    threads as the senders copy with (fsdp x threads), its rounds among the
    engine's: a one-process copy_ sampled before and after came out at 0.74x and
    1.44x of the engine in two runs of the same code, and below the
    torch.multiprocessing peer, which copies from tp processes at once. On a GPU
    it is one cudaMemcpy device to device, sampled before and after."""
    share_secret()
    config = model_config(spec)
    nbytes = model_bytes(config, torch.bfloat16)
    rounds = spec.warmup + spec.repeats
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=_WAIT)
    local = f"127.0.0.1:{store.port}"
    ctx = forkserver.context()  # ranks forked with torch imported
    threads = _sender_threads(spec)
    methods = {}
    for transport in spec.transports:
        methods[f"engine_{transport}"] = _engine_ranks(spec, 1, lambda role, rank, _: ctx.Process(
            target=_engine_rank, args=(local, role, rank, spec, transport, rounds, threads)))
    if spec.device == "cpu" and spec.fp8:
        methods["memcpy"] = _memcpy_ranks(ctx, local, spec, nbytes, threads, rounds, "memcpy")
    elif spec.device == "cpu":  # the limit and the host-side peers
        methods["memcpy"] = _memcpy_ranks(ctx, local, spec, nbytes, threads, rounds, "memcpy")
        procs = [ctx.Process(target=_broadcast_rank, args=(local, r, spec, rounds)) for r in range(1 + spec.tp)]
        methods["bcast"] = (procs, [f"rank{r}" for r in range(1 + spec.tp)])
        queues = [ctx.Queue() for _ in range(spec.tp)]
        procs = [ctx.Process(target=_mp_shared_rank, args=(local, "src", r, spec, rounds, queues))
                 for r in range(spec.fsdp)]
        procs += [ctx.Process(target=_mp_shared_rank, args=(local, "dst", r, spec, rounds, queues))
                  for r in range(spec.tp)]
        methods["mp"] = (procs, [f"dst{r}" for r in range(spec.tp)])
    src_dtype = torch.bfloat16 if spec.fp8 else DTYPES[spec.src_dtype]  # an FP8 limit: a plain copy, scaled below
    gpu_before = [] if spec.device == "cpu" else measure_memcpy(nbytes, rounds, spec.device, src_dtype)[spec.warmup:]
    stalls: dict[str, list[float]] = {}
    times = _run_methods(store, methods, rounds, spec.warmup, stalls)
    if spec.device != "cpu":
        times["memcpy"] = gpu_before + measure_memcpy(nbytes, rounds, spec.device, src_dtype)[spec.warmup:]
    names = {"bcast": "gloo_broadcast", "mp": "mp_shared"}
    if spec.fp8:  # the copy's time for the bytes an FP8 sync reads and writes (a copy_ moves 2 x nbytes)
        factor = fp8_sync_traffic(spec, config) / (2 * nbytes)
        times["memcpy"] = [t * factor for t in times["memcpy"]]
    results = {"memcpy": times.pop("memcpy"), **{names.get(m, m): samples for m, samples in times.items()}}
    stats = {name: summarize(samples) for name, samples in results.items()}
    gbps = {name: nbytes / s["median"] / 1e9 for name, s in stats.items()}
    engine = next((gbps[m] for m in ("engine_auto", "engine_shm", "engine_cuda_ipc") if m in gbps), None)
    ratios = {}
    if engine is not None:
        ratios["engine_vs_memcpy"] = engine / gbps["memcpy"]
        for peer in ("gloo_broadcast", "mp_shared"):
            if peer in gbps:
                ratios[f"engine_vs_{peer}"] = engine / gbps[peer]
    if "engine_p2p" in gbps and "gloo_broadcast" in gbps:
        ratios["p2p_vs_gloo_broadcast"] = gbps["engine_p2p"] / gbps["gloo_broadcast"]
    return {
        "model_bytes": nbytes,
        "config": {k: v for k, v in vars(config).items()},
        "fsdp": spec.fsdp, "tp": spec.tp, "src_dtype": spec.src_dtype, "fp8": spec.fp8, "copy_threads_per_sender": threads,
        "device": spec.device, "repeats": spec.repeats,
        "seconds": stats, "gbps": gbps, "ratios": ratios,
        "stall_seconds": {names.get(m, m): summarize(samples) for m, samples in stalls.items() if m.startswith("engine")},
    }


def fp8_sync_traffic(spec, config) -> int:
    """Bytes a sync into FP8 destinations must move at least: every trainer tensor
    read once, every generator tensor (FP8 weights and scales included) written once."""
    src = hf_llama_fsdp(config, spec.fsdp, DTYPES[spec.src_dtype])
    dst = vllm_llama_tp(config, spec.tp, torch.bfloat16, fp8=spec.fp8)
    return sum(math.prod(shape) * dtype.itemsize for layout in (src, dst) for rank in range(layout.world_size)
               for shape, dtype in layout.local_tensor_specs(rank).values())


def run_replicas(spec) -> dict:
    """One version into R generator replicas (each a TP group) for every R of
    --replicas, 1 always among them: the naive per-replica send is R x that time.

    Beside each, the limit: a memcpy of R x the model's bytes split over `fsdp`
    processes of the senders' thread count, the copy concurrency of every stage of
    the engine (the senders: fsdp x threads; a relay: tp ranks x cores // tp).
    Every method's processes live through the whole run and its rounds are
    interleaved with the others', so drift hits engine and limit alike (the
    one-process copy_ sampled before and after came out at 0.74x and 1.44x of the
    engine in two runs of the same code)."""
    share_secret()
    config = model_config(spec)
    nbytes = model_bytes(config, torch.bfloat16)
    counts = sorted({1, *spec.replicas})
    transport = spec.transports[0]
    rounds = spec.warmup + spec.repeats
    threads = _sender_threads(spec)
    relay_threads = max(1, (os.cpu_count() or 1) // spec.tp)  # the tp ranks of a replica relay at once
    src_layout = hf_llama_fsdp(config, spec.fsdp, DTYPES[spec.src_dtype])
    dst_layout = vllm_llama_tp(config, spec.tp, torch.bfloat16)
    # The claim under test: trainer ranks send to replica 0 only, whatever R.
    sent = {r: plan_transfer(src_layout, dst_layout, num_replicas=r).bytes_sent_by_src_rank() for r in counts}
    if any(per_rank != sent[1] for per_rank in sent.values()):
        raise RuntimeError(f"bytes sent per trainer rank differ with the number of replicas: {sent}")

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=_WAIT)
    local = f"127.0.0.1:{store.port}"
    ctx = forkserver.context()  # ranks forked with torch imported
    methods = {}
    for r in counts:
        engine, limit = f"replicas{r}", f"memcpy{r}"
        kwargs = {"num_replicas": r, "method": engine, "relay_threads": relay_threads}
        methods[engine] = _engine_ranks(spec, r, lambda role, rank, replica: ctx.Process(
            target=_engine_rank, args=(local, role, rank, spec, transport, rounds, threads),
            kwargs={**kwargs, "replica": replica}))
        methods[limit] = _memcpy_ranks(ctx, local, spec, r * nbytes, threads, rounds, limit)
    times = _run_methods(store, methods, rounds, spec.warmup)

    single = summarize(times["replicas1"])["median"]
    rows = []
    for r in counts:
        sync, limit = summarize(times[f"replicas{r}"]), summarize(times[f"memcpy{r}"])
        rows.append({
            "replicas": r, "seconds": sync, "gbps": r * nbytes / sync["median"] / 1e9,
            "naive_seconds": r * single, "speedup_vs_naive": r * single / sync["median"],
            "memcpy_seconds": limit, "memcpy_gbps": r * nbytes / limit["median"] / 1e9,
            "fraction_of_memcpy": limit["median"] / sync["median"],
        })
    return {
        "model_bytes": nbytes, "config": dict(vars(config)), "fsdp": spec.fsdp, "tp": spec.tp,
        "src_dtype": spec.src_dtype, "transport": transport, "copy_threads_per_sender": threads,
        "copy_threads_per_relay": relay_threads, "memcpy_processes": spec.fsdp, "repeats": spec.repeats,
        "bytes_sent_by_src_rank": {str(r): per_rank for r, per_rank in sent.items()}, "rows": rows,
    }


LABELS = {
    "engine_auto": "llamarl engine (shared memory)",
    "engine_shm": "llamarl engine (shared memory)",
    "engine_cuda_ipc": "llamarl engine (CUDA IPC)",
    "engine_p2p": "llamarl engine (gloo point-to-point)",
    "gloo_broadcast": "gloo broadcast of full tensors",
    "mp_shared": "torch.multiprocessing shared tensors",
}


def report(result: dict) -> str:
    rows = [["method", "GB/s", "median s", "min s", "max s", "receive() (stall) median s"]]
    cast = result["src_dtype"] == "fp32"
    for name, s in result["seconds"].items():
        if name == "memcpy":
            if result.get("fp8"):
                label = ("the same copy bandwidth over the bytes the FP8 sync reads and writes (limit: "
                         + ("cudaMemcpy" if result["device"] == "cuda" else "memcpy processes") + ")")
            elif result["device"] == "cuda":
                label = ("torch cast fp32 -> bf16 of the same values, one process (limit)" if cast else
                         "cudaMemcpy device to device, one process (limit)")
            else:
                label = f"memcpy, {result['fsdp']} processes x {result['copy_threads_per_sender']} thread(s) (limit)"
        elif result["device"] == "cuda" and name == "engine_auto":  # what it is on a GPU
            label = LABELS["engine_cuda_ipc"]
        else:
            label = LABELS[name]
        stall = result.get("stall_seconds", {}).get(name)
        rows.append([label, f"{result['gbps'][name]:.2f}", f"{s['median']:.4f}", f"{s['min']:.4f}", f"{s['max']:.4f}",
                     f"{stall['median']:.4f}" if stall else ""])
    ratios = "\n".join(f"- {k.replace('_', ' ')}: {v:.2f}x" for k, v in result["ratios"].items())
    head = (f"Model {result['model_bytes'] / 2**30:.3f} GiB bf16 ({result['config']['num_hidden_layers']} layers, "
            f"hidden {result['config']['hidden_size']}), FSDP {result['fsdp']} ({result['src_dtype']}) -> TP {result['tp']} "
            f"({'bf16, linear weights FP8 per ' + result['fp8'] if result.get('fp8') else 'bf16'}), "
            f"tensors on {result['device']}, {result['repeats']} timed syncs each, "
            + ("the methods' rounds interleaved." if result["device"] == "cpu" else
               f"the limit {result['seconds']['memcpy']['n']} times, before and after."))
    return f"{head}\n\n{table(rows)}\n\n{ratios}\n"


def report_replicas(result: dict) -> str:
    rows = [["R", "sync median s", "min s", "max s", "R x single s", "R x single / sync", "memcpy R x bytes s (limit)",
             "limit / sync"]]
    for row in result["rows"]:
        s, m = row["seconds"], row["memcpy_seconds"]
        rows.append([str(row["replicas"]), f"{s['median']:.4f}", f"{s['min']:.4f}", f"{s['max']:.4f}",
                     f"{row['naive_seconds']:.4f}", f"{row['speedup_vs_naive']:.2f}x", f"{m['median']:.4f}",
                     f"{row['fraction_of_memcpy']:.2f}"])
    sent = result["bytes_sent_by_src_rank"]
    head = (f"Model {result['model_bytes'] / 2**20:.1f} MiB bf16 ({result['config']['num_hidden_layers']} layers, "
            f"hidden {result['config']['hidden_size']}), FSDP {result['fsdp']} ({result['src_dtype']}) -> R replicas x "
            f"TP {result['tp']} (bf16), transport {result['transport']}, {result['repeats']} timed syncs each. "
            f"Copy threads: {result['copy_threads_per_sender']} per sender, {result['copy_threads_per_relay']} per "
            f"relaying rank; the limit is {result['memcpy_processes']} processes x "
            f"{result['copy_threads_per_sender']} threads copying R x the model's bytes, its rounds interleaved with "
            f"the engine's.")
    per_rank = ", ".join(f"rank {k}: {v}" for k, v in sent["1"].items())
    return (f"{head}\n\n{table(rows)}\n\nBytes sent per trainer rank per sync: {per_rank}, the same for R = "
            f"{', '.join(sent)}.\n")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="llamarl bench sync", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--into", choices=["vllm"],
                   help="into a running vLLM engine instead, beside vLLM's own paths (llamarl bench sync --into vllm --help)")
    add_model_args(p, hidden=2048, intermediate=5632, layers=9, size="1.00 GiB in bf16")
    p.add_argument("--fsdp", type=at_least(1), default=2, help="trainer ranks")
    p.add_argument("--tp", type=at_least(1), default=2, help="generator tensor-parallel ranks")
    p.add_argument("--src-dtype", choices=sorted(DTYPES), default="bf16", help="the trainer's dtype (generator: bf16)")
    p.add_argument("--transports", nargs="+", choices=["auto", "shm", "cuda_ipc", "p2p"],
                   help="the transports to time, one run each (default: auto p2p; with --replicas one, default auto)")
    p.add_argument("--replicas", nargs="+", type=at_least(1),
                   help="sync one version into each number R of generator replicas instead, beside R x one replica "
                        "and the memcpy of R x the model's bytes (1 is always measured; default: no replicas, "
                        "the transports' comparison)")
    p.add_argument("--hosts", action="store_true",
                   help="across network-namespace hosts instead (root and iproute2): trainer ranks on one, each "
                        "replica of --replicas on its own, every link shaped to --link-rate; beside the line rate "
                        "and a gloo broadcast (see llamarl_core.bench.bench_sync_hosts)")
    p.add_argument("--link-rate", default="1gbit",
                   help="with --hosts: every host's sending rate, in tc's syntax (1gbit, 500mbit)")
    p.add_argument("--delta", nargs="+", type=fraction_arg, metavar="FRACTION",
                   help="with --hosts: also send deltas (WeightSender delta=True) into one replica, that fraction of "
                        "the trainer's elements changed before each sync, one run per fraction, beside the full sync "
                        "of the same run, e.g. --delta 0 0.001 0.01 0.05 0.2 0.5 (default: none, full syncs only)")
    p.add_argument("--delta-versions", nargs="+", metavar="DIR",
                   help="with --hosts: also send the consecutive versions of a real run as deltas into one replica, "
                        "version i in round i (--warmup + --repeats of them at most), one run per folder, beside the "
                        "full sync of the same model; each folder written by llamarl_core.bench.versions:save_versions "
                        "(its docstring says how), whose config.json gives the model (--hidden ... --vocab unused; "
                        "default: none)")
    p.add_argument("--fp8", choices=["tensor", "channel", "block"],
                   help="the generator's linear weights in FP8 of this granularity (the engine alone, beside the copy "
                        "bandwidth over the bytes it must move; default: none, bf16 weights)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where every rank holds its tensors (cuda: GPU 0, one process per rank)")
    p.add_argument("--threads", type=at_least(0), default=0, help="copy threads per sender (default: cores / senders)")
    p.add_argument("--warmup", type=at_least(0), default=2,
                   help="untimed syncs first (the first ones run 30-50%% slower)")
    p.add_argument("--repeats", type=at_least(1), default=5, help="timed syncs of each method")
    add_output_args(p)
    spec = p.parse_args(argv)
    if not spec.delta_versions:  # those folders' config.json gives the model
        check_model_args(p, spec)
        try:  # the layouts the ranks will build, by the presets' own rules (GQA replication, vocabulary padding)
            hf_llama_fsdp(model_config(spec), spec.fsdp, DTYPES[spec.src_dtype])
            vllm_llama_tp(model_config(spec), spec.tp, torch.bfloat16, spec.fp8)
        except ValueError as exc:
            p.error(f"--fsdp {spec.fsdp} / --tp {spec.tp} over this model: {exc}")
    return spec


def _main_replicas(spec) -> int:
    if spec.device != "cpu":
        raise SystemExit("--replicas measures host tensors only: its limit is a host memcpy (got --device cuda)")
    spec.transports = spec.transports or ["auto"]
    if len(spec.transports) != 1:
        raise SystemExit(f"--replicas takes one transport, got --transports {' '.join(spec.transports)}")
    result = run_replicas(spec)
    params = {"fsdp": spec.fsdp, "tp": spec.tp, "bytes": result["model_bytes"], "src_dtype": spec.src_dtype}
    section = (f"Weight sync into generator replicas: {result['model_bytes'] / 2**20:.0f} MiB, FSDP {spec.fsdp} "
               f"{spec.src_dtype} -> R x TP {spec.tp} bf16 (`llamarl bench sync --replicas`)")
    for row in result["rows"]:  # a CSV row per R; the section is the whole table
        record(spec.record, "sync_replicas", {"gbps": row["gbps"], "speedup_vs_naive": row["speedup_vs_naive"],
                                              "fraction_of_memcpy": row["fraction_of_memcpy"]},
               params | {"replicas": row["replicas"]}, section, report_replicas(result))
    emit(spec, result, report_replicas(result))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--into" in argv or any(a.startswith("--into=") for a in argv):
        from llamarl_core.bench.bench_sync_vllm import main as into_main

        return into_main(argv)
    spec = parse_args(argv)
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA device")
    if spec.fp8 and (spec.hosts or spec.replicas is not None):
        raise SystemExit("--fp8 times one sync on this host (FP8 destinations are not relayed to replicas)")
    if spec.delta and not spec.hosts:
        raise SystemExit("--delta measures deltas across hosts: it needs --hosts")
    if spec.delta and len(set(spec.delta)) != len(spec.delta):
        raise SystemExit(f"--delta: a fraction given twice ({' '.join(map(str, spec.delta))})")
    if spec.delta and spec.warmup < 1:
        raise SystemExit(f"--delta needs --warmup 1 or more (a delta sender's first sync is whole), got {spec.warmup}")
    if spec.hosts or spec.delta_versions:
        from llamarl_core.bench.bench_sync_hosts import main_hosts

        return main_hosts(spec)
    if spec.replicas is not None:
        return _main_replicas(spec)
    spec.transports = spec.transports or ["auto", "p2p"]
    result = run(spec)
    into = f"TP {spec.tp} FP8 {spec.fp8}" if spec.fp8 else f"TP {spec.tp} bf16"
    section = (f"Weight sync: {result['model_bytes'] / 2**30:.2f} GiB, FSDP {spec.fsdp} {spec.src_dtype} -> "
               f"{into} (`llamarl bench sync`)")
    record(spec.record, "sync_fp8" if spec.fp8 else "sync",
           {f"{k}_gbps": v for k, v in result["gbps"].items()} | result["ratios"],
           {"fsdp": spec.fsdp, "tp": spec.tp, "bytes": result["model_bytes"], "src_dtype": spec.src_dtype}
           | ({"fp8": spec.fp8} if spec.fp8 else {}), section, report(result))
    emit(spec, result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
