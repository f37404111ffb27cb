"""What the planner is asked about: a model on a cluster, a placement with each
side's parallelism and precision, and a batch (Scenario), read from a row in the
published-runs format (../shared/published-runs/calibration.json's field names).

Parallelism follows Megatron's convention, as the published runs state it: the
trainer's tp x cp x pp x dp = its GPUs, and expert parallelism folds into the
data-, context- and tensor-parallel ranks (ep divides dp x cp x tp). The
generator is tp-way tensor parallel with gpus / tp replicas. Placement "sync":
generation and training take turns on all `gpus`; "async": generator_gpus and
trainer_gpus apart, samples at most max_staleness versions old.

Every field is checked here, before any arithmetic: PlanError naming the field
(and the row). Settings a row leaves out take the defaults below, each one said
in Scenario.assumptions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from .devices import Device, PlanError, device
from .shapes import MAX_INT, ModelShape, model_shape

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
ROW_KEYS = {"name", "source", "model", "hf_config", "gpu", "gpus_per_node", "placement", "generator", "trainer",
            "batch", "measured", "cluster", "sync", "notes"}
PLACEMENT_KEYS = {"mode", "gpus", "generator_gpus", "trainer_gpus", "max_staleness"}
GENERATOR_KEYS = {"tp", "dtype"}
TRAINER_KEYS = {"tp", "pp", "cp", "ep", "dtype"}
BATCH_KEYS = {"prompts", "samples_per_prompt", "train_global_batch", "prompt_tokens", "mean_new_tokens",
              "max_total_tokens", "logprob_passes"}
CLUSTER_KEYS = {"nvlink_GBps", "nic_GBps", "host_GBps"}
SYNC_KEYS = {"delta_fraction"}
# What a row may leave out, and what the planner then assumes (said with every result).
DEFAULTS = {
    "generator.dtype": ("bf16", "generator weights in bf16"),
    "trainer.dtype": ("bf16", "trainer computes in bf16"),
    "trainer.pp": (1, "trainer pp 1"), "trainer.cp": (1, "trainer cp 1"), "trainer.ep": (1, "trainer ep 1"),
    "placement.max_staleness": (1, "async samples at most 1 version old (overlap of one step)"),
    "batch.logprob_passes": (2, "two forward passes for log-probs before training (old and reference policies)"),
    "batch.train_global_batch": (None, "one optimizer step per step (train_global_batch = all samples)"),
}
PLACED = ("trainer.pp", "trainer.ep")  # settings a placement search chooses (search.py: cp kept as given)


@dataclass(frozen=True)
class Side:
    """One side's parallelism and precision. The generator uses tp alone."""

    gpus: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dtype: str = "bf16"

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)

    @property
    def weight_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Batch:
    prompts: int
    samples_per_prompt: int
    train_global_batch: int
    prompt_tokens: int
    mean_new_tokens: float
    max_total_tokens: int
    logprob_passes: int = 2

    @property
    def samples(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def optimizer_steps(self) -> int:
        return math.ceil(self.samples / self.train_global_batch)

    @property
    def cap(self) -> int:
        """The longest completion: the token cap less the prompt."""
        return self.max_total_tokens - self.prompt_tokens


@dataclass(frozen=True)
class Scenario:
    name: str
    model: ModelShape
    device: Device
    gpus_per_node: int
    mode: str  # "sync" or "async"
    generator: Side
    trainer: Side
    batch: Batch
    max_staleness: int = 1
    delta_fraction: float | None = None  # delta weight sync: the fraction of elements a version changes
    # (setting, what is assumed) for each setting the row left out: "trainer.pp", "trainer pp 1"
    assumptions: tuple = field(default=(), compare=False)

    @property
    def gpus(self) -> int:
        """GPUs the run holds: all of them for both phases in sync mode, the two sides' sum in async."""
        return self.generator.gpus if self.mode == "sync" else self.generator.gpus + self.trainer.gpus

    def with_placement(self, mode: str, generator: Side, trainer: Side, max_staleness: int | None = None
                       ) -> "Scenario":
        """This scenario with another placement, checked as a row's would be (the
        placement's settings no longer assumed: they are given)."""
        given = set(PLACED) | ({"placement.max_staleness"} if max_staleness is not None else set())
        changed = Scenario(self.name, self.model, self.device, self.gpus_per_node, mode, generator, trainer,
                           self.batch, self.max_staleness if max_staleness is None else max_staleness,
                           self.delta_fraction, tuple(a for a in self.assumptions if a[0] not in given))
        check(changed)
        return changed


def _section(row: dict, key: str, allowed: set, name: str) -> dict:
    value = row.get(key, {})
    if not isinstance(value, dict):
        raise PlanError(f"{name}: {key} must be an object, got {type(value).__name__}")
    unknown = set(value) - allowed
    if unknown:
        raise PlanError(f"{name}: {key} has unknown field(s) {sorted(unknown)}; it takes {sorted(allowed)}")
    return value


def _positive_int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_INT:
        raise PlanError(f"{where} must be a positive integer, at most 2**53, got {value!r}")
    return value


def _get(section: dict, key: str, where: str, assumptions: list, *, required: bool = False):
    if key in section:
        return section[key]
    default = DEFAULTS.get(where)
    if required or default is None:
        raise PlanError(f"{where} is missing")
    assumptions.append((where, default[1]))
    return default[0]


def from_row(row: dict, measured_specs: dict | None = None, base: Path | None = None) -> Scenario:
    """The Scenario of one row in the published-runs format (its `measured` is
    ignored here). `measured_specs`: a calibration's device figures, for "cpu";
    `base`: the folder a relative hf_config path is read from (the scenario
    file's). PlanError naming the row and the field for anything it cannot describe."""
    if not isinstance(row, dict):
        raise PlanError(f"a scenario is a JSON object, got {type(row).__name__}")
    name = str(row.get("name", "scenario"))
    unknown = set(row) - ROW_KEYS
    if unknown:
        raise PlanError(f"{name}: unknown field(s) {sorted(unknown)}; a row takes {sorted(ROW_KEYS)}")
    for key in ("hf_config", "gpu", "placement", "generator", "trainer", "batch"):
        if key not in row:
            raise PlanError(f"{name}: {key} is missing")
    assumptions: list[tuple[str, str]] = []
    source = row["hf_config"]
    if isinstance(source, str) and base is not None and not Path(source).is_absolute():
        source = Path(base) / source
    try:
        model = model_shape(source)
    except PlanError as exc:
        raise PlanError(f"{name}: {exc}") from None
    cluster = _section(row, "cluster", CLUSTER_KEYS, name)
    for key, value in cluster.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.1 <= value <= 100_000:
            raise PlanError(f"{name}: cluster.{key} must be a number of GB/s in [0.1, 100000], got {value!r}")
    specs = {k: float(v) for k, v in cluster.items()}
    dev = device(row["gpu"], {**(measured_specs or {}), **specs} or None)
    gpus_per_node = _positive_int(row.get("gpus_per_node", 8), f"{name}: gpus_per_node")
    if "gpus_per_node" not in row:
        assumptions.append(("gpus_per_node", "8 GPUs per node"))
    placement = _section(row, "placement", PLACEMENT_KEYS, name)
    gen = _section(row, "generator", GENERATOR_KEYS, name)
    tr = _section(row, "trainer", TRAINER_KEYS, name)
    batch_in = _section(row, "batch", BATCH_KEYS, name)
    sync = _section(row, "sync", SYNC_KEYS, name)
    mode = placement.get("mode")
    if mode not in ("sync", "async"):
        raise PlanError(f"{name}: placement.mode must be 'sync' or 'async', got {mode!r}")
    if mode == "sync":
        gpus = _positive_int(placement.get("gpus"), f"{name}: placement.gpus")
        for key in ("generator_gpus", "trainer_gpus"):
            if placement.get(key, gpus) != gpus:
                raise PlanError(f"{name}: placement.{key} {placement[key]} in sync mode, where both phases take "
                                f"turns on all {gpus} GPUs")
        gen_gpus = train_gpus = gpus
        staleness = 0
    else:
        gen_gpus = _positive_int(placement.get("generator_gpus"), f"{name}: placement.generator_gpus")
        train_gpus = _positive_int(placement.get("trainer_gpus"), f"{name}: placement.trainer_gpus")
        if placement.get("gpus", gen_gpus + train_gpus) != gen_gpus + train_gpus:
            raise PlanError(f"{name}: placement.gpus {placement['gpus']} is not generator_gpus + trainer_gpus "
                            f"({gen_gpus} + {train_gpus})")
        staleness = _get(placement, "max_staleness", "placement.max_staleness", assumptions)
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise PlanError(f"{name}: placement.max_staleness must be an integer >= 0, got {staleness!r}")
    sides = []
    for section, side_name, gpus in ((gen, "generator", gen_gpus), (tr, "trainer", train_gpus)):
        values = {"gpus": gpus, "tp": _positive_int(_get(section, "tp", f"{side_name}.tp", assumptions,
                                                         required=True), f"{name}: {side_name}.tp")}
        if side_name == "trainer":
            for key in ("pp", "cp", "ep"):
                values[key] = _positive_int(_get(section, key, f"trainer.{key}", assumptions),
                                            f"{name}: trainer.{key}")
        dtype = _get(section, "dtype", f"{side_name}.dtype", assumptions)
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise PlanError(f"{name}: {side_name}.dtype {dtype!r}: one of {sorted(DTYPE_BYTES)}")
        sides.append(Side(dtype=dtype, **values))
    batch_values = {}
    for key in ("prompts", "samples_per_prompt", "prompt_tokens", "max_total_tokens"):
        batch_values[key] = _positive_int(batch_in.get(key), f"{name}: batch.{key}")
    mean = batch_in.get("mean_new_tokens")
    if isinstance(mean, bool) or not isinstance(mean, (int, float)) or not 0 < mean <= MAX_INT:
        raise PlanError(f"{name}: batch.mean_new_tokens must be a positive number, at most 2**53, got {mean!r}")
    samples = batch_values["prompts"] * batch_values["samples_per_prompt"]
    global_batch = batch_in.get("train_global_batch")
    if global_batch is None:
        assumptions.append(("batch.train_global_batch", DEFAULTS["batch.train_global_batch"][1]))
        global_batch = samples
    batch_values["train_global_batch"] = _positive_int(global_batch, f"{name}: batch.train_global_batch")
    if batch_values["train_global_batch"] > samples:
        raise PlanError(f"{name}: batch.train_global_batch {global_batch} is more than the step's {samples} samples "
                        "(prompts x samples_per_prompt)")
    batch_values["logprob_passes"] = _get(batch_in, "logprob_passes", "batch.logprob_passes", assumptions)
    passes = batch_values["logprob_passes"]
    if isinstance(passes, bool) or not isinstance(passes, int) or passes not in (0, 1, 2):
        raise PlanError(f"{name}: batch.logprob_passes must be 0, 1 or 2, got {batch_values['logprob_passes']!r}")
    batch = Batch(mean_new_tokens=float(mean), **batch_values)
    delta = sync.get("delta_fraction")
    if delta is not None and (isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 <= delta <= 1):
        raise PlanError(f"{name}: sync.delta_fraction must be in [0, 1], got {delta!r}")
    scenario = Scenario(name, model, dev, gpus_per_node, mode, sides[0], sides[1], batch, staleness,
                        None if delta is None else float(delta), tuple(assumptions))
    check(scenario)
    return scenario


def check_generator(s: Scenario) -> None:
    """PlanError unless the generator's tp divides its GPUs and the model's heads."""
    _check_tp(s, "generator", s.generator.tp)
    if s.generator.gpus % s.generator.tp:
        raise PlanError(f"{s.name}: generator.tp {s.generator.tp} does not divide the generator's {s.generator.gpus} "
                        "GPUs")


def check_trainer(s: Scenario) -> None:
    """PlanError naming what does not divide: tp x cp x pp against the trainer's
    GPUs, tp against the heads, pp against the layers, ep against the experts and
    dp x cp x tp, the global batch against dp."""
    name, m, t, b = s.name, s.model, s.trainer, s.batch
    if t.gpus % (t.tp * t.cp * t.pp):
        raise PlanError(f"{name}: trainer tp x cp x pp = {t.tp * t.cp * t.pp} does not divide the trainer's "
                        f"{t.gpus} GPUs")
    _check_tp(s, "trainer", t.tp)
    if t.pp > m.layers:
        raise PlanError(f"{name}: trainer.pp {t.pp} is more than the model's {m.layers} layers")
    if t.ep > 1:
        if not m.moe:
            raise PlanError(f"{name}: trainer.ep {t.ep} on a dense model ({m.model_type}, no experts)")
        if m.experts % t.ep:
            raise PlanError(f"{name}: trainer.ep {t.ep} does not divide the model's {m.experts} experts")
        if (t.dp * t.cp * t.tp) % t.ep:
            raise PlanError(f"{name}: trainer.ep {t.ep} does not divide dp x cp x tp = {t.dp * t.cp * t.tp} "
                            "(experts fold into the data-, context- and tensor-parallel ranks)")
    if b.train_global_batch % t.dp:
        raise PlanError(f"{name}: batch.train_global_batch {b.train_global_batch} is not a multiple of the "
                        f"trainer's data-parallel size {t.dp}")


def _check_tp(s: Scenario, side: str, tp: int) -> None:
    m = s.model
    if m.heads % tp:
        raise PlanError(f"{s.name}: {side}.tp {tp} does not divide the model's {m.heads} attention heads")
    if not m.mla and m.kv_heads % tp and tp % m.kv_heads:
        raise PlanError(f"{s.name}: {side}.tp {tp} and the model's {m.kv_heads} KV heads: neither divides the other")


def check(s: Scenario) -> None:
    """PlanError naming what does not divide or does not hold: each side's
    parallelism (check_generator, check_trainer), the batch against its caps."""
    name, b = s.name, s.batch
    if s.mode not in ("sync", "async"):
        raise PlanError(f"{name}: mode {s.mode!r}")
    check_generator(s)
    check_trainer(s)
    if b.prompt_tokens >= b.max_total_tokens:
        raise PlanError(f"{name}: batch.prompt_tokens {b.prompt_tokens} leaves no room under max_total_tokens "
                        f"{b.max_total_tokens}")
    if b.mean_new_tokens >= b.cap:
        raise PlanError(f"{name}: batch.mean_new_tokens {b.mean_new_tokens} is not below the completion cap "
                        f"max_total_tokens - prompt_tokens = {b.cap}")
