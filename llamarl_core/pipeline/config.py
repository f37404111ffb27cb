"""The run's configuration: TrainConfig, in five sections (run, generator,
trainer, loss, sync), saved as config.json beside the run's outputs (a resumed
run reads it back; one saved before the sections, with flat names, loads too).
Defaults are the embedded demo: a small Llama learns to reverse strings on 2 CPU
cores in about a minute."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..ops.fp8 import GRANULARITIES as FP8_GRANULARITIES
from ..ops.fp8_linear import GEMMS as FP8_GEMMS
from ..ops.objectives import DEFAULTS, LOSS_TYPES, PARAMETERS, Objective
from ..spelling import option
from ..sync.protocol import check_timeout
from .gpu_share import generator_percent
from .plugins import name_of, spec_of

MODES = ("async", "sync")
GENERATORS = ("llama", "vllm")  # built in; or module:Class of a Generator of yours
LOSS_NORMALIZERS = ("tokens", "dr_grpo")
# How a step's loss is reduced (LossConfig.reduction; None: the loss's own, natural_reduction).
LOSS_REDUCTIONS = ("token_mean", "sequence_mean")
# Fields that take a plug-in: given as an object in Python, kept as its module:attribute name.
NONFINITE_LOGPROBS = ("raise", "mask")
PLUGIN_FIELDS = ("generator", "advantage", "loss", "step_hook", "reward")
DEVICES = ("cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")
LR_SCHEDULES = ("constant", "cosine")
# What `llamarl train --generator vllm` changes when not given: vLLM's CPU attention
# takes head sizes of 32, 64, ... (not the default model's 24), and its engine takes
# about 40 s to start here (its own processes; vLLM imported in each).
VLLM_DEFAULTS = {"hidden_size": 128, "intermediate_size": 256, "timeout_s": 180.0}


def check_loss(loss, parameters: dict, *, temperature: float, kl_coef: float, entropy_coef: float) -> None:
    """ValueError unless `loss` (a built-in name, module:function, or the
    function) takes `parameters` (ops.objectives.PARAMETERS -> value or None: its
    default): one set that the loss does not read is refused naming both (a
    loss of yours reads none), and the values, temperature, kl_coef and
    entropy_coef must be in range (ops.objectives.Objective's checks)."""
    builtin = isinstance(loss, str) and loss in LOSS_TYPES
    if not builtin:
        if isinstance(loss, str) and ":" not in loss:
            raise ValueError(f"loss {loss!r}: not one of {LOSS_TYPES}, nor module:function")
        given = [name for name, value in parameters.items() if value is not None]
        if given:
            name = loss if isinstance(loss, str) else name_of(loss)
            raise ValueError(f"loss {name!r}, a function of yours, is given (logprobs, batch) and reads none of "
                             f"{', '.join(given)} (the built-in losses' parameters): leave them unset")
    Objective(loss if builtin else "aipo", **parameters, temperature=temperature, kl_coef=kl_coef,
                     entropy_coef=entropy_coef)


def natural_reduction(loss, reduction: str | None = None, normalized: bool = False) -> str:
    """The reduction a trainer step uses: `reduction` when given, else the
    loss's own: "sequence_mean" for gspo (the mean over the sequences of each
    one's l_i), "token_mean" for the others and for a loss function of yours.
    normalized: the step's summed loss is divided by a constant (Dr.GRPO), which
    divides the sum over tokens: "token_mean"'s sum, and "sequence_mean" is
    refused with it (ValueError)."""
    if reduction is not None and reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS} (or None: the loss's own), got "
                         f"{reduction!r}")
    if normalized:
        if reduction == "sequence_mean":
            raise ValueError("loss_reduction 'sequence_mean' and a constant normalizer (Dr.GRPO's) do not go "
                             "together: the constant divides the sum over tokens; leave loss_reduction unset or "
                             "'token_mean'")
        return "token_mean"
    if reduction is not None:
        return reduction
    return "sequence_mean" if loss == "gspo" else "token_mean"


def reward_sum(terms) -> str:
    """A list of rewards (a built-in name, module:function or the function), each
    alone (weight 1) or as a (weight, reward) pair, as the spec summing them,
    "WEIGHT*NAME+...": ValueError naming the term that is neither, or whose
    weight is not a real number, or a function executors cannot import."""
    if not terms:
        raise ValueError("reward: an empty list; give one reward or more (or None for the task's own)")
    parts = []
    for index, term in enumerate(terms):
        weight, reward = term if isinstance(term, (list, tuple)) and len(term) == 2 else (1.0, term)
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ValueError(f"reward[{index}]: the weight {weight!r} is not a finite real number; terms are a reward "
                             "or a (weight, reward) pair")
        if isinstance(reward, (list, tuple)) or not (isinstance(reward, str) or callable(reward)):
            raise ValueError(f"reward[{index}]: {reward!r} is not a reward (a built-in name, module:function or the "
                             "function)")
        parts.append(f"{repr(float(weight)).replace('e+', 'e')}*{spec_of(reward, f'reward[{index}]')}")  # no + inside
    return "+".join(parts)


@dataclass
class RunConfig:
    """What the run is: its mode and length, its task, model and data, its reward,
    its batch, where it computes, and its built-in toy model's shape."""

    mode: str = "async"  # "async": generation and training overlap; "sync": they take turns
    steps: int = 1200  # trainer steps (weight versions) to run
    seed: int = 0
    task: str = "llamarl_core.pipeline.task:reverse_task"  # module:attribute of a Task
    model: str | None = None  # a pretrained model folder or .gguf file (None: the built-in toy Llama below)
    dataset: str | None = None  # a JSONL file of prompts (or chat messages) and answers, instead of the task's prompts
    chat_template: bool = True  # wrap prompts in the model tokenizer's chat template, where it has one
    eval_size: int = 32  # prompts held out for evaluation (a dataset's last lines; a task's beyond any run reaches)
    eval_every: int = 0  # evaluate (greedy, on the held-out prompts) every this many versions (0: never)
    # e.g. "math", "math+0.1*format", "mymod:reward_fn" (or the function), or a list of rewards (names or
    # functions), each alone or as a (weight, reward) pair, summed: fn(prompts, completions, answers) (or TRL's
    # fn(prompts, completions, **kwargs), the answers as answer=) -> one float per completion; None: the task's own
    # reward, or "math" with a dataset
    reward: str | None = None
    reward_model: str | None = None  # a sequence-classification model folder that scores completions instead
    reward_batch: int = 32  # completions per reward-model forward
    log_rollouts: bool = False  # write every trained sample (prompt, completion, reward, versions) to rollouts.jsonl
    prompts_per_step: int = 8  # prompt groups per trainer step
    samples_per_prompt: int = 8  # completions per prompt (the AIPO / GRPO group)
    max_staleness: int = 1  # async: a sample whose oldest token is version v trains at step s only if s - v <= this
    # trainer steps between checkpoints (and one at the end); 0: none, so no model/ at the end and a resumed run
    # starts over (a benchmark's run, whose last checkpoint of a 1B model and its Adam state is 12 GB)
    checkpoint_every: int = 50
    timeout_s: float = 60.0  # longest wait for any executor before the run stops with an error
    dtype: str = "auto"  # the generator's weights and the trainer's compute: "auto" = float32 on CPU, bfloat16 on GPU
    device: str = "cpu"  # where the trainer and our generator run: "cpu" or "cuda"
    hidden_size: int = 96
    intermediate_size: int = 192
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2

    @property
    def torch_dtype(self):
        """The dtype the generator holds its weights in and the trainer computes in."""
        if self.dtype == "auto":
            return torch.bfloat16 if self.device == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def toy_model_config(self, vocab_size: int):
        """The built-in model's transformers.LlamaConfig (untied head, GQA)."""
        import transformers

        return transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, max_position_embeddings=256, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )


@dataclass
class GeneratorConfig:
    """How completions are sampled: the engine, its parallelism and precision."""

    # "llama": our LlamaGenerator; "vllm": a vLLM engine (llamarl_core.integrations.vllm); "module:Class" (or the
    # class): a Generator of yours (llamarl_core.pipeline.generators), built with a GeneratorContext
    backend: str = "llama"
    tp: int = 1  # tensor-parallel generator ranks
    replicas: int = 1  # data-parallel generator replicas, each `tp` ranks
    temperature: float = 1.0  # sampling temperature (the trainer's log-probs are taken at it too)
    max_new_tokens: int | None = None  # completion budget (None: the task's; 128 with --dataset)
    segment_tokens: int = 4  # K: decode steps per generation segment (partial rollouts)
    recompute_kv: bool = True  # vLLM: after a weight update, recompute running requests' KV cache (else keep it)
    # Our generator's decoder-layer linear weights in FP8 with scales per "tensor", "channel" or "block" (128 x 128),
    # quantized by the trainer ranks at each sync (the trainer computes with its own weights); None: in `dtype`
    fp8: str | None = None
    # How those FP8 layers multiply: "auto" (one FP8 GEMM on a GPU that runs it, in bf16; dequantized weights
    # elsewhere), "fp8" (the FP8 GEMM, or an error saying why not) or "dequantize" (Fp8Linear)
    fp8_gemm: str = "auto"
    # One GPU shared by the trainer and generator processes: "none" (the GPU time-slices between them) or "mps:P"
    # (an MPS daemon of the run's own: the generator's kernels capped at P% of the SMs, the trainer's at the rest,
    # running side by side; pipeline/gpu_share.py)
    gpu_share: str = "none"

    @property
    def plugin(self) -> bool:
        """A Generator of the user's (module:Class), not one of ours."""
        return self.backend not in GENERATORS

    @property
    def processes(self) -> int:
        """Generator executor processes per replica: ours, one per tensor-parallel
        rank (replica r's rank t is generator rank r * tp + t); an engine (vLLM's, or
        a Generator of yours), one, which starts its own tensor-parallel workers."""
        return self.tp if self.backend == "llama" else 1


@dataclass
class TrainerConfig:
    """How the policy is trained: its data-parallel ranks, optimizer, learning-rate
    schedule, supervised warm-up and step hook."""

    world: int = 1  # data-parallel trainer ranks (FSDP2 fully_shard when > 1)
    lr: float = 1e-3
    lr_warmup_steps: int = 0  # linear learning-rate warm-up over this many RL steps
    # After the warm-up: "cosine" (down to min_lr_ratio * lr at the last step) or "constant". Cosine is what lets the
    # default demo settle: seeds 0/1/2 end at 0.95/0.87/0.87 against 0.84/0.82/0.78 at a constant 1e-3.
    lr_schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 0.0  # clip the gradient norm to this (0: no clipping)
    micro_batch_size: int = 0  # samples per forward / backward, gradients accumulated (0: the whole batch at once)
    warmup_steps: int = 100  # supervised steps on the task's reference answers before RL (0: none)
    warmup_batch: int = 32
    # module:function (or the function) run around every trainer step: hook(StepContext, step) -> None or a dict of
    # numbers logged with the step (llamarl_core.pipeline.learner.run_with_hook)
    step_hook: str | None = None


@dataclass
class LossConfig:
    """What a trainer step minimises: the policy objective and its parameters, the
    advantage estimator, the penalties and how the loss is reduced."""

    # The policy loss: one of ops.objectives.LOSS_TYPES (aipo, ppo, ppo_tis, icepop, seq_tis, seq_mis, geo_mask, gspo,
    # cispo, sapo, vespo: the fused loss op's objectives, formulas in llamarl_core/ops/objectives.py) or
    # module:function (or the function): fn(logprobs, batch) -> per-token losses, see llamarl_core.pipeline.learner.
    # ppo, ppo_tis, gspo, cispo and sapo take old log-probs: at one optimizer step per batch the learner's own,
    # detached (ratio 1, no clipping); ppo, gspo, cispo and sapo ignore the generator's log-probs (no correction of
    # stale samples), the others correct with them.
    objective: str = "aipo"
    # "group_mean", "group_mean_std" (GRPO), "rloo", or module:function (or the function): fn(rewards, group_ids)
    # -> advantages, see llamarl_core.pipeline.advantages
    advantage: str = "group_mean"
    # The built-in losses' parameters (ops.objectives.PARAMETERS), None: the loss's default (ops.objectives.DEFAULTS:
    # aipo's rho 4.0). A parameter the loss does not read, set, is refused (a loss of yours reads none of them).
    rho: float | None = None  # truncation of the importance weight: aipo, ppo_tis, seq_tis, geo_mask
    eps_low: float | None = None  # the clip's lower end 1 - eps_low: ppo, ppo_tis, gspo, cispo
    eps_high: float | None = None  # the clip's upper end 1 + eps_high: ppo, ppo_tis, gspo, cispo
    mask_low: float | None = None  # the IS weight masked to 0 below: icepop, seq_mis, geo_mask
    mask_high: float | None = None  # and above: icepop, seq_mis, geo_mask
    tau_pos: float | None = None  # sapo's gate temperature where the advantage is positive
    tau_neg: float | None = None  # and where it is not
    k_pos: float | None = None  # vespo's gamma weight, its power where the advantage is >= 0
    lambda_pos: float | None = None  # and its rate there
    k_neg: float | None = None  # its power where the advantage is negative
    lambda_neg: float | None = None  # and its rate there
    kl_coef: float = 0.0  # KL penalty (k3) towards the frozen reference policy (the weights RL starts from)
    # Weight of the entropy bonus (- entropy_coef * the mean entropy of the policy, at the temperature), any loss
    entropy_coef: float = 0.0
    # What a step's summed loss is divided by: "tokens" (its completion tokens: a token mean) or "dr_grpo" (a constant,
    # samples x max_new_tokens, as Dr.GRPO does; with advantage "group_mean" that is Dr.GRPO)
    normalizer: str = "tokens"
    # How a step's loss is reduced: "token_mean" (its summed loss over the completion tokens that count, across
    # micro-batches and trainer ranks) or "sequence_mean" (each completion's token mean, summed, over the completions
    # with a token that counts, likewise); None: the loss's own, sequence_mean for gspo, token_mean for the others
    # (config.natural_reduction). With normalizer "dr_grpo": token level (sequence_mean refused).
    reduction: str | None = None
    # A counted behaviour log-prob that is NaN or +-inf (a generator's): "raise" (ValueError naming the position) or
    # "mask" (the token left out of the loss, as a masked one); the built-in losses (a loss of yours sees them as
    # they are)
    nonfinite_logprobs: str = "raise"
    mask_truncated: bool = False  # leave completions that hit max_new_tokens out of the loss (counted either way)

    @property
    def parameters(self) -> dict:
        """The built-in losses' parameters as given (None: the loss's default)."""
        return {name: getattr(self, name) for name in PARAMETERS}


@dataclass
class SyncConfig:
    """The weight sync from the trainer ranks to the generator."""

    timeout_s: float = 20.0  # longest weight sync
    # Each trainer rank sends each version to a generator rank on another host as a delta against the
    # version it sent it before (WeightSender delta=True; llamarl_core/sync/delta.py); pairs on one host
    # write whole versions as without it.
    delta: bool = False


SECTIONS = {"run": RunConfig, "generator": GeneratorConfig, "trainer": TrainerConfig, "loss": LossConfig,
            "sync": SyncConfig}
# The flat names (TrainConfig's keyword shorthand, the CLI's flags, a config.json of before the sections) whose
# field in their section is named otherwise; every other field keeps its name.
_RENAMED = {"generator": ("generator", "backend"), "generator_tp": ("generator", "tp"),
            "generator_replicas": ("generator", "replicas"), "generator_fp8": ("generator", "fp8"),
            "generator_fp8_gemm": ("generator", "fp8_gemm"), "trainer_world": ("trainer", "world"),
            "loss": ("loss", "objective"), "loss_normalizer": ("loss", "normalizer"),
            "loss_reduction": ("loss", "reduction"), "sync_timeout_s": ("sync", "timeout_s"),
            "sync_delta": ("sync", "delta")}
_FLAT_OF = {where: flat for flat, where in _RENAMED.items()}
# Flat name -> (section, field), every field of every section.
FLAT = {_FLAT_OF.get((section, f.name), f.name): (section, f.name)
        for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
RESUME_CHANGES = ("steps", "trainer_world")  # the fields a resumed run may change (its checkpoint reads back at any)
_TYPES = {flat: typing.get_type_hints(SECTIONS[section])[name] for flat, (section, name) in FLAT.items()}


# TrainConfig's properties of before the sections -> where they are now (read for one release).
_MOVED_PROPERTIES = {"torch_dtype": ("run", "torch_dtype"), "toy_model_config": ("run", "toy_model_config"),
                     "loss_parameters": ("loss", "parameters"), "generator_processes": ("generator", "processes"),
                     "plugin_generator": ("generator", "plugin")}


class TrainConfig:
    """The run's configuration, in sections: `run` (RunConfig), `generator`
    (GeneratorConfig), `trainer` (TrainerConfig), `loss` (LossConfig) and `sync`
    (SyncConfig); read and set as `config.trainer.lr`.

    Built from sections, from the flat names as keywords (the shorthand, as the CLI
    spells them: `TrainConfig(steps=200, lr=1e-4, generator_tp=2)`; FLAT maps each
    to its section and field), or both, the flat names applied over the sections
    given. `generator=` and `loss=` take a section or, as shorthand, the backend
    and the objective (a name, module:attribute, or the class or function). The
    sections given are copied, never changed. Every value is checked here:
    ValueError naming the field (its flag from the CLI); TypeError for a name that
    is no field, or a section of another type. `replace()` makes a changed copy,
    checked again (not dataclasses.replace: TrainConfig is not a dataclass).

    For one release a flat name (and a property of before the sections, such as
    `torch_dtype`) still reads, and a flat name still sets, its field, with a
    DeprecationWarning naming the field's home; `config.generator` and
    `config.loss` are the sections now."""

    def __init__(self, **fields):
        sections, flat = _split(fields)
        self._fill(sections, flat)

    def _fill(self, sections: dict, flat: dict) -> None:
        for name, cls in SECTIONS.items():
            object.__setattr__(self, name, dataclasses.replace(sections[name]) if name in sections else cls())
        for name, value in flat.items():
            self._set(name, value)
        self._check()

    def replace(self, **changes) -> TrainConfig:
        """A copy with `changes` (whole sections, flat names, or both, as the
        constructor takes them) applied over this config's values, checked again."""
        sections, flat = _split(changes)
        new = object.__new__(TrainConfig)
        new._fill({**{name: getattr(self, name) for name in SECTIONS}, **sections}, flat)
        return new

    def __eq__(self, other) -> bool:
        if not isinstance(other, TrainConfig):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in SECTIONS)

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return f"TrainConfig({', '.join(f'{name}={getattr(self, name)!r}' for name in SECTIONS)})"

    def __getattr__(self, name: str):
        # Only for names that are not attributes: a flat name or a property of before the
        # sections reads its field for one release, with a warning naming the field's home.
        home = FLAT.get(name) or _MOVED_PROPERTIES.get(name)
        if home is None or home[0] not in self.__dict__:  # (not yet filled: unpickling)
            raise AttributeError(f"'TrainConfig' object has no attribute {name!r}")
        warnings.warn(f"TrainConfig.{name} is TrainConfig.{home[0]}.{home[1]} now; the old name reads it for one "
                      "release", DeprecationWarning, stacklevel=2)
        return getattr(getattr(self, home[0]), home[1])

    def __setattr__(self, name: str, value) -> None:
        if name in SECTIONS and isinstance(value, SECTIONS[name]):
            object.__setattr__(self, name, value)
            return
        if name not in FLAT:
            raise AttributeError(f"TrainConfig has no field {name!r}" + (
                f" (its section takes a {SECTIONS[name].__name__})" if name in SECTIONS else ""))
        section, field = FLAT[name]
        warnings.warn(f"TrainConfig.{name} is TrainConfig.{section}.{field} now; the old name sets it for one "
                      "release", DeprecationWarning, stacklevel=2)
        self._set(name, value)

    def flat(self) -> dict:
        """Every field under its flat name (FLAT), in the sections' order."""
        return {name: self._get(name) for name in FLAT}

    def _check_types(self) -> None:
        """ValueError naming the first field (the Python argument; the CLI's flags
        convert their values) whose value is not of its declared type: `lr="1e-5"`
        would otherwise fail far away, comparing a string with a number. Taken and
        converted: an integer (NumPy's too) where an int is declared, a real number
        where a float is, a path (os.PathLike) where a str is; a bool for neither
        number. Plug-in fields take objects too (spec_of checks them)."""
        for name, value in self.flat().items():
            declared = _TYPES[name]
            if name in PLUGIN_FIELDS or (value is None and "None" in str(declared)):
                continue
            kinds = {t for t in typing.get_args(declared) or (declared,) if t is not type(None)}
            if isinstance(value, bool):
                converted = value if bool in kinds else None
            elif int in kinds and isinstance(value, numbers.Integral):
                converted = int(value)
            elif float in kinds and isinstance(value, numbers.Real):
                converted = float(value)
            elif str in kinds and isinstance(value, (str, os.PathLike)):
                converted = os.fspath(value)
            else:
                converted = None
            if converted is None:
                wanted = " or ".join(sorted(kind.__name__ for kind in kinds))
                raise ValueError(f"TrainConfig {name} must be {wanted}, got {value!r} ({type(value).__name__})")
            self._set(name, converted)

    def _get(self, name: str):
        section, field = FLAT[name]
        return getattr(getattr(self, section), field)

    def _set(self, name: str, value) -> None:
        section, field = FLAT[name]
        setattr(getattr(self, section), field, value)

    def _check(self):
        run, gen, trainer, loss = self.run, self.generator, self.trainer, self.loss
        if isinstance(run.reward, (list, tuple)):
            run.reward = reward_sum(run.reward)
        self._check_types()
        for name in PLUGIN_FIELDS:
            if self._get(name) is not None:
                self._set(name, spec_of(self._get(name), name))
        values = self.flat()
        if run.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {run.mode!r}")
        if loss.nonfinite_logprobs not in NONFINITE_LOGPROBS:
            raise ValueError(f"nonfinite_logprobs must be one of {NONFINITE_LOGPROBS}, got {loss.nonfinite_logprobs!r}")
        for name, allowed in (("device", DEVICES), ("dtype", DTYPES), ("lr_schedule", LR_SCHEDULES),
                              ("loss_normalizer", LOSS_NORMALIZERS)):
            if values[name] not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {values[name]!r}")
        if gen.backend not in GENERATORS and ":" not in gen.backend:
            raise ValueError(f"generator must be one of {GENERATORS} or module:Class of a Generator, got "
                             f"{gen.backend!r}")
        if gen.fp8 is not None:
            if gen.fp8 not in FP8_GRANULARITIES:
                raise ValueError(f"generator_fp8 must be one of {FP8_GRANULARITIES} or None, got {gen.fp8!r}")
            if gen.backend != "llama":
                raise ValueError(f"generator_fp8 quantizes our generator's weights (generator 'llama'); not supported "
                                 f"with generator {gen.backend!r}")
        if gen.fp8_gemm not in FP8_GEMMS:
            raise ValueError(f"generator_fp8_gemm must be one of {FP8_GEMMS}, got {gen.fp8_gemm!r}")
        if gen.fp8_gemm != "auto" and gen.fp8 is None:
            raise ValueError(f"generator_fp8_gemm {gen.fp8_gemm!r} is how FP8 weights multiply: set "
                             "generator_fp8 too")
        if gen.fp8_gemm == "fp8" and (gen.fp8 == "block" or run.torch_dtype != torch.bfloat16):
            raise ValueError("generator_fp8_gemm 'fp8' runs one FP8 GEMM, which takes bfloat16 activations and a scale "
                             f"per output row: not generator_fp8 {gen.fp8!r} with dtype {run.dtype!r} on "
                             f"{run.device} (use 'auto' or 'dequantize')")
        shares_gpu = generator_percent(gen.gpu_share) is not None
        if shares_gpu and (run.device != "cuda" or gen.backend != "llama"):
            raise ValueError(f"{option('gpu_share', gen.gpu_share)} shares one GPU between the trainer and our "
                             f"generator: it needs {option('device', 'cuda')} and {option('generator', 'llama')}, got "
                             f"{option('device', run.device)} and {option('generator', gen.backend)}")
        if shares_gpu and run.mode == "sync":
            raise ValueError(f"{option('gpu_share', gen.gpu_share)} lets generation and training run at once; "
                             f"{option('mode', 'sync')} runs them one after the other, each with the whole GPU")
        if gen.replicas > 1 and gen.backend != "llama":
            raise ValueError(f"{option('generator_replicas', gen.replicas)} runs replicas of our generator; "
                             f"{option('generator', gen.backend)} is one replica")
        if not gen.recompute_kv and gen.backend != "vllm":
            raise ValueError("recompute_kv=False (keep the KV cache across weight updates) needs generator 'vllm'; "
                             "our generator always re-prefills")
        positive = ("steps", "prompts_per_step", "samples_per_prompt", "segment_tokens", "hidden_size",
                    "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "trainer_world",
                    "generator_tp", "generator_replicas", "warmup_batch", "reward_batch")
        for name in positive:
            if values[name] < 1:
                raise ValueError(f"{option(name)} must be >= 1, got {values[name]}")
        for name in ("temperature", "lr"):
            if not (math.isfinite(values[name]) and values[name] > 0):
                raise ValueError(f"{option(name)} must be a finite number > 0, got {values[name]}")
        for name in ("timeout_s", "sync_timeout_s"):
            check_timeout(values[name], option(name))
        for name in ("max_staleness", "warmup_steps", "eval_size", "eval_every", "lr_warmup_steps", "max_grad_norm",
                     "kl_coef", "micro_batch_size", "checkpoint_every"):
            if not (math.isfinite(values[name]) and values[name] >= 0):  # NaN fails both
                raise ValueError(f"{option(name)} must be a finite number >= 0, got {values[name]}")
        if run.hidden_size % run.num_heads:
            raise ValueError(f"{option('num_heads', run.num_heads)} must divide "
                             f"{option('hidden_size', run.hidden_size)}")
        if run.num_heads % run.num_kv_heads:
            raise ValueError(f"{option('num_kv_heads', run.num_kv_heads)} must divide "
                             f"{option('num_heads', run.num_heads)}")
        if trainer.lr_warmup_steps > run.steps:
            raise ValueError(f"{option('lr_warmup_steps', trainer.lr_warmup_steps)} is more than the run's "
                             f"{option('steps', run.steps)}")
        if not 0 <= trainer.min_lr_ratio <= 1:
            raise ValueError(f"{option('min_lr_ratio')} must be in [0, 1], got {trainer.min_lr_ratio}")
        if gen.max_new_tokens is not None and gen.max_new_tokens < 1:
            raise ValueError(f"{option('max_new_tokens')} must be >= 1, got {gen.max_new_tokens}")
        if run.dataset is not None and run.model is None:
            raise ValueError(f"a dataset needs a model with its own tokenizer ({option('model')}): the built-in toy model "
                             "knows only its task's characters")
        if run.eval_every and not run.eval_size:
            raise ValueError(f"{option('eval_every')} needs held-out prompts: {option('eval_size')} must be >= 1")
        if run.reward is not None and run.reward_model is not None:
            raise ValueError(f"give a rule reward ({option('reward')}) or a reward model ({option('reward_model')}), not "
                             "both")
        if run.dataset is not None and run.reward is None and run.reward_model is None:
            run.reward = "math"  # a dataset has answers, and no task reward
        if run.mode == "sync":
            run.max_staleness = 0
        elif run.max_staleness < 1:
            raise ValueError(f"{option('mode', 'async')} needs {option('max_staleness')} >= 1 (0 is the sync mode)")
        if run.samples_per_prompt < 2:
            raise ValueError(f"{option('samples_per_prompt')} must be >= 2: advantages are rewards centred per prompt "
                             f"group, got {run.samples_per_prompt}")
        if run.prompts_per_step % trainer.world:
            raise ValueError(f"{option('prompts_per_step', run.prompts_per_step)} must split evenly over "
                             f"{option('trainer_world', trainer.world)} ranks")
        check_loss(loss.objective, loss.parameters, temperature=gen.temperature, kl_coef=loss.kl_coef,
                   entropy_coef=loss.entropy_coef)
        natural_reduction(loss.objective, loss.reduction, loss.normalizer == "dr_grpo")

    @property
    def groups_in_flight(self) -> int:
        """Prompt groups handed to the generator and not yet consumed by the trainer, at
        most: one step's worth in sync mode, max_staleness steps' worth in async mode
        (more would only be sampled with weights too old to be used)."""
        return max(1, self.run.max_staleness) * self.run.prompts_per_step

    def to_dict(self) -> dict:
        """The sections as dicts (what config.json holds)."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        """A config from to_dict()'s sections, or from flat names (a config.json of
        before the sections), or both (the flat names applied over the sections).
        ValueError naming what is neither."""
        sections = {name: value for name, value in data.items() if name in SECTIONS and isinstance(value, dict)}
        flat = {name: value for name, value in data.items() if name not in sections}
        unknown = sorted(set(flat) - set(FLAT))
        for name, value in sections.items():
            known = {f.name for f in dataclasses.fields(SECTIONS[name])}
            unknown += sorted(f"{name}.{field}" for field in set(value) - known)
        if unknown:
            raise ValueError(f"unknown config fields {unknown}")
        if sections:
            # Beside sections, "generator" and "loss" are sections too: a value that is not one would
            # replace the whole section, every other field of it back at its default.
            shadowed = sorted(name for name in flat if name in SECTIONS)
            if shadowed:
                raise ValueError(f"config fields {shadowed}: beside sections each is its section (a dict); give "
                                 f"the backend / objective inside it ({{'generator': {{'backend': ...}}}}, "
                                 f"{{'loss': {{'objective': ...}}}})")
        else:
            flat = _before_the_loss_parameters(flat)  # a flat config.json: saved before the sections
        return cls(**{name: SECTIONS[name](**value) for name, value in sections.items()}, **flat)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> TrainConfig:
        return cls.from_dict(json.loads(path.read_text()))


def _split(fields: dict) -> tuple[dict, dict]:
    """TrainConfig's keywords as (sections, flat names); TypeError naming what is
    neither, or a section given as something else (a dict, say)."""
    sections, flat = {}, {}
    for name, value in fields.items():
        if name in SECTIONS and isinstance(value, SECTIONS[name]):
            sections[name] = value
        elif name in SECTIONS and (name not in FLAT or isinstance(value, dict)):
            raise TypeError(f"TrainConfig {name}= takes a {SECTIONS[name].__name__}"
                            + (" (or the " + FLAT[name][1] + " as shorthand)" if name in FLAT else "")
                            + f", got {type(value).__name__} {value!r}")
        else:
            flat[name] = value  # generator= / loss= with a backend / objective: the shorthand
    unknown = sorted(set(flat) - set(FLAT))
    if unknown:
        raise TypeError(f"TrainConfig got unknown fields {unknown} (the sections: {', '.join(SECTIONS)}; the flat "
                        "names: llamarl_core.pipeline.config.FLAT)")
    return sections, flat


def _before_the_loss_parameters(data: dict) -> dict:
    """A flat config.json's loss fields as a run of today reads them."""
    if "rho" in data and not any(name in data for name in ("eps_low", "eps_high", "mask_low", "mask_high",
                                                            "entropy_coef")):
        # A config.json from before the other loss parameters: it always held rho (4.0 by default), which set
        # only a statistic's threshold for the losses that do not read it. Kept where the loss reads it and it
        # differs from the loss's default.
        reads = DEFAULTS.get(data.get("loss", "aipo"), {})
        if "rho" not in reads or data["rho"] == reads["rho"]:
            data = {**data, "rho": None}
    if "loss_reduction" not in data and data.get("loss") == "gspo":
        # A config.json from before loss_reduction: every loss was a token mean then, gspo's too; a resumed
        # run keeps the loss it started with.
        data = {**data, "loss_reduction": "token_mean"}
    return data
