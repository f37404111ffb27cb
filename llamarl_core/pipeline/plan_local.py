"""`llamarl plan` on a `llamarl train` run of this machine, and the run as the
planner's local model sees it (planner/local.py holds the arithmetic).

    llamarl plan calibrate -o CAL.json                      (probes.calibrate)
    llamarl plan RUN [--calibration CAL.json] [--json] [--choose [--top N]]

RUN is a run's folder or its config.json (sections, or the flat names of before
them). planner/cli.py parses `llamarl plan` and calls is_run_config, predict and
calibrate here (the CLI hands them over: the planner imports nothing of the
pipeline). `auto_placement` is `llamarl train --auto-placement`'s choice."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..planner.devices import PlanError
from ..planner.local import LocalModel, LocalRun, choose_local, describe_local
from ..planner.cli import print_assumptions, show_choice
from ..planner.local_calibration import LocalCalibration
from ..planner.shapes import model_shape
from ..sync.presets import vllm_llama_tp
from .config import FLAT, SECTIONS, TrainConfig
from ..models.checkpoint import check_generator_config
from .data import RunData

# A dataset's (or a task's without reference answers) completions: assumed to fill this share of the budget.
UNKNOWN_LENGTH_SHARE = 0.5
PROBLEMS_READ = 256  # prompts (and reference answers) whose lengths are averaged


def _tp_choices(model_config) -> tuple[int, ...]:
    """The generator tp sizes the pipeline takes for this model (its own check, vllm_llama_tp)."""
    choices = []
    for tp in range(1, model_config.num_attention_heads + 1):
        try:
            vllm_llama_tp(model_config, tp, torch.float32)
        except ValueError:
            continue
        choices.append(tp)
    return tuple(choices)


def _answer_tokens(tokenizer, text: str) -> int:
    """Tokens of a completion `text`, eos included: the tokenizer's own ids, no
    template or special tokens (the task's character tokenizer prepends bos)."""
    hf = getattr(tokenizer, "hf", None)
    ids = hf(text, add_special_tokens=False)["input_ids"] if hf is not None else tokenizer.encode(text)[1:]
    return len(ids) + 1


def _unpriced(config: TrainConfig) -> list[tuple[str, str]]:
    """What the run does that the local model leaves out, each said."""
    run, trainer, loss = config.run, config.trainer, config.loss
    out = []
    if run.reward_model:
        out.append(("reward_model", "the reward model's forwards are not priced (the reward executor shares the "
                                    "cores)"))
    if run.eval_every:
        out.append(("eval_every", f"held-out evaluations every {run.eval_every} versions are not priced"))
    if trainer.step_hook:
        out.append(("step_hook", f"the step hook {trainer.step_hook} is not priced"))
    if 0 < run.checkpoint_every < run.steps:
        out.append(("checkpoint_every", f"checkpoints every {run.checkpoint_every} steps are not priced"))
    if ":" in loss.objective or ":" in loss.advantage:
        out.append(("loss", "a loss or advantage of yours is priced as the built-in ones"))
    if run.torch_dtype == torch.bfloat16:
        out.append(("dtype", "bfloat16 math priced at the fp32 matmul rate the calibration measured"))
    return out


def local_run(config: TrainConfig, name: str = "run", new_tokens: float | None = None) -> LocalRun:
    """`config` as the local model's LocalRun: PlanError naming what the model does
    not describe (a GPU run, a generator other than ours, FP8 weights, a GGUF file)
    or what the run itself cannot load (its task, dataset, model). The mean
    completion length is `new_tokens` when given (a run that was measured), else
    the task's reference answers' (eos included), else half the budget; said in the
    assumptions."""
    run, gen = config.run, config.generator
    if run.device != "cpu":
        raise PlanError(f"{name}: device {run.device!r}: the local model is calibrated on this machine's CPU cores")
    if gen.backend != "llama":
        raise PlanError(f"{name}: generator {gen.backend!r}: the local model describes our generator ('llama')")
    if gen.fp8 is not None:
        raise PlanError(f"{name}: generator_fp8 {gen.fp8!r}: the local model prices the generator's weights in "
                        f"{run.dtype}, not FP8")
    folder = None if run.model is None else Path(run.model).expanduser()
    if folder is not None and not folder.is_dir():
        raise PlanError(f"{name}: model {run.model!r}: " + ("a GGUF file; the planner reads a model folder's "
                                                           "config.json" if folder.is_file() else "no such folder"))
    try:
        data = RunData(config)
        check_generator_config(data.model_config, gen.backend, f"model {run.model!r}" if run.model else
                               "the built-in model")
        problems = [data.problem(i) for i in range(min(PROBLEMS_READ, data.train_size or PROBLEMS_READ))]
        prompts = [len(data.tokenizer.encode(p.prompt)) for p in problems]
        task = data.task
        references = ([_answer_tokens(data.tokenizer, task.reference(p.prompt)) for p in problems]
                      if new_tokens is None and task is not None and task.reference is not None else None)
    except (ValueError, TypeError, OSError) as exc:
        raise PlanError(f"{name}: {exc}") from None
    shape = model_shape(data.model_config.to_dict())  # as the pipeline reads it, defaults filled in
    tp_choices = _tp_choices(data.model_config)
    if not tp_choices:
        raise PlanError(f"{name}: our generator splits this model at no tensor-parallel size (its heads, MLP or "
                        "padded vocabulary)")
    cap = data.max_new_tokens
    assumptions = _unpriced(config)
    if new_tokens is None and references is not None:
        new_tokens = sum(min(cap, n) for n in references) / len(references)
        assumptions.append(("new_tokens", f"completions as long as the task's reference answers ({new_tokens:.1f} "
                                          "tokens with eos)"))
    elif new_tokens is None:
        new_tokens = UNKNOWN_LENGTH_SHARE * cap
        assumptions.append(("new_tokens", f"completions fill {UNKNOWN_LENGTH_SHARE:.0%} of the budget "
                                          f"({new_tokens:.0f} of {cap} tokens): no reference answers"))
    return LocalRun(name, shape, run.mode, run.prompts_per_step, run.samples_per_prompt,
                    sum(prompts) / len(prompts), float(new_tokens), cap, run.max_staleness, gen.tp, gen.replicas,
                    config.trainer.world, 2 if run.torch_dtype == torch.bfloat16 else 4, config.loss.kl_coef > 0,
                    config.trainer.micro_batch_size, tp_choices, tuple(assumptions))


def load_run_config(path: str) -> TrainConfig:
    """A run's config.json (or its folder), checked as `llamarl train --resume` checks
    it: PlanError naming the file and what is wrong."""
    file = Path(path)
    if file.is_dir():
        if not (file / "config.json").exists():
            hint = (f"; a --compare run holds one in {file / 'sync'} and {file / 'async'}"
                    if (file / "sync" / "config.json").exists() else "")
            raise PlanError(f"SCENARIO {path}: holds no run (no config.json){hint}")
        file = file / "config.json"
    try:
        return TrainConfig.load(file)
    except (OSError, ValueError, TypeError, AttributeError) as exc:  # AttributeError: JSON that is no object
        raise PlanError(f"SCENARIO {path}: {exc}") from None


def is_run_config(data) -> bool:
    """Whether SCENARIO's JSON is a `llamarl train` run's config: an object of config
    sections or flat config names (a published-runs row has fields of its own)."""
    return isinstance(data, dict) and bool(data) and set(data) <= set(SECTIONS) | set(FLAT)


def _calibration(path: str | None) -> LocalCalibration:
    if path is None:
        raise PlanError("a `llamarl train` run is predicted on this machine's own calibration: make one with "
                        "`llamarl plan calibrate -o cpu.json` (about a minute and a half) and pass --calibration "
                        "cpu.json")
    return LocalCalibration.load(path)


def _other_machine(model: LocalModel) -> str | None:
    """What differs when the calibration's cores are not this process's (another
    machine, or a CPU limit); None when they are."""
    cores = len(os.sched_getaffinity(0))
    return None if cores == model.machine.cores else \
        f"calibrated on {model.machine.cores} cores; this machine gives this process {cores}"


def predict(path: str, calibration_path: str | None, as_json: bool, choose: bool, top: int) -> int:
    model = _calibration(calibration_path).model()
    run = local_run(load_run_config(path), name=str(path))
    try:
        given, why = model.predict(run), None
    except PlanError as exc:  # does not fit in memory: said; --choose still ranks what fits
        if not choose:
            raise
        given, why = None, str(exc)
    other = _other_machine(model)
    notes = [f"{other}: the prediction is the calibrated machine's"] if other else []
    if choose:
        best = choose_local(model, run, top)
        return show_choice(run, given, why, best, describe=describe_local, placement=LocalRun.placement,
                           as_json=as_json, unit="ms", scale=1e3, width=52, notes=notes)
    if as_json:
        print(json.dumps({"name": run.name, "placement": run.placement(), **given.as_json(),
                          "assumptions": given.assumptions + notes}, indent=1))
        return 0
    print(f"{run.name}: {describe_local(run)}")
    print(f"step {given.step_time_s * 1e3:.1f} ms = gen {given.gen_time_s * 1e3:.1f} ms, train "
          f"{given.train_time_s * 1e3:.1f} ms, sync {given.sync_time_s * 1e3:.2f} ms "
          f"({'overlapped' if run.mode == 'async' else 'one after the other'}); memory GiB a rank: generator "
          f"{given.memory_gib_per_gpu['generator']:.3f}, trainer {given.memory_gib_per_gpu['trainer']:.3f}")
    print(f"bottleneck: {given.bottleneck}")
    print_assumptions(given.assumptions + notes)
    return 0


def auto_placement(config: TrainConfig, calibration_path: str | None) -> tuple[TrainConfig, str]:
    """`config` with the placement (mode, generator tp and replicas, trainer world)
    of the lowest predicted step time, and what was chosen and why (the given
    placement's prediction, or why it does not fit, and the assumptions).
    PlanError when the calibration is another machine's (its cores)."""
    model = _calibration(calibration_path).model()
    other = _other_machine(model)
    if other:
        raise PlanError(f"{other}: calibrate this one (`llamarl plan calibrate`)")
    run = local_run(config, "this run")
    try:
        given = f"{model.predict(run).step_time_s * 1e3:.1f} ms"
    except PlanError as exc:
        given = f"does not fit: {exc}"
    chosen, prediction = choose_local(model, run, top=1)[0]
    placed = config.replace(mode=chosen.mode, generator_tp=chosen.generator_tp,
                            generator_replicas=chosen.generator_replicas, trainer_world=chosen.trainer_world,
                            max_staleness=chosen.max_staleness)
    why = (f"auto-placement: {describe_local(chosen)}, predicted step {prediction.step_time_s * 1e3:.1f} ms "
           f"(the given {describe_local(run)}: {given}); bottleneck: {prediction.bottleneck}; assuming "
           + "; ".join(prediction.assumptions))
    return placed, why


def calibrate(argv: list[str]) -> int:
    """`llamarl plan calibrate`."""
    from .probes import main_calibrate

    return main_calibrate(argv)
