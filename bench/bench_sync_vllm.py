"""`llamarl bench sync --into vllm`: one version of a model (Llama-shaped, or a
Qwen3-MoE with --model-type qwen3_moe) into a running vLLM engine, by DDMA
beside the paths vLLM offers, same engine, same run.

  llamarl_ddma    --trainer-world trainer processes, each holding its FSDP2
                  shards (fsdp_layout of the model) -> the engine's llamarl_ddma
                  backend, whose layout vLLM's own loaders give:
                  start_weight_update, update_weights, finish_weight_update
  reload_weights  vLLM's layer-by-layer reload from Hugging Face-named tensors
                  (re-fused, re-sharded, re-processed: re-packed on CPU)
  load_weights    `model.load_weights` with Hugging Face-named tensors through
                  the worker (what verl, TRL and PipelineRL do)

Each figure is the time generation is paused, from the first call to the last
one returning. DDMA's pause begins once the engine's workers are offered the
version (its pending version, polled as a server polls it between decode
steps): what a trainer rank does before its offer (the scans of a delta) runs
beside generation; with --delta each delta is also timed pausing once the
trainer holds the version, as the pipeline's generators and TRL pause. The two
vLLM paths are handed tensors already in the engine's process (no transfer
counted, no gather of shards: their best case); DDMA's time includes moving
every byte out of the trainer processes. GB/s = model bytes / that time. The bytes each trainer rank sends (from the plan) are printed beside
the bytes of its own shards: no rank sends more than it holds.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from llamarl_core import forkserver
from llamarl_core.bench.versions import fraction_arg, perturb
from llamarl_core.bench.harness import add_model_args, add_output_args, emit, record, share_secret, summarize, table
from llamarl_core.cli import HelpFormatter
from llamarl_core.sync import Layout, WeightSender
from llamarl_core.sync.live import fsdp_layout

_WAIT = datetime.timedelta(seconds=600)


def model_config(spec):
    """The benchmarked model's transformers config (fp32)."""
    import transformers

    common = dict(hidden_size=spec.hidden, intermediate_size=spec.intermediate, num_hidden_layers=spec.layers,
                  num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, vocab_size=spec.vocab,
                  max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="float32")
    if spec.model_type == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=spec.hidden // spec.heads, num_experts=spec.experts,
                                           num_experts_per_tok=spec.top_k, moe_intermediate_size=spec.expert_intermediate,
                                           decoder_sparse_step=1, architectures=["Qwen3MoeForCausalLM"])
    return transformers.LlamaConfig(**common, architectures=["LlamaForCausalLM"])


def trainer_layout(config, world: int) -> Layout:
    """The layout FSDP2 trainer ranks register for `config` (read off a meta model)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return fsdp_layout(model, world, torch.float32)


def _trainer(port: int, layout_dict: dict, rank: int, versions: list[int], name: str, transport: str = "auto",
             delta_fraction: float | None = None) -> None:
    """One trainer rank: random fp32 tensors shaped as its FSDP2 shards, one send per
    version (each waits for the engine), each once its tensors hold that version
    (Store key <name>/ready/<version>/<rank>: the engine's pause starts after it).
    With `delta_fraction` it sends deltas, that fraction of its elements changed
    before every version after the first, once the engine has taken the version
    before (key <name>/done/<version>): the change does not run beside a pause."""
    torch.set_num_threads(1)
    layout = Layout.from_dict(layout_dict)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_WAIT)
    gen = torch.Generator().manual_seed(rank)
    shards = {n: torch.randn(shape, generator=gen) * 0.02 for n, (shape, _) in layout.local_tensor_specs(rank).items()}
    with WeightSender(store, layout, rank, shards, name=name, timeout=600, transport=transport,
                      delta=delta_fraction is not None) as sender:
        for i, version in enumerate(versions):
            if i and delta_fraction is not None:
                store.wait([f"{name}/done/{versions[i - 1]}"], _WAIT)
                perturb(shards, delta_fraction, 1000 * i + rank)
            store.set(f"{name}/ready/{version}/{rank}", b"1")
            sender.send(version)


def _ddma_rounds(engine, store, layout, spec, name: str, transport: str,
                 delta_fraction: float | None, on_offer: bool = True) -> tuple[list, dict]:
    """One llamarl_ddma method: trainer processes and the engine's init, one update per
    round, shut down after; (every round's (paused, commit) seconds, the bytes each
    trainer rank's plan sends). Each pause begins once the engine is offered the
    version (`on_offer`: a server polling its pending version), or once every trainer
    rank holds it, as the pipeline's generators and TRL pause (the trainer's send
    then runs its scans before the offer inside the pause)."""
    from llamarl_core.integrations.vllm import ddma_init_info

    rounds = spec.warmup + spec.repeats
    ctx = forkserver.context()  # trainer ranks forked with torch imported
    trainers = [ctx.Process(target=_trainer, args=(store.port, layout.to_dict(), rank, list(range(1, rounds + 1)),
                                                   name, transport, delta_fraction), daemon=True)
                for rank in range(spec.trainer_world)]
    for trainer in trainers:
        trainer.start()
    engine.call("init", ddma_init_info("127.0.0.1", store.port, layout, name=name, timeout_s=600,
                                       transport=transport), timeout=600)
    planned = engine.call("planned_bytes_by_src_rank")
    updates = []
    for v in range(1, rounds + 1):
        store.wait([f"{name}/ready/{v}/{rank}" for rank in range(spec.trainer_world)], _WAIT)
        deadline = time.monotonic() + _WAIT.total_seconds()
        while on_offer and engine.call("pending_version") != v:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine was not offered version {v} within {_WAIT.total_seconds():.0f} s")
            time.sleep(0.001)
        updates.append(engine.call("ddma_update", v, 600.0, timeout=600))
        store.set(f"{name}/done/{v}", b"1")
    for trainer in trainers:
        trainer.join(timeout=60)
    engine.call("shutdown_transfer")
    return updates, planned


def run(spec) -> dict:
    share_secret()
    from llamarl_core.integrations.vllm.host import EngineError, EngineProcess

    config = model_config(spec)
    layout = trainer_layout(config, spec.trainer_world)
    logical = layout.logical_shapes()
    nbytes = sum(math.prod(s) for s in logical.values()) * 4
    shard_bytes = [sum(math.prod(shape) * 4 for shape, _ in layout.local_tensor_specs(r).values())
                   for r in range(spec.trainer_world)]
    rounds = spec.warmup + spec.repeats
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=_WAIT)
    seconds, failures, transfers = {}, {}, {}
    with tempfile.TemporaryDirectory() as model_dir:
        config.save_pretrained(model_dir)
        with EngineProcess(model_dir, dtype="float32", max_model_len=256, seed=0) as engine:
            ddma, sent = _ddma_rounds(engine, store, layout, spec, "bench", "auto", None)
            sent_bytes = [sent.get(rank, 0) for rank in range(spec.trainer_world)]
            seconds["llamarl_ddma"] = [paused for paused, _ in ddma[spec.warmup:]]
            commit = summarize([c for _, c in ddma[spec.warmup:]])
            # Deltas point to point (as across hosts), beside the full point-to-point sync: the pause
            # less the commit (the CPU re-pack, which a GPU engine does not do) is the transfer.
            # Each delta pausing on the offer and at the send (its scans then in the pause).
            for fraction, on_offer in [(None, True)] + [(f, o) for f in spec.delta for o in (True, False)] \
                    if spec.delta else []:
                method = "p2p" if fraction is None else f"p2p_delta{fraction:g}" + ("" if on_offer else "_at_send")
                rounds_of = _ddma_rounds(engine, store, layout, spec, f"bench-{method}", "p2p", fraction,
                                         on_offer)[0][spec.warmup:]
                transfers[method] = {"fraction": fraction, "on_offer": on_offer,
                                     "paused": summarize([p for p, _ in rounds_of]),
                                     "transfer": summarize([p - c for p, c in rounds_of])}
            engine.call("make_hf_weights", "hf", logical, 1, timeout=600)
            for path in ("reload_weights", "load_weights"):
                try:
                    seconds[path] = [engine.call(path, "hf", timeout=600) for _ in range(rounds)][spec.warmup:]
                except EngineError as exc:
                    failures[path] = str(exc).strip().splitlines()[-1]
            engine.call("drop", "hf")
    stats = {path: summarize(samples) for path, samples in seconds.items()}
    gbps = {path: nbytes / s["median"] / 1e9 for path, s in stats.items()}
    native = [p for p in ("reload_weights", "load_weights") if p in stats]
    ratios = {f"ddma_vs_{p}": stats[p]["median"] / stats["llamarl_ddma"]["median"] for p in native}
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    return {"model_bytes": nbytes, "config": {k: getattr(config, k) for k in keys if hasattr(config, k)},
            "trainer_world": spec.trainer_world, "shard_bytes_by_rank": shard_bytes,
            "sent_bytes_by_rank": sent_bytes, "repeats": spec.repeats, "ddma_commit_seconds": commit,
            "seconds": stats, "gbps": gbps, "ratios": ratios, "failures": failures, "deltas": transfers}


LABELS = {
    "llamarl_ddma": "llamarl_ddma: trainer process -> engine, in place",
    "reload_weights": "vLLM reload_weights (HF-named tensors in the engine's process)",
    "load_weights": "vLLM model.load_weights via the worker (HF-named tensors in the engine's process)",
}


def report(result: dict) -> str:
    rows = [["path", "paused, median s", "min s", "max s", "GB/s"]]
    for path, s in result["seconds"].items():
        rows.append([LABELS[path], f"{s['median']:.3f}", f"{s['min']:.3f}", f"{s['max']:.3f}",
                     f"{result['gbps'][path]:.2f}"])
    for path, error in result["failures"].items():
        rows.append([LABELS[path], f"fails: {error}", "", "", ""])
    c = result["config"]
    experts = (f", {c['num_experts']} experts of width {c['moe_intermediate_size']} per layer"
               if "num_experts" in c else "")
    head = (f"One version of a {c['model_type']} model ({result['model_bytes'] / 2**30:.2f} GiB fp32: "
            f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}{experts}, vocabulary {c['vocab_size']}) "
            f"into a running vLLM engine (trainer: {result['trainer_world']} FSDP2 rank(s), engine TP 1), "
            f"{result['repeats']} timed syncs per path.")
    ratios = "\n".join(f"- {k.replace('_', ' ')}: {v:.2f}x faster" for k, v in result["ratios"].items())
    sent = "\n".join(f"- trainer rank {r}: sends {sent} bytes per version, its own shards are {own} bytes"
                     for r, (sent, own) in enumerate(zip(result["sent_bytes_by_rank"], result["shard_bytes_by_rank"])))
    commit = (f"- of llamarl_ddma's pause, committing the landed version (CPU: copying embeddings and norms, "
              f"re-packing every linear and lm_head for oneDNN, pre-packing experts again): median "
              f"{result['ddma_commit_seconds']['median']:.3f} s")
    text = f"{head}\n\n{table(rows)}\n\n{ratios}\n{sent}\n{commit}\n"
    if result.get("deltas"):
        full = result["deltas"]["p2p"]["transfer"]["median"]
        rows = [["llamarl_ddma, point to point", "paused, median s", "transfer (paused less commit), median s",
                 "transfer / full's"]]
        for method, row in result["deltas"].items():
            pause = "pausing on the offer" if row["on_offer"] else "pausing at the send"
            rows.append(["full sync" if row["fraction"] is None else
                         f"delta, {row['fraction']:g} of the elements changed, {pause}",
                         f"{row['paused']['median']:.3f}", f"{row['transfer']['median']:.3f}",
                         f"{row['transfer']['median'] / full:.3f}"])
        text += (f"\nDeltas (WeightSender delta=True) into the same engine, point to point over this host's loopback "
                 f"(transport p2p, as across hosts), beside the full point-to-point sync; the trainer changes that "
                 f"fraction of its elements before every version after the first. Each delta twice: the engine "
                 f"pausing once it is offered the version (a server polling its pending version: the sender's scans "
                 f"run before the offer, beside generation), and pausing once the trainer holds the version (as the "
                 f"pipeline's generators and TRL pause: the scans in the pause, the receiver's checksums read "
                 f"meanwhile):\n\n{table(rows)}\n")
    return text


def parse_args(argv):
    p = argparse.ArgumentParser(prog="llamarl bench sync --into vllm", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--into", choices=["vllm"], default="vllm", help="the engine to sync into")
    p.add_argument("--model-type", choices=["llama", "qwen3_moe"], default="llama",
                   help="the model's family: a Llama, or a Qwen3-MoE (every layer's MLP a mixture of experts)")
    add_model_args(p, hidden=1024, intermediate=2816, layers=8, size="0.58 GiB in fp32 for llama")
    p.add_argument("--experts", type=int, default=8, help="qwen3_moe: experts per layer")
    p.add_argument("--top-k", type=int, default=2, help="qwen3_moe: experts per token")
    p.add_argument("--expert-intermediate", type=int, default=768,
                   help="qwen3_moe: each expert's MLP size (a multiple of 32: vLLM's CPU kernel pads others)")
    p.add_argument("--trainer-world", type=int, default=1, help="FSDP2 trainer ranks (processes) sending")
    p.add_argument("--delta", nargs="+", type=fraction_arg, metavar="FRACTION",
                   help="also llamarl_ddma point to point (transport p2p, as across hosts) with deltas, that fraction of "
                        "the trainer's elements changed before each version, beside the full point-to-point sync, "
                        "e.g. --delta 0 0.01 (default: none)")
    p.add_argument("--warmup", type=int, default=1, help="untimed syncs first")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs of each method")
    add_output_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    spec = parse_args(sys.argv[1:] if argv is None else argv)
    from llamarl_core.integrations.vllm.generator import check_cpu_vllm, missing_vllm_message

    if missing_vllm_message():
        raise SystemExit(f"llamarl bench sync --into vllm: {missing_vllm_message()}")
    try:
        if spec.trainer_world < 1:
            raise ValueError(f"--trainer-world must be >= 1, got {spec.trainer_world}")
        if spec.delta and spec.warmup < 1:
            raise ValueError(f"--delta needs --warmup 1 or more (a delta sender's first sync is whole), got "
                             f"{spec.warmup}")
        if spec.delta and len(set(spec.delta)) != len(spec.delta):
            raise ValueError(f"--delta: a fraction given twice ({' '.join(map(str, spec.delta))})")
        check_cpu_vllm(model_config(spec))
    except ValueError as exc:
        raise SystemExit(f"llamarl bench sync --into vllm: {exc}") from None
    result = run(spec)
    moe = spec.model_type != "llama"
    record(spec.record, "sync_vllm_moe" if moe else "sync_vllm",
           {f"{k}_s": v["median"] for k, v in result["seconds"].items()} | result["ratios"],
           {"bytes": result["model_bytes"], "trainer_world": spec.trainer_world},
           "Weight sync of a MoE model into a running vLLM engine (`llamarl bench sync --into vllm --model-type "
           "qwen3_moe`)" if moe else "Weight sync into a running vLLM engine (`llamarl bench sync --into vllm`)",
           report(result))
    emit(spec, result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
