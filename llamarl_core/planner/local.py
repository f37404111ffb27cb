"""The local cost model: a `llamarl train` run (our generator, our trainer, the
controller, each executor a process) on this machine's CPU cores, predicted from
the machine's measured figures (Machine) and a few efficiency factors
(LOCAL_FACTORS) that `llamarl plan calibrate` fits on short probe runs (plain
arithmetic, no processes; pipeline/probes.py runs the probes).

What a step costs, per the way the pipeline runs (pipeline/rollout.py,
pipeline/learner.py, pipeline/executors/resources.py):

- Generation, per replica (its share n of the step's samples): `cap` decode steps
  (with n samples the longest reaches the completion budget) and a prefill per
  segment of `segment_tokens` (a weight update or new prompts rebuild the batch);
  each forward pays a fixed cost per layer (Python, dispatch) and, at tp > 1,
  2 x layers + 2 collectives (the embedding's and each row-parallel output's
  all-reduce, the logits' gather); the math (2 x parameters a token) at the
  measured one-thread matmul rate (a decode step's products are too small for
  more threads to help).
- Training, per trainer rank (its share of the samples, packed without padding):
  a forward and backward (3 forwards' math; a reference forward more with a KL
  penalty), a fixed cost per trainer step and per sample, Adam over its shard, and
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

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from .calibration import check_factors, from_factors, nelder_mead, read_calibration, to_factors
from .cost import Prediction
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


@dataclass(frozen=True)
class Machine:
    """This machine's measured figures (a local calibration's `machine`)."""

    cores: int
    matmul_gflops_1: float  # fp32 matmul GFLOP/s of one thread
    matmul_gflops_all: float  # of one process with a thread per core
    copy_GBps: float  # bytes read + written per second by a large memcpy
    memory_GiB: float

    @classmethod
    def from_dict(cls, data: dict, where: str) -> "Machine":
        names = [f for f in cls.__dataclass_fields__]
        if not isinstance(data, dict):
            raise PlanError(f"{where}: machine must be an object with {names}")
        bad = [n for n in names if isinstance(data.get(n), bool) or not isinstance(data.get(n), (int, float))
               or not data[n] > 0]
        unknown = sorted(set(data) - set(names))
        if bad or unknown:
            raise PlanError(f"{where}: machine needs a positive {', '.join(names)}; missing or not positive: {bad}, "
                            f"unknown: {unknown}")
        if data["cores"] != int(data["cores"]):
            raise PlanError(f"{where}: machine.cores must be an integer, got {data['cores']!r}")
        return cls(**{**data, "cores": int(data["cores"])})


@dataclass(frozen=True)
class LocalRun:
    """A `llamarl train` run as the local model sees it (LocalRun.from_config reads a config.json)."""

    name: str
    model: ModelShape
    mode: str
    prompts: int
    samples_per_prompt: int
    prompt_tokens: float  # mean, bos included
    new_tokens: float  # mean completion tokens, eos included
    cap: int  # the completion budget
    segment_tokens: int = 4
    max_staleness: int = 1
    generator_tp: int = 1
    replicas: int = 1
    trainer_world: int = 1
    weight_bytes: int = 4  # the generator's dtype
    reference_pass: bool = False  # a KL penalty: the reference policy's forward too
    assumptions: tuple = field(default=(), compare=False)

    @property
    def samples(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def generator_ranks(self) -> int:
        return self.generator_tp * self.replicas

    def with_placement(self, mode: str, generator_tp: int, replicas: int, trainer_world: int) -> "LocalRun":
        changed = LocalRun(self.name, self.model, mode, self.prompts, self.samples_per_prompt, self.prompt_tokens,
                           self.new_tokens, self.cap, self.segment_tokens,
                           (0 if mode == "sync" else max(1, self.max_staleness)), generator_tp, replicas,
                           trainer_world, self.weight_bytes, self.reference_pass, self.assumptions)
        check_local(changed)
        return changed

    def placement(self) -> dict:
        return {"mode": self.mode, "generator_tp": self.generator_tp, "generator_replicas": self.replicas,
                "trainer_world": self.trainer_world}


def check_local(run: LocalRun) -> None:
    """PlanError naming the setting that the pipeline would refuse (or that the
    model does not describe): a tensor-parallel degree that does not divide the
    heads, a trainer world that does not divide the prompts."""
    m = run.model
    if run.mode not in ("sync", "async"):
        raise PlanError(f"{run.name}: mode must be sync or async, got {run.mode!r}")
    for name in ("generator_tp", "replicas", "trainer_world", "prompts", "samples_per_prompt", "cap",
                 "segment_tokens"):
        value = getattr(run, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{run.name}: {name} must be a positive integer, got {value!r}")
    if m.heads % run.generator_tp or m.kv_heads % run.generator_tp:
        raise PlanError(f"{run.name}: generator tp {run.generator_tp} does not divide the model's {m.heads} heads "
                        f"and {m.kv_heads} key / value heads")
    if run.prompts % run.trainer_world:
        raise PlanError(f"{run.name}: trainer world {run.trainer_world} does not divide prompts_per_step "
                        f"{run.prompts}")
    if not 0 < run.new_tokens <= run.cap:
        raise PlanError(f"{run.name}: mean completion tokens {run.new_tokens} must be in (0, cap {run.cap}]")


class LocalModel:
    """Predictions of local runs from a Machine and factors (LOCAL_FACTORS' names)."""

    def __init__(self, machine: Machine, factors: dict, notes: tuple = ()):
        missing, extra = set(LOCAL_FACTORS) - set(factors), set(factors) - set(LOCAL_FACTORS)
        if missing or extra:
            raise PlanError(f"local factors: missing {sorted(missing)}, unknown {sorted(extra)}")
        self.machine, self.f, self.notes = machine, dict(factors), tuple(notes)

    def _rate(self, threads: int) -> float:
        """Measured matmul FLOP/s of one process with `threads` threads (between the
        one-thread and all-core rates, linearly)."""
        m = self.machine
        share = 0.0 if m.cores == 1 else (min(threads, m.cores) - 1) / (m.cores - 1)
        return (m.matmul_gflops_1 + share * (m.matmul_gflops_all - m.matmul_gflops_1)) * 1e9

    def _forward(self, layers: int) -> float:
        return self.f["forward_s"] * (layers + 2)  # the layers, the embedding and the head

    def generation(self, r: LocalRun, rate: float, parts: dict) -> float:
        """One replica's generating seconds a step; `rate`: the FLOP/s of one thread (a
        decode step's products are too small for more)."""
        m = r.model
        n = r.samples / r.replicas
        groups = r.prompts / r.replicas
        prefills = math.ceil(r.cap / r.segment_tokens)
        # The first prefill runs each prompt group once; the later ones every sample's prompt and prefix.
        tokens = groups * r.prompt_tokens + (prefills - 1) * n * (r.prompt_tokens + r.cap / 2) + n * r.new_tokens
        forwards = r.cap - 1 + prefills  # the longest's last token is sampled with no forward after it
        parts["forward fixed cost"] = forwards * self._forward(m.layers)
        parts["math"] = 2 * m.active_params * tokens / r.generator_tp / (rate * self.f["generation_efficiency"])
        parts["tp collectives"] = (forwards * (2 * m.layers + 2) * self.f["collective_s"]
                                   if r.generator_tp > 1 else 0.0)
        return sum(parts.values())

    def training(self, r: LocalRun, rate: float, parts: dict) -> float:
        """One trainer rank's seconds a step, its math at `rate` FLOP/s."""
        m, w = r.model, r.trainer_world
        tokens = r.samples / w * (r.prompt_tokens + r.new_tokens)
        passes = 3 + (1 if r.reference_pass else 0)
        parts["math"] = passes * 2 * m.active_params * tokens / (rate * self.f["train_efficiency"])
        parts["forward fixed cost"] = (2 + (1 if r.reference_pass else 0)) * self._forward(m.layers)
        parts["step fixed cost"] = self.f["train_step_s"]
        parts["per-sample cost"] = self.f["sample_s"] * r.samples / w
        parts["Adam"] = ADAM_BYTES * m.total_params / w / (self.machine.copy_GBps * 1e9)
        parts["FSDP collectives"] = 0.0
        if w > 1:  # per unit all-gathers (forward, backward) and a reduce-scatter, and their bytes
            traffic = 3 * m.total_params * 4 * (w - 1) / w / (self.machine.copy_GBps * 1e9)
            parts["FSDP collectives"] = (m.layers + 1) * self.f["fsdp_unit_s"] + traffic
        return sum(parts.values())

    def sync(self, r: LocalRun) -> float:
        pairs = r.trainer_world * r.generator_tp
        copies = r.model.total_params * r.weight_bytes * r.replicas
        return self.f["sync_s"] * pairs * r.replicas + copies / (self.machine.copy_GBps * 1e9)

    def generator_memory(self, r: LocalRun) -> float:
        """GiB one generator rank holds: its share of the weights and the KV cache of its batch."""
        m = r.model
        batch = max(1, r.max_staleness) * r.samples / r.replicas
        kv = batch * (r.prompt_tokens + r.cap) * m.layers * 2 * m.kv_heads * (m.hidden // m.heads) \
            * r.weight_bytes / r.generator_tp
        return (m.total_params * r.weight_bytes / r.generator_tp + kv) / GiB

    def trainer_memory(self, r: LocalRun) -> float:
        """GiB one trainer rank holds: its shard's weights, gradients and Adam's moments
        (FSDP2), the gathered weights while it computes, and the activations of its samples."""
        m, w = r.model, r.trainer_world
        tokens = r.samples / w * (r.prompt_tokens + r.new_tokens)
        activations = tokens * m.hidden * m.layers * ACTIVATION_BYTES + tokens * m.vocab * 4 * 2
        return (TRAINER_BYTES * m.total_params / w + (4 * m.total_params if w > 1 else 0) + activations) / GiB

    def _memory(self, r: LocalRun) -> dict:
        memory = {"generator": self.generator_memory(r), "trainer": self.trainer_memory(r)}
        total = memory["generator"] * r.generator_ranks + memory["trainer"] * r.trainer_world
        if total > self.machine.memory_GiB:
            raise PlanError(f"{r.name}: the executors need {total:.1f} GiB ({r.generator_ranks} generator ranks x "
                            f"{memory['generator']:.2f}, {r.trainer_world} trainer ranks x {memory['trainer']:.2f}) "
                            f"of this machine's {self.machine.memory_GiB:.1f} GiB")
        return memory

    @staticmethod
    def _slowed(phase, r: LocalRun, rate: float, slow: float, parts: dict) -> float:
        """`phase` at `rate`, all of it `slow` times slower (processes sharing its cores)."""
        phase(r, rate, parts)
        parts.update({k: v * slow for k, v in parts.items()})
        return sum(parts.values())

    def predict(self, r: LocalRun) -> Prediction:
        check_local(r)
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
            gen_alone = self.generation(r, self._rate(1), {})
            train_alone = self.training(r, self._rate(1), {})
            gen_slow = train_slow = 1.0
            for _ in range(30):  # each side slowed by the other's busy share of the step (a fixed point)
                gen, train = gen_alone * gen_slow, train_alone * train_slow
                step = max(gen, train) + sync + overhead
                gen_slow = 1.0 + self.f["time_sharing"] * (over - 1.0) * min(1.0, train / step)
                train_slow = 1.0 + self.f["time_sharing"] * (over - 1.0) * min(1.0, gen / step)
            gen = self._slowed(self.generation, r, self._rate(1), gen_slow, gen_parts)
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


# What a probe's summary gives the fit, and its weight: the step and each phase; the sync, a few
# milliseconds, at a quarter.
FIGURES = {"step_time_s": 1.0, "gen_time_s": 1.0, "train_time_s": 1.0, "sync_time_s": 0.25}
LOCAL_STARTS = ({"forward_s": 1e-4, "generation_efficiency": 0.3, "train_efficiency": 0.3, "collective_s": 1e-4,
                 "fsdp_unit_s": 1e-3, "time_sharing": 0.5, "train_step_s": 0.01, "sample_s": 1e-4, "sync_s": 1e-3,
                 "step_overhead_s": 0.005},
                {"forward_s": 3e-4, "generation_efficiency": 0.6, "train_efficiency": 0.6, "collective_s": 1e-3,
                 "fsdp_unit_s": 5e-3, "time_sharing": 0.9, "train_step_s": 0.003, "sample_s": 3e-5, "sync_s": 3e-4,
                 "step_overhead_s": 0.002})
KIND = "local"


def _figures(prediction: Prediction) -> dict:
    return {"step_time_s": prediction.step_time_s, "gen_time_s": prediction.gen_time_s,
            "train_time_s": prediction.train_time_s, "sync_time_s": prediction.sync_time_s}


def fit_local(machine: Machine, runs: list[tuple[LocalRun, dict]]) -> dict:
    """Factors for `runs` ((run, its measured FIGURES) on this machine), minimising
    the weighted sum of log(predicted / measured)^2 over the figures (Nelder-Mead
    from LOCAL_STARTS, the best restarted with smaller simplices); returns
    {"factors", "fit"} (the fit's median and largest step-time errors)."""
    if not runs:
        raise PlanError("fit: no probe runs")
    names = tuple(LOCAL_FACTORS)

    def model_of(z):
        return LocalModel(machine, to_factors(names, z, LOCAL_FACTORS))

    def loss(z):
        model, total = model_of(z), 0.0
        for run, measured in runs:
            predicted = _figures(model.predict(run))
            total += sum(weight * math.log(predicted[key] / measured[key]) ** 2 for key, weight in FIGURES.items())
        return total

    tried = [nelder_mead(loss, from_factors(names, start, LOCAL_FACTORS), iterations=800) for start in LOCAL_STARTS]
    z, value = min(tried, key=lambda pair: pair[1])
    for step in (0.5, 0.1):
        z, value = nelder_mead(loss, z, step=step, iterations=1000)
    model = model_of(z)
    errors = [model.predict(run).step_time_s / measured["step_time_s"] - 1 for run, measured in runs]
    return {"factors": model.f, "fit": {"runs": len(runs), "free_factors": len(names),
                                         "median_abs_step_error": statistics.median(abs(e) for e in errors),
                                         "max_abs_step_error": max(abs(e) for e in errors),
                                         "step_errors": {run.name: e for (run, _), e in zip(runs, errors)}}}


@dataclass
class LocalCalibration:
    """This machine's figures, the local factors fit on its probe runs, and the probes
    (each one's placement, shape and measured figures)."""

    machine: Machine
    factors: dict
    fit: dict = field(default_factory=dict)
    probes: list = field(default_factory=list)

    def model(self) -> LocalModel:
        return LocalModel(self.machine, self.factors, (
            f"local calibration: {len(self.probes)} probe runs on this machine, step time within "
            f"{self.fit.get('max_abs_step_error', float('nan')):.0%} of each probe",))

    def save(self, path) -> None:
        Path(path).write_text(json.dumps({"kind": KIND, "device": "cpu", "machine": self.machine.__dict__,
                                          "factors": self.factors, "fit": self.fit, "probes": self.probes},
                                         indent=1) + "\n")

    @classmethod
    def from_dict(cls, data, where: str) -> "LocalCalibration":
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise PlanError(f"{where}: not a local calibration (`llamarl plan calibrate` writes one); a GPU "
                            "calibration predicts rows in the published-runs format, not a `llamarl train` run")
        machine = Machine.from_dict(data.get("machine"), where)
        factors = data.get("factors")
        if not isinstance(factors, dict):
            raise PlanError(f"{where}: factors must be an object")
        check_factors(factors, LOCAL_FACTORS, where)
        LocalModel(machine, factors)  # every factor present
        fit_info, probes = data.get("fit") or {}, data.get("probes") or []
        if not isinstance(fit_info, dict) or not isinstance(probes, list):
            raise PlanError(f"{where}: fit must be an object and probes a list")
        return cls(machine, dict(factors), fit_info, probes)

    @classmethod
    def load(cls, path) -> "LocalCalibration":
        return cls.from_dict(read_calibration(path), f"--calibration {path}")


def placements(run: LocalRun, cores: int) -> list[LocalRun]:
    """`run` under every placement the pipeline takes on `cores` cores: sync and
    async, generator tp dividing the heads and key / value heads (up to the cores),
    1 to `cores` replicas, trainer worlds dividing the prompts (up to the cores),
    at most two ranks a core."""
    m = run.model
    out = []
    for mode in ("async", "sync"):
        for tp in range(1, cores + 1):
            if m.heads % tp or m.kv_heads % tp:
                continue
            for replicas in range(1, cores + 1):
                for world in range(1, cores + 1):
                    if run.prompts % world or tp * replicas + world > 2 * cores:
                        continue
                    out.append(run.with_placement(mode, tp, replicas, world))
    return out


def choose_local(model: LocalModel, run: LocalRun, top: int = 5) -> list[tuple[LocalRun, Prediction]]:
    """The `top` placements of `run` (placements()) with the lowest predicted step
    time that fit in memory, best first."""
    ranked = []
    for candidate in placements(run, model.machine.cores):
        try:
            ranked.append((candidate, model.predict(candidate)))
        except PlanError:
            continue  # does not fit
    ranked.sort(key=lambda pair: pair[1].step_time_s)
    return ranked[:top]


def describe_local(run: LocalRun) -> str:
    return (f"{run.mode} generator tp {run.generator_tp} x {run.replicas} replica{'s' if run.replicas > 1 else ''}, "
            f"trainer world {run.trainer_world}")
