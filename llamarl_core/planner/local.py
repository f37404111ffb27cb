"""The local cost model: a `llamarl train` run (our generator, our trainer, the
controller, each executor a process) on this machine's CPU cores, predicted from
the machine's measured figures (Machine) and a few efficiency factors
(LOCAL_FACTORS) that `llamarl plan calibrate` fits on short probe runs (plain
arithmetic, no processes; pipeline/probes.py runs the probes).

What a step costs, per the way the pipeline runs (pipeline/rollout.py,
pipeline/learner.py, pipeline/executors/resources.py):

- Generation, per replica (its share n of the step's samples): `cap` decode steps
  (with n samples the longest reaches the completion budget), one prefill of the
  step's prompt groups, and in async mode one more of every running sample when
  the next version lands while the batch decodes (as likely as the generator is
  busy in the step: measured, a batch that ends before the update is not
  re-prefilled);
  each forward pays a fixed cost per layer (Python, dispatch) and, at tp > 1,
  2 x layers + 2 collectives (the embedding's and each row-parallel output's
  all-reduce, the logits' gather); the math (2 x parameters a token) at the
  measured one-thread matmul rate (a decode step's products are too small for
  more threads to help).
- Training, per trainer rank (its share of the samples, packed without padding):
  a forward and backward (3 forwards' math; a reference forward more with a KL
  penalty), a fixed cost per trainer step and per sample, a forward's fixed cost
  per micro-batch, Adam over its shard, and
  at world > 1 FSDP2's all-gathers (forward and backward) and reduce-scatter per
  unit (each layer and the root).
- Weight sync: a fixed cost per trainer x generator rank pair and the bytes of
  every replica's copy at the measured copy rate.
- Cores: in async mode every executor has one thread, pinned to a core of its own
  when the ranks fit the cores; when they do not, the two sides time-share: each
  side's time grows with the other's busy share of the step (by time_sharing).
  In sync mode each phase's ranks share every core, cores // ranks threads each.
- Step: sync mode gen + train + sync + overhead; async (staleness >= 1)
  max(gen, train) + sync + overhead (the sync stalls the generator).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .cost import Prediction, check_factors
from .devices import PlanError
from .shapes import ModelShape

GiB = 2**30
LOCAL_FACTORS = {
    "forward_s": (1e-6, 5e-3, "seconds of Python and dispatch per layer of a forward pass"),
    "generation_efficiency": (0.02, 1.0, "fraction of the measured one-thread matmul FLOP/s a generator's math reaches"),
    "train_efficiency": (0.02, 1.0, "fraction of the measured matmul FLOP/s a trainer's forward and backward reach"),
    "collective_s": (1e-6, 5e-3, "seconds per tensor-parallel collective of the generator (gloo)"),
    "fsdp_unit_s": (1e-6, 0.05, "seconds per FSDP unit (a layer, the root) and step: its all-gathers and "
                                "reduce-scatter (gloo)"),
    "time_sharing": (0.0, 1.0, "how much of the other side's busy share slows a side when the async ranks "
                               "outnumber the cores (1: plain time-slicing)"),
    "train_step_s": (0.0, 0.5, "fixed seconds per trainer step (the loss, the optimizer's bookkeeping)"),
    "sample_s": (0.0, 0.01, "seconds per trained sample beyond its math (collation, packing, per-sample statistics)"),
    "sync_s": (1e-5, 0.1, "fixed seconds of a weight sync per trainer x generator rank pair"),
    "step_overhead_s": (0.0, 0.5, "fixed seconds per step the controller adds (rewards, messages)"),
}
ADAM_BYTES = 32  # read and written per parameter by an AdamW step (weight, gradient, two moments; fp32)
TRAINER_BYTES = 16  # per parameter a trainer rank holds of its shard: fp32 weight, gradient, two moments
ACTIVATION_BYTES = 34 * 4  # per token and hidden unit kept for the backward, in fp32 (~34 elements, Korthikanti et al.)
LOGIT_BYTES = 4 * 2  # per token and vocabulary entry: the fp32 logits and their gradient


@dataclass(frozen=True)
class Machine:
    """This machine's measured figures (a local calibration's `machine`)."""

    cores: int
    matmul_gflops_1: float  # fp32 matmul GFLOP/s of one thread
    matmul_gflops_all: float  # of one process with a thread per core
    copy_GBps: float  # bytes read + written per second by a large memcpy
    memory_GiB: float

    def __post_init__(self):
        names = [f.name for f in dataclasses.fields(self)]
        bad = [n for n in names if isinstance(getattr(self, n), bool) or not isinstance(getattr(self, n), (int, float))
               or not 0 < getattr(self, n) < math.inf]
        if bad:
            raise PlanError(f"machine: {', '.join(bad)} must be positive finite numbers, got "
                            f"{ {n: getattr(self, n) for n in bad} }")
        if not isinstance(self.cores, int):
            raise PlanError(f"machine: cores must be an integer, got {self.cores!r}")

    @classmethod
    def from_dict(cls, data, where: str) -> "Machine":
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, dict) or set(data) != set(names):
            raise PlanError(f"{where}: machine must be an object with exactly {names}, got {data!r}")
        try:
            return cls(**{**data, "cores": int(data["cores"]) if data["cores"] == int(data["cores"]) else
                          data["cores"]})
        except (TypeError, ValueError, OverflowError, PlanError) as exc:
            raise PlanError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class LocalRun:
    """A `llamarl train` run as the local model sees it (pipeline/plan_local.local_run
    reads one from a TrainConfig). tp_choices: the generator tp sizes the pipeline
    takes for this model (its heads, MLP and padded vocabulary divide), which a
    placement may use; micro_batch: samples per forward and backward (0: all of a
    rank's at once). Every field is checked here: PlanError naming it."""

    name: str
    model: ModelShape
    mode: str
    prompts: int
    samples_per_prompt: int
    prompt_tokens: float  # mean, bos included
    new_tokens: float  # mean completion tokens, eos included
    cap: int  # the completion budget
    max_staleness: int = 1  # 0 in sync mode
    generator_tp: int = 1
    generator_replicas: int = 1
    trainer_world: int = 1
    weight_bytes: int = 4  # the generator's dtype
    reference_pass: bool = False  # a KL penalty: the reference policy's forward too
    micro_batch: int = 0
    tp_choices: tuple = (1,)
    assumptions: tuple = field(default=(), compare=False)

    def __post_init__(self):
        name = self.name
        if self.mode not in ("sync", "async"):
            raise PlanError(f"{name}: mode must be sync or async, got {self.mode!r}")
        for key in ("prompts", "samples_per_prompt", "cap", "generator_tp", "generator_replicas", "trainer_world"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name}: {key} must be a positive integer, got {value!r}")
        if self.samples_per_prompt < 2:
            raise PlanError(f"{name}: samples_per_prompt must be >= 2 (a group), got {self.samples_per_prompt}")
        for key in ("micro_batch", "max_staleness"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanError(f"{name}: {key} must be an integer >= 0, got {value!r}")
        if (self.mode == "sync") != (self.max_staleness == 0):
            raise PlanError(f"{name}: max_staleness {self.max_staleness} with mode {self.mode!r} (sync is 0, "
                            "async >= 1)")
        if self.weight_bytes not in (1, 2, 4):
            raise PlanError(f"{name}: weight_bytes must be 1, 2 or 4, got {self.weight_bytes!r}")
        if not (isinstance(self.prompt_tokens, (int, float)) and 1 <= self.prompt_tokens < math.inf):
            raise PlanError(f"{name}: prompt_tokens (the mean) must be a number >= 1, got {self.prompt_tokens!r}")
        if not (isinstance(self.new_tokens, (int, float)) and 0 < self.new_tokens <= self.cap):
            raise PlanError(f"{name}: mean completion tokens {self.new_tokens!r} must be in (0, cap {self.cap}]")
        if not self.tp_choices or self.generator_tp not in self.tp_choices:
            raise PlanError(f"{name}: generator tp {self.generator_tp} is not one the model takes "
                            f"({', '.join(map(str, self.tp_choices))}: its heads, MLP and padded vocabulary "
                            "divide)")
        if self.prompts % self.trainer_world:
            raise PlanError(f"{name}: trainer world {self.trainer_world} does not divide prompts_per_step "
                            f"{self.prompts}")

    @property
    def samples(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def generator_ranks(self) -> int:
        return self.generator_tp * self.generator_replicas

    def micro_batches(self) -> int:
        """Forward and backward passes a trainer rank makes a step."""
        share = self.samples // self.trainer_world
        return math.ceil(share / self.micro_batch) if self.micro_batch else 1

    def with_placement(self, mode: str, generator_tp: int, generator_replicas: int,
                       trainer_world: int) -> "LocalRun":
        """This run under another placement (checked); async keeps the run's staleness bound (or 1)."""
        return dataclasses.replace(self, mode=mode, generator_tp=generator_tp, generator_replicas=generator_replicas,
                                   trainer_world=trainer_world,
                                   max_staleness=0 if mode == "sync" else max(1, self.max_staleness))

    def placement(self) -> dict:
        return {"mode": self.mode, "generator_tp": self.generator_tp, "generator_replicas": self.generator_replicas,
                "trainer_world": self.trainer_world}


class LocalModel:
    """Predictions of local runs from a Machine and factors (LOCAL_FACTORS' names,
    each within its bounds)."""

    def __init__(self, machine: Machine, factors: dict, notes: tuple = ()):
        missing = set(LOCAL_FACTORS) - set(factors)
        if missing:
            raise PlanError(f"local factors: missing {sorted(missing)}")
        check_factors(factors, LOCAL_FACTORS, "local factors")
        self.machine, self.f, self.notes = machine, dict(factors), tuple(notes)

    def _rate(self, threads: int) -> float:
        """Measured matmul FLOP/s of one process with `threads` threads (between the
        one-thread and all-core rates, linearly)."""
        m = self.machine
        share = 0.0 if m.cores == 1 else (min(threads, m.cores) - 1) / (m.cores - 1)
        return (m.matmul_gflops_1 + share * (m.matmul_gflops_all - m.matmul_gflops_1)) * 1e9

    def _forward(self, layers: int) -> float:
        return self.f["forward_s"] * (layers + 2)  # the layers, the embedding and the head

    def generation(self, r: LocalRun, rate: float, parts: dict, refills: float = 0.0) -> float:
        """One replica's generating seconds a step; `rate`: the FLOP/s of one thread (a
        decode step's products are too small for more); `refills`: expected re-prefills
        of every running sample (a version landing mid-batch)."""
        m = r.model
        n = r.samples / r.generator_replicas
        groups = r.prompts / r.generator_replicas
        # The step's prompt groups once each, the generated tokens, and a re-prefill's prompts and prefixes.
        tokens = groups * r.prompt_tokens + n * r.new_tokens + refills * n * (r.prompt_tokens + r.cap / 2)
        forwards = r.cap + refills  # a prefill, then a forward per token but the longest's last
        parts["forward fixed cost"] = forwards * self._forward(m.layers)
        parts["math"] = 2 * m.active_params * tokens / r.generator_tp / (rate * self.f["generation_efficiency"])
        parts["tp collectives"] = (forwards * (2 * m.layers + 2) * self.f["collective_s"]
                                   if r.generator_tp > 1 else 0.0)
        return sum(parts.values())

    def training(self, r: LocalRun, rate: float, parts: dict) -> float:
        """One trainer rank's seconds a step, its math at `rate` FLOP/s."""
        m, w = r.model, r.trainer_world
        tokens = r.samples / w * (r.prompt_tokens + r.new_tokens)
        forwards = 2 + (1 if r.reference_pass else 0)  # a backward costs about a forward's fixed cost
        parts["math"] = (forwards + 1) * 2 * m.active_params * tokens / (rate * self.f["train_efficiency"])
        parts["forward fixed cost"] = forwards * r.micro_batches() * self._forward(m.layers)
        parts["step fixed cost"] = self.f["train_step_s"]
        parts["per-sample cost"] = self.f["sample_s"] * r.samples / w
        parts["Adam"] = ADAM_BYTES * m.total_params / w / (self.machine.copy_GBps * 1e9)
        parts["FSDP collectives"] = 0.0
        if w > 1:  # per unit all-gathers (forward, backward) and a reduce-scatter, and their bytes
            traffic = 3 * m.total_params * 4 * (w - 1) / w / (self.machine.copy_GBps * 1e9)
            parts["FSDP collectives"] = (m.layers + 1) * r.micro_batches() * self.f["fsdp_unit_s"] + traffic
        return sum(parts.values())

    def sync(self, r: LocalRun) -> float:
        pairs = r.trainer_world * r.generator_tp
        copies = r.model.total_params * r.weight_bytes * r.generator_replicas
        return self.f["sync_s"] * pairs * r.generator_replicas + copies / (self.machine.copy_GBps * 1e9)

    def generator_memory(self, r: LocalRun) -> float:
        """GiB one generator rank holds: its share of the weights and the KV cache of its batch."""
        m = r.model
        batch = max(1, r.max_staleness) * r.samples / r.generator_replicas
        kv = batch * (r.prompt_tokens + r.cap) * m.layers * m.kv_bytes_per_token_layer / 2 * r.weight_bytes \
            / min(r.generator_tp, m.kv_heads)  # beyond the kv heads, each rank holds a head of its own
        return (m.total_params * r.weight_bytes / r.generator_tp + kv) / GiB

    def trainer_memory(self, r: LocalRun) -> float:
        """GiB one trainer rank holds: its shard's weights, gradients and Adam's moments
        (FSDP2), the gathered weights while it computes, the reference policy's weights
        (a KL penalty), and one micro-batch's activations and logits."""
        m, w = r.model, r.trainer_world
        tokens = r.samples / w / r.micro_batches() * (r.prompt_tokens + r.new_tokens)
        activations = tokens * (m.hidden * m.layers * ACTIVATION_BYTES + m.vocab * LOGIT_BYTES)
        weights = TRAINER_BYTES * m.total_params / w + (4 * m.total_params if w > 1 else 0) \
            + (4 * m.total_params if r.reference_pass else 0)
        return (weights + activations) / GiB

    def _memory(self, r: LocalRun) -> dict:
        memory = {"generator": self.generator_memory(r), "trainer": self.trainer_memory(r)}
        total = memory["generator"] * r.generator_ranks + memory["trainer"] * r.trainer_world
        if total > self.machine.memory_GiB:
            raise PlanError(f"{r.name}: the executors need {total:.1f} GiB ({r.generator_ranks} generator ranks x "
                            f"{memory['generator']:.2f}, {r.trainer_world} trainer ranks x {memory['trainer']:.2f}) "
                            f"of this machine's {self.machine.memory_GiB:.1f} GiB")
        return memory

    @staticmethod
    def _slowed(phase, r: LocalRun, rate: float, slow: float, parts: dict, **extra) -> float:
        """`phase` at `rate`, all of it `slow` times slower (processes sharing its cores)."""
        phase(r, rate, parts, **extra)
        parts.update({k: v * slow for k, v in parts.items()})
        return sum(parts.values())

    def predict(self, r: LocalRun) -> Prediction:
        memory = self._memory(r)
        cores = self.machine.cores
        gen_parts: dict = {}
        train_parts: dict = {}
        sync = self.sync(r)
        overhead = self.f["step_overhead_s"]
        if r.mode == "sync":  # each phase alone: its ranks share the cores, cores // ranks threads each
            g, t = r.generator_ranks, r.trainer_world
            gen = self._slowed(self.generation, r, self._rate(1), max(1.0, g / cores), gen_parts)
            train = self._slowed(self.training, r, self._rate(max(1, cores // t)), max(1.0, t / cores), train_parts)
            step = gen + train + sync + overhead
        else:
            over = max(1.0, (r.generator_ranks + r.trainer_world) / cores)  # > 1: unpinned, the sides time-share
            train_alone = self.training(r, self._rate(1), {})
            gen_slow = train_slow = 1.0
            refills = 0.0
            for _ in range(30):  # a fixed point: each side slowed by the other's busy share of the step
                gen = self.generation(r, self._rate(1), {}, refills) * gen_slow
                train = train_alone * train_slow
                step = max(gen, train) + sync + overhead
                refills = min(1.0, gen / step)  # the next version lands while the batch decodes
                gen_slow = 1.0 + self.f["time_sharing"] * (over - 1.0) * min(1.0, train / step)
                train_slow = 1.0 + self.f["time_sharing"] * (over - 1.0) * min(1.0, gen / step)
            gen = self._slowed(self.generation, r, self._rate(1), gen_slow, gen_parts, refills=refills)
            train = self._slowed(self.training, r, self._rate(1), train_slow, train_parts)
            sync *= max(gen_slow, train_slow)
            step = max(gen, train) + sync + overhead
        return self._prediction(r, step, gen, train, sync, overhead, memory, gen_parts, train_parts)

    def _prediction(self, r, step, gen, train, sync, overhead, memory, gen_parts, train_parts) -> Prediction:
        overlapped = r.mode == "async"
        terms = {"generation": gen, "training": train, "weight sync": sync, "fixed step cost": overhead}
        if overlapped:
            side, side_time, inner = (("generation", gen, gen_parts) if gen >= train
                                      else ("training", train, train_parts))
            top = max(inner, key=inner.get)
            bottleneck = (f"{side} ({side_time * 1e3:.1f} ms against {min(gen, train) * 1e3:.1f} ms for the other "
                          f"side; {top} {inner[top] / side_time:.0%} of it)")
        else:
            side = max(terms, key=terms.get)
            bottleneck = f"{side} ({terms[side] / step:.0%} of the step"
            inner = {"generation": gen_parts, "training": train_parts}.get(side)
            if inner:
                top = max(inner, key=inner.get)
                bottleneck += f"; {top} {inner[top] / terms[side]:.0%} of it"
            bottleneck += ")"
        assumptions = [text for _, text in r.assumptions] + list(self.notes) + [
            f"{self.machine.cores} cores; async ranks pinned to a core each when they fit, else time-shared",
            f"generation: {r.cap} decode steps a step (the longest of the batch reaches the budget)",
        ]
        breakdown = {"generation": gen_parts, "training": train_parts, "step": {**terms, "overlapped": overlapped}}
        return Prediction(step, gen, train, sync, 0.0, memory, bottleneck, assumptions, breakdown)


def placements(run: LocalRun, cores: int) -> list[LocalRun]:
    """`run` under every placement the pipeline takes on `cores` cores: sync and
    async, generator tp of the run's tp_choices up to the cores, 1 to `cores`
    replicas, trainer worlds dividing the prompts up to the cores, at most two ranks
    a core."""
    out = []
    for mode in ("async", "sync"):
        for tp in (tp for tp in run.tp_choices if tp <= cores):
            for replicas in range(1, cores + 1):
                for world in range(1, cores + 1):
                    if run.prompts % world or tp * replicas + world > 2 * cores:
                        continue
                    out.append(run.with_placement(mode, tp, replicas, world))
    return out


def choose_local(model: LocalModel, run: LocalRun, top: int = 5) -> list[tuple[LocalRun, Prediction]]:
    """The `top` placements of `run` (placements()) with the lowest predicted step
    time that fit in memory, best first; PlanError when none fits."""
    ranked, why = [], None
    for candidate in placements(run, model.machine.cores):
        try:
            ranked.append((candidate, model.predict(candidate)))
        except PlanError as exc:  # does not fit
            why = exc
    if not ranked:
        raise PlanError(f"{run.name}: no placement fits on this machine ({why})")
    ranked.sort(key=lambda pair: pair[1].step_time_s)
    return ranked[:top]


def describe_local(run: LocalRun) -> str:
    replicas = run.generator_replicas
    return (f"{run.mode} generator tp {run.generator_tp} x {replicas} replica{'s' if replicas > 1 else ''}, "
            f"trainer world {run.trainer_world}")
