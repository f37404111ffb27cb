"""`llamarl bench pipeline`: end-to-end RL throughput and reward at equal samples,
our asynchronous and synchronous modes beside TRL's GRPOTrainer, in one run.

All three train the same `LlamaForCausalLM` config (TrainConfig's model) on the
same task and rule-based reward (the embedded string reversal unless --task),
with the same batch (prompts x samples per prompt), completion budget, learning
rate, temperature, number of steps and supervised warm-up (same prompts, same
seed). TRL (PyPI `trl`, `pip install 'llamarl-core[bench]'`) runs on the CPU with
`use_cpu=True, use_vllm=False`, a character-level tokenizer built offline with the
same ids as ours, a constant learning rate, beta 0, gradient checkpointing off
(TRL turns it on by default: it costs time and saves memory not short here) and
otherwise its defaults (loss "dapo", rewards scaled per group), all cores. Ours run the controller and
its executors as `llamarl train` does.

Figures: completion tokens per second over the RL loop (ours: first weight sync
to last step; TRL: `trainer.train()`) and including start-up (process start,
model build, warm-up), and mean reward over the first and last tenth of steps
(equal steps and batch = equal samples seen), and the CPU steal during each run (time
the virtual machine's host took: it slows whatever runs then). Completion tokens
per second depend on how long the completions are, which depends on what each
policy has learned; samples per second (prompts x samples per step over the RL
loop) and the mean completion length are shown beside it. Repeat r runs every
system with seed r (model init, sampling), in rotating order; the table gives
medians (this 2-core machine's timings vary by tens of percent from run to run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from llamarl_core.bench.harness import add_output_args, emit, record, table
from llamarl_core.cli import HelpFormatter

from llamarl_core.pipeline import Controller, RunConfig, TrainConfig, TrainerConfig, load_task
from llamarl_core.pipeline.arithmetic import arithmetic_problems
from llamarl_core.pipeline.gpu_share import generator_percent
from llamarl_core.pipeline.learner import supervised_warmup
from llamarl_core.pipeline.report import cpu_times, steal_fraction, tenth_means
from llamarl_core.spelling import flag_spelling


def run_trl(config: TrainConfig) -> dict:
    start = time.monotonic()  # start-up counts its imports, as ours counts its processes' imports
    cpu_before = cpu_times()
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    task = load_task(config.run.task)
    tokenizer = task.tokenizer().to_transformers()
    torch.manual_seed(config.run.seed)
    model = transformers.LlamaForCausalLM(config.run.toy_model_config(task.tokenizer().vocab_size))
    if config.trainer.warmup_steps and task.reference is not None:
        # As our trainer's.
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.trainer.lr, weight_decay=0.0, fused=True)
        supervised_warmup(model, optimizer, task, config.trainer.warmup_steps, config.trainer.warmup_batch)
    batch = config.run.prompts_per_step * config.run.samples_per_prompt
    prompts = datasets.Dataset.from_list([{"prompt": task.prompt(i)}
                                          for i in range(config.run.steps * config.run.prompts_per_step)])

    def reward(prompts, completions, **_):
        return [float(task.reward(p, c)) for p, c in zip(prompts, completions)]

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, use_cpu=True, use_vllm=False, per_device_train_batch_size=batch,
            num_generations=config.run.samples_per_prompt,
            max_completion_length=config.generator.max_new_tokens or task.max_new_tokens,
            max_steps=config.run.steps, learning_rate=config.trainer.lr, lr_scheduler_type="constant", weight_decay=0.0,
            beta=0.0, temperature=config.generator.temperature, logging_steps=1, save_strategy="no", report_to="none",
            seed=config.run.seed, disable_tqdm=True, bf16=False,
            gradient_checkpointing=False,  # TRL's default is on; it trades time for memory we do not need here
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=prompts,
                              processing_class=tokenizer)
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # a dict per step on stdout
        train_start = time.monotonic()
        trainer.train()
        rl_time = time.monotonic() - train_start
    logs = [e for e in trainer.state.log_history if "reward" in e and "completions/mean_length" in e]
    if len(logs) != config.run.steps:
        raise RuntimeError(f"TRL logged {len(logs)} steps, expected {config.run.steps}")
    tokens = sum(e["completions/mean_length"] * batch for e in logs)
    first, last = tenth_means([e["reward"] for e in logs])
    return {"completion_tokens": tokens, "rl_time_s": rl_time, "wall_time_s": time.monotonic() - start,
            "reward_first": first, "reward_last": last, "step_time_s": rl_time / config.run.steps,
            "cpu_steal": steal_fraction(cpu_before, cpu_times())}


def run_ours(config: TrainConfig, out: Path) -> dict:
    """One run's summary figures, and total_s: Controller.run() from its call to its
    return (wall_time_s ends at the last step; after it, the policy's export and the
    executors' shutdown)."""
    start = time.monotonic()
    s = Controller(config, out).run()
    total_s = time.monotonic() - start
    return {"total_s": total_s, **{k: s[k] for k in (
        "completion_tokens", "rl_time_s", "wall_time_s", "reward_first", "reward_last", "step_time_s", "gen_time_s",
        "train_time_s", "sync_time_s", "stall_time_s", "cpu_steal")}}


# `--device cuda`: a Llama of about 1B parameters (16 layers of hidden 2048, MLP 8192,
# 32 heads over 8 KV heads: 0.97B besides the task's small vocabulary), random weights.
GPU_MODEL = {"hidden_size": 2048, "intermediate_size": 8192, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="llamarl bench pipeline", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--steps", type=int, default=None, help=f"RL steps (default {RunConfig.steps}; 10 with --model)")
    p.add_argument("--task", default=RunConfig.task, help="module:attribute of a llamarl_core.pipeline.Task")
    p.add_argument("--skip-trl", action="store_true", help="only our two modes")
    p.add_argument("--model", help="a pretrained model folder (e.g. SmolLM2-135M-Instruct from "
                                   "scripts/fetch-smollm2.sh): our two modes on it, on --dataset with --reward (TRL is "
                                   "not run)")
    p.add_argument("--dataset", help="with --model: a JSONL dataset (default: `llamarl dataset arithmetic`'s)")
    p.add_argument("--reward", default="math", help="with --model: the reward (default math)")
    p.add_argument("--prompts-per-step", type=int, default=None, help="prompt groups per step (default: "
                   f"{RunConfig.prompts_per_step}; 4 with --model)")
    p.add_argument("--samples-per-prompt", type=int, default=None,
                   help=f"completions per prompt (default: {RunConfig.samples_per_prompt}; 4 with --model)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="completion budget (default: the task's; 48 with --model)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="built-in model: supervised steps before RL, the same for every run (default: "
                        f"{TrainerConfig.warmup_steps}, as `llamarl train`; 0 with --device cuda)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"learning rate (default: {TrainerConfig.lr:g}; 1e-5 with --model)")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs of each system, in rotating order; medians are reported (the machine is noisy) "
                        "(default 3; 1 with --device cuda)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: our two modes on one GPU (trainer and generator processes sharing it) with a Llama of "
                        "about 1B parameters and random weights (unless --model), no warm-up (unless --warmup-steps), "
                        "no checkpoint (its last one and the export of a 1B model write 16 GB after the figures); "
                        "the table adds generation and training throughput, sync time and the generator's stall per "
                        "step")
    p.add_argument("--gpu-share", default="none",
                   help="with --device cuda, the async run's sharing of the one GPU (TrainConfig gpu_share): none, or "
                        "mps:P (MPS, the generator's kernels capped at P%% of the SMs, the trainer's at the rest); the "
                        "sync run alternates its phases, each with the whole GPU")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA device")
    try:
        with flag_spelling():
            generator_percent(args.gpu_share)
    except ValueError as exc:
        p.error(str(exc))
    if args.gpu_share != "none" and args.device != "cuda":
        p.error(f"--gpu-share {args.gpu_share} shares a GPU: it needs --device cuda")
    if args.model and args.warmup_steps is not None and args.warmup_steps > 0:
        p.error("--warmup-steps is the built-in model's: a pretrained --model starts from its own weights")
    args.repeats = args.repeats or (1 if args.device == "cuda" else 3)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with flag_spelling():
                base = _base_config(args, tmp)
        except ValueError as exc:  # a value TrainConfig refuses, named by its flag
            p.error(str(exc))
        return _run(args, base, tmp)


def _base_config(args, tmp: str) -> TrainConfig:
    """The runs' config from the flags (with --model or --device cuda, TRL skipped)."""
    on_gpu = {"device": "cuda"} if args.device == "cuda" else {}
    flags = {k: v for k, v in (("steps", args.steps), ("prompts_per_step", args.prompts_per_step),
                               ("samples_per_prompt", args.samples_per_prompt),
                               ("max_new_tokens", args.max_new_tokens), ("lr", args.lr),
                               ("warmup_steps", args.warmup_steps)) if v is not None}
    if args.model:
        # Small enough that a step of a 135M model takes seconds here, not minutes.
        given = {"steps": 10, "prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 48, "lr": 1e-5,
                 "warmup_steps": 0, **flags}
        dataset = args.dataset or str(Path(tmp) / "arithmetic.jsonl")
        if not args.dataset:
            Path(dataset).write_text("".join(json.dumps(row) + "\n" for row in arithmetic_problems(600)))
        args.skip_trl = True
        return TrainConfig(model=args.model, dataset=dataset, reward=args.reward, **given, **on_gpu)
    if on_gpu:  # TRL runs on the CPU: not a peer here
        args.skip_trl = True
        return TrainConfig(task=args.task, **{"steps": 20, "lr": 1e-5, "warmup_steps": 0, **flags, **GPU_MODEL,
                                              "checkpoint_every": 0, **on_gpu})
    return TrainConfig(task=args.task, **flags)


def _run(args, base: TrainConfig, tmp: str) -> int:
    args.steps = base.run.steps
    batch = base.run.prompts_per_step * base.run.samples_per_prompt
    systems = ["llamarl_async", "llamarl_sync"] + ([] if args.skip_trl else ["trl_grpo"])
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for repeat in range(args.repeats):
        for name in systems[repeat % len(systems):] + systems[:repeat % len(systems)]:
            print(f"run {repeat + 1}/{args.repeats}: {name} ({args.steps} steps)...", file=sys.stderr, flush=True)
            seeded = {**base.to_dict(), "seed": repeat}
            if name == "trl_grpo":
                r = run_trl(TrainConfig.from_dict(seeded))
            else:
                mode = name.split("_")[1]
                share = {"gpu_share": args.gpu_share} if mode == "async" else {}
                r = run_ours(TrainConfig.from_dict({**seeded, "mode": mode, **share}), Path(tmp) / f"{mode}{repeat}")
            r["tokens_per_s"] = r["completion_tokens"] / r["rl_time_s"]
            r["tokens_per_s_with_startup"] = r["completion_tokens"] / r["wall_time_s"]
            r["samples_per_s"] = args.steps * batch / r["rl_time_s"]
            r["mean_completion_tokens"] = r["completion_tokens"] / (args.steps * batch)
            runs[name].append(r)
    results = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
    for name, rs in runs.items():
        results[name]["tokens_per_s_runs"] = [round(r["tokens_per_s"]) for r in rs]
        results[name]["reward_last_runs"] = [round(r["reward_last"], 3) for r in rs]
    peer = results.get("trl_grpo")
    rows = [["system", "completion tok/s (RL loop)", "runs", "vs TRL", "incl. start-up", "vs TRL", "samples/s",
             "vs TRL", "mean completion", "step", "gen / step", "train / step", "reward first -> last tenth",
             "last tenth, runs", "CPU steal"]]

    def versus(r, key):
        return f"{r[key] / peer[key]:.2f}x" if peer else "-"

    for name, r in results.items():
        rows.append([name, f"{r['tokens_per_s']:.0f}", " / ".join(map(str, r["tokens_per_s_runs"])),
                     versus(r, "tokens_per_s"), f"{r['tokens_per_s_with_startup']:.0f}",
                     versus(r, "tokens_per_s_with_startup"), f"{r['samples_per_s']:.0f}", versus(r, "samples_per_s"),
                     f"{r['mean_completion_tokens']:.1f} tokens", f"{r['step_time_s'] * 1e3:.1f} ms",
                     *(f"{r[key] * 1e3:.1f} ms" if key in r else "-" for key in ("gen_time_s", "train_time_s")),
                     f"{r['reward_first']:.3f} -> {r['reward_last']:.3f}", " / ".join(map(str, r["reward_last_runs"])),
                     f"{r['cpu_steal']:.0%}"])
    run = base.run
    what = (f"model {run.model}, dataset {run.dataset}, reward {run.reward}, at most "
            f"{base.generator.max_new_tokens} new tokens"
            if run.model else f"task {args.task}, model hidden {run.hidden_size} x {run.num_layers} layers, "
                              + ("same warm-up for all" if base.trainer.warmup_steps else "random weights, no warm-up"))
    if base.run.device == "cuda":
        what += f", on {torch.cuda.get_device_name()} (trainer and generator processes sharing it"
        what += ")" if args.gpu_share == "none" else f"; async run with --gpu-share {args.gpu_share})"
    ratio = results["llamarl_async"]["step_time_s"] / results["llamarl_sync"]["step_time_s"]
    body = (f"Medians of {args.repeats} runs each (seeds 0-{args.repeats - 1}, rotating order). {args.steps} steps of "
            f"{base.run.prompts_per_step} prompts x {base.run.samples_per_prompt} samples, {what}. "
            f"Async / sync step time: {ratio:.2f}x.\n\n" + table(rows))
    if base.run.device == "cuda":
        body += "\n\n" + table(_gpu_rows(results, args.steps, batch))
    emit(args, results, body)
    figures = {f"{name}_tokens_per_s": r["tokens_per_s"] for name, r in results.items()}
    figures.update({f"{name}_reward_last": r["reward_last"] for name, r in results.items()})
    title = ("Pipeline on a pretrained model, async beside sync (`llamarl bench pipeline --model`)" if base.run.model
             else "Pipeline end to end beside TRL GRPOTrainer (`llamarl bench pipeline`)")
    record(args.record, "pipeline", figures, {"steps": args.steps, "task": args.task, "model": base.run.model}, title,
           body)
    return 0


def _gpu_rows(results: dict, steps: int, batch: int) -> list[list[str]]:
    """Per step, the throughput of each side and what the weight sync costs: the
    trainer's send and the generator's stall (its receive(), pause to resume)."""
    rows = [["system", "step", "generation: completion tok/s while generating", "training: samples/s while training",
             "sync (send) / step", "generator stall / step", "start-up (to the first sync)",
             "after the last step (export unless --device cuda, shutdown)"]]
    for name, r in results.items():
        tokens_per_step = r["completion_tokens"] / steps
        rows.append([name, f"{r['step_time_s'] * 1e3:.1f} ms", f"{tokens_per_step / r['gen_time_s']:.0f}",
                     f"{batch / r['train_time_s']:.1f}", f"{r['sync_time_s'] * 1e3:.1f} ms",
                     f"{r['stall_time_s'] * 1e3:.1f} ms", f"{r['wall_time_s'] - r['rl_time_s']:.1f} s",
                     f"{r['total_s'] - r['wall_time_s']:.1f} s"])
    return rows


if __name__ == "__main__":
    sys.exit(main())
