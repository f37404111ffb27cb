"""`llamarl bench sync --into vllm`: one version of a Llama-shaped model into a
running vLLM engine, by DDMA beside the paths vLLM offers, same engine, same run.

  llamarl_ddma    a trainer process (WeightSender over its fp32 tensors) -> the
                  engine's llamarl_ddma backend: start_weight_update,
                  update_weights, finish_weight_update
  reload_weights  vLLM's layer-by-layer reload from Hugging Face-named tensors
                  (re-fused, re-sharded, re-processed: re-packed on CPU)
  load_weights    `model.load_weights` with Hugging Face-named tensors through
                  the worker (what verl, TRL and PipelineRL do)

Each figure is the time generation is paused, from the first call to the last
one returning. The two vLLM paths are handed tensors already in the engine's
process (no transfer counted: their best case); DDMA's time includes moving
every byte out of the trainer's process. GB/s = model bytes / that time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import sys
import tempfile

import torch
import torch.distributed as dist

from llamarl_core.bench.harness import add_model_args, add_output_args, record, summarize, table
from llamarl_core.cli import HelpFormatter
from llamarl_core.sync import WeightSender, hf_llama_fsdp, hf_llama_shapes

_WAIT = datetime.timedelta(seconds=600)


def llama_config(spec):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=spec.hidden, intermediate_size=spec.intermediate, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, vocab_size=spec.vocab,
        max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="float32")


def _trainer(port: int, config_dict: dict, versions: list[int], name: str) -> None:
    """The trainer: random fp32 tensors, one send per version (each waits for the engine)."""
    import transformers

    torch.set_num_threads(1)
    config = transformers.LlamaConfig.from_dict(config_dict)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_WAIT)
    gen = torch.Generator().manual_seed(0)
    shards = {n: torch.randn(s, generator=gen) * 0.02 for n, s in hf_llama_shapes(config).items()}
    with WeightSender(store, hf_llama_fsdp(config, 1, torch.float32), 0, shards, name=name, timeout=600) as sender:
        for version in versions:
            sender.send(version)


def run(spec) -> dict:
    from llamarl_core.integrations.vllm import ddma_init_info
    from llamarl_core.integrations.vllm.host import EngineError, EngineProcess

    config = llama_config(spec)
    nbytes = sum(math.prod(s) for s in hf_llama_shapes(config).values()) * 4
    rounds = spec.warmup + spec.repeats
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=_WAIT)
    seconds, failures = {}, {}
    with tempfile.TemporaryDirectory() as model_dir:
        config.save_pretrained(model_dir)
        with EngineProcess(model_dir, dtype="float32", max_model_len=256, seed=0) as engine:
            ctx = mp.get_context("spawn")
            trainer = ctx.Process(target=_trainer, args=(store.port, config.to_dict(), list(range(1, rounds + 1)),
                                                         "bench"), daemon=True)
            trainer.start()
            info = ddma_init_info("127.0.0.1", store.port, hf_llama_fsdp(config, 1, torch.float32), name="bench",
                                  timeout_s=600)
            engine.call("init", info, timeout=600)
            ddma = [engine.call("ddma_update", v, 600.0, timeout=600) for v in range(1, rounds + 1)]
            trainer.join(timeout=60)
            engine.call("shutdown_transfer")
            seconds["llamarl_ddma"] = [paused for paused, _ in ddma[spec.warmup:]]
            commit = summarize([c for _, c in ddma[spec.warmup:]])
            engine.call("make_hf_weights", "hf", 1, timeout=600)
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
    return {"model_bytes": nbytes, "config": {k: getattr(config, k) for k in (
                "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size")},
            "repeats": spec.repeats, "ddma_commit_seconds": commit, "seconds": stats, "gbps": gbps, "ratios": ratios,
            "failures": failures}


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
    head = (f"One version of a Llama-shaped model ({result['model_bytes'] / 2**30:.2f} GiB fp32: "
            f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, vocabulary {c['vocab_size']}) into a "
            f"running vLLM engine (trainer world 1, engine TP 1), {result['repeats']} timed syncs per path.")
    ratios = "\n".join(f"- {k.replace('_', ' ')}: {v:.2f}x faster" for k, v in result["ratios"].items())
    commit = (f"- of llamarl_ddma's pause, committing the landed version (CPU: copying embeddings and norms, "
              f"re-packing every linear and lm_head for oneDNN): median "
              f"{result['ddma_commit_seconds']['median']:.3f} s")
    return f"{head}\n\n{table(rows)}\n\n{ratios}\n{commit}\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="llamarl bench sync --into vllm", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--into", choices=["vllm"], default="vllm", help="the engine to sync into")
    add_model_args(p, hidden=1024, intermediate=2816, layers=8, size="0.58 GiB in fp32")
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
        check_cpu_vllm(llama_config(spec))
    except ValueError as exc:
        raise SystemExit(f"llamarl bench sync --into vllm: {exc}") from None
    result = run(spec)
    record(spec.record, "sync_vllm", {f"{k}_s": v["median"] for k, v in result["seconds"].items()} | result["ratios"],
           {"bytes": result["model_bytes"]}, "Weight sync into a running vLLM engine (`llamarl bench sync --into vllm`)",
           report(result))
    print(json.dumps(result, indent=2) if spec.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
