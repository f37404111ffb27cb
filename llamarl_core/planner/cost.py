"""The cost model: a Scenario and a device's efficiency factors -> the predicted
time of generation, training, the weight sync and the step, memory per GPU of each
side, and the bottleneck named (plain arithmetic, no processes).

Generation (per replica of `tp` GPUs, its share of the samples): a prefill, then
decode steps, each max(bytes read / bandwidth, FLOPs / peak) plus a fixed cost per
step and the tensor-parallel all-reduces. Bytes read are the weights the batch
touches (all dense weights; the routed experts its tokens reach) and the KV cache
of every running sequence. Completion lengths follow a Weibull (its shape a
factor) truncated at the batch's cap with the batch's mean (the mass above the cap
sits at it, as truncated completions do): the batch shrinks as sequences end and the longest sets the
number of steps. When the KV cache cannot hold a replica's share at once, it runs
saturated at the concurrency it holds, then drains.

Training (per step): forward + backward of every token, plus `logprob_passes`
forwards (old and reference policies), dense and attention FLOPs at the trainer's
MFU; tensor-, context-, expert- and pipeline-parallel traffic over the links
their groups span; a pipeline bubble of (m + pp - 1) / m for m micro-batches of one sequence a
data-parallel rank; per optimizer step the gradients' reduce-scatter and gather
and the Adam update over the local shard.

Weight sync: the generator's bytes into each generator GPU and out of each
trainer GPU (every replica gets a copy), over NVLink when both sides sit within
one NVLink domain, else the NICs (Megatron's rank order: tensor, context and data
ranks inside a pipeline stage, the stages outermost, so a model copy with pp > 1
spans every trainer GPU); a delta sync, which goes point to point between nodes
only (same-node receivers are written whole, as the library does), moves the
changed fraction in the cheaper of a bitmask or index encoding. Sync mode also
moves the trainer's state and the generator's weights to the host and back (the
colocated swap).

Step: sync mode, gen + train + sync + swap + overhead on all GPUs; async with a
staleness bound >= 1, max(gen, train) + sync + overhead (the sync stalls the
generator: it does not overlap); a bound of 0 leaves nothing to overlap:
gen + train + sync + overhead.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from .devices import PlanError
from .scenario import Scenario

GiB = 2**30
# Name -> (lowest, highest, meaning). Efficiencies are fractions of a published peak, bounded by what the
# field reaches: decode at up to 90% of HBM bandwidth, MFU up to 60% (the best published H100 training runs
# reach 50-55%), links up to 90% of their rate.
FACTORS = {
    "decode_bandwidth": (0.05, 0.9, "fraction of HBM bandwidth a decode step reaches reading weights and KV cache"),
    "generation_compute": (0.05, 0.8, "fraction of dense peak FLOPs in prefill and compute-bound decode"),
    "decode_step_s": (0.0, 0.05, "fixed seconds per decode step (launches, sampling, scheduling)"),
    "collective_latency_s": (1e-6, 1e-3, "seconds of latency per collective call (a decode step's all-reduces)"),
    "train_mfu_dense": (0.02, 0.6, "model FLOPs utilization training a dense model"),
    "train_mfu_moe": (0.02, 0.6, "model FLOPs utilization training an MoE model"),
    "link_efficiency": (0.05, 0.9, "fraction of NVLink / NIC bandwidth collectives and the weight sync reach"),
    "host_link_efficiency": (0.1, 0.9, "fraction of host-link bandwidth the colocated swap reaches"),
    "step_overhead_s": (0.0, 120.0, "fixed seconds per step (control, rewards, data, set-up of each phase)"),
    "length_shape": (0.5, 4.0, "Weibull shape of completion lengths (1: exponential; larger: a lighter tail)"),
}
# vLLM's default share of GPU memory, and what it keeps aside for activations.
GPU_MEMORY_UTILIZATION = 0.9
GENERATOR_RESERVE_GiB = 2.0
ADAM_TOUCHED_BYTES = 32  # read and written per parameter by an Adam update
KV_BYTES = 2  # the KV cache in bf16
SLICES = 48  # decode steps integrated in this many slices


@dataclass
class Prediction:
    step_time_s: float
    gen_time_s: float
    train_time_s: float
    sync_time_s: float  # the weight sync
    swap_time_s: float  # sync mode's colocated swap (0 in async)
    memory_gib_per_gpu: dict
    bottleneck: str
    assumptions: list
    breakdown: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        return {"step_time_s": self.step_time_s, "gen_time_s": self.gen_time_s, "train_time_s": self.train_time_s,
                "sync_time_s": self.sync_time_s, "swap_time_s": self.swap_time_s,
                "memory_gib_per_gpu": self.memory_gib_per_gpu,
                "bottleneck": self.bottleneck, "assumptions": self.assumptions, "breakdown": self.breakdown}


class LengthDist:
    """Completion lengths: a Weibull of shape `shape` (1: exponential; larger:
    a lighter tail) truncated at `cap` (the mass above sits at the cap, as
    truncated completions do), its scale chosen so that the mean is `mean`."""

    GRID = 256

    def __init__(self, mean: float, cap: float, shape: float):
        if not 0 < mean < cap:
            raise PlanError(f"mean completion length {mean} must be in (0, cap {cap})")
        self.mean, self.cap, self.shape = float(mean), float(cap), float(shape)
        lo, hi = mean * 1e-3, mean * 1e6
        for _ in range(48):  # the truncated mean grows with the scale (to 1e-6 relative)
            self.scale = math.sqrt(lo * hi)
            if self._integral(1) < mean:
                lo = self.scale
            else:
                hi = self.scale
        self.scale = math.sqrt(lo * hi)
        self.second_moment = self._integral(2)

    def survival(self, t: float) -> float:
        """P(length > t)."""
        return 0.0 if t >= self.cap else math.exp(-((t / self.scale) ** self.shape))

    def _integral(self, power: int) -> float:
        """E[min(L, cap)^power] = integral over [0, cap) of power t^(power-1) P(L > t)
        (midpoint rule, over the stretch where P(L > t) is above e^-40: a mean far
        below the cap still gets GRID points where its mass is)."""
        end = min(self.cap, self.scale * 40.0 ** (1 / self.shape))
        t = (np.arange(self.GRID) + 0.5) * (end / self.GRID)
        return float(np.sum(power * t ** (power - 1) * np.exp(-((t / self.scale) ** self.shape))) * end / self.GRID)

    def longest(self, n: float) -> float:
        """The length only 1 in n exceeds (about the longest of n), at most the cap."""
        return min(self.cap, self.scale * math.log(max(n, 2.0)) ** (1 / self.shape))


@functools.lru_cache(maxsize=4096)
def lengths_of(mean: float, cap: float, shape: float) -> LengthDist:
    return LengthDist(mean, cap, shape)


def kv_share(m, tp: int) -> float:
    """The share of a layer's K and V heads one of `tp` tensor-parallel ranks holds
    (a head replicated where tp exceeds them)."""
    return max(1.0, m.kv_heads / tp) / m.kv_heads


def kv_per_token(s: Scenario) -> float:
    """KV-cache bytes a token holds on one generator GPU: its share of the KV heads,
    or MLA's whole latent (every rank keeps it)."""
    m = s.model
    return m.kv_bytes_per_token_layer / 2 * KV_BYTES * m.layers * (1.0 if m.mla else kv_share(m, s.generator.tp))


def held_context(b, lengths: LengthDist) -> float:
    """Tokens a running sequence holds on average: the prompt and the length-biased mean context."""
    return b.prompt_tokens + lengths.second_moment / (2 * lengths.mean)


def expert_dp(t) -> int:
    """Ranks one expert's weights are replicated over (Megatron: dp x cp x tp / ep)."""
    return max(1, t.dp * t.cp * t.tp // t.ep)


def model_span(t) -> int:
    """Consecutive ranks one trainer model copy spans: with pipeline stages (outermost) all of the
    trainer's GPUs, else its tensor x context group, or tensor x expert where experts spread wider."""
    return t.gpus if t.pp > 1 else t.tp * max(t.cp, t.ep)


def state_bytes(dtype: str) -> tuple[int, int]:
    """Bytes a trainer of `dtype` keeps per local parameter: (on every data-parallel
    rank, sharded over them: Megatron's distributed optimizer). Mixed precision
    (bf16, fp16, fp8 compute): 16-bit weights and fp32 gradients; fp32 master
    weights and Adam's two moments. fp32: fp32 weights and gradients; the moments."""
    return (4 + 4, 8) if dtype == "fp32" else (2 + 4, 12)


def check_factors(factors: dict, table: dict, where: str) -> None:
    """PlanError naming the first factor of `factors` not in `table` or not a number within its bounds there."""
    for name, value in factors.items():
        if name not in table:
            raise PlanError(f"{where}: unknown factor {name!r}")
        lo, hi, _ = table[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            raise PlanError(f"{where}: factor {name} = {value!r} is outside [{lo}, {hi}]")


class CostModel:
    """Predictions for scenarios of one device kind, from its factors (name -> value, FACTORS' names)."""

    def __init__(self, factors: dict, notes: tuple = ()):
        """notes: what the factors assume, said with every prediction (a factor held, not fit).
        PlanError naming a factor missing, unknown, or not a number within its bounds."""
        missing = set(FACTORS) - set(factors)
        extra = set(factors) - set(FACTORS)
        if missing or extra:
            raise PlanError(f"factors: missing {sorted(missing)}, unknown {sorted(extra)}")
        check_factors(factors, FACTORS, "factors")
        self.f = dict(factors)
        self.notes = tuple(notes)

    # ---- generation ----
    def _decode_step(self, s: Scenario, batch: float, context: float, parts: dict, steps: float) -> float:
        f, m, d, g = self.f, s.model, s.device, s.generator
        memory = m.weights_read(batch) * g.weight_bytes / g.tp + batch * context * kv_per_token(s)
        flops = batch * (2 * m.active_params + m.layers * m.decode_attn_flops_per_position * context) / g.tp
        t_mem = memory / (d.hbm * f["decode_bandwidth"])
        t_flops = flops / (d.peak_flops(g.dtype) * f["generation_compute"])
        comm = 0.0
        if g.tp > 1:
            comm = m.layers * 2 * (f["collective_latency_s"]
                                   + batch * m.hidden * 2 * 2 * (g.tp - 1) / g.tp / self._link(s, g.tp))
        key = "decode memory-bound" if t_mem >= t_flops else "decode compute-bound"
        parts[key] = parts.get(key, 0.0) + steps * max(t_mem, t_flops)
        parts["decode fixed cost"] = parts.get("decode fixed cost", 0.0) + steps * f["decode_step_s"]
        parts["decode all-reduces"] = parts.get("decode all-reduces", 0.0) + steps * comm
        return max(t_mem, t_flops) + f["decode_step_s"] + comm

    @staticmethod
    def generator_room(s: Scenario) -> float:
        """Bytes vLLM takes of a generator GPU for weights and KV cache."""
        return s.device.memory_bytes * GPU_MEMORY_UTILIZATION - GENERATOR_RESERVE_GiB * GiB

    def kv_capacity_tokens(self, s: Scenario) -> float:
        """Tokens of KV cache one generator GPU (and so its replica) holds after its weights."""
        m, g = s.model, s.generator
        return max(self.generator_room(s) - m.total_params * g.weight_bytes / g.tp, 0.0) / kv_per_token(s)

    def generation(self, s: Scenario, parts: dict) -> float:
        f, m, b, g = self.f, s.model, s.batch, s.generator
        replicas = g.gpus // g.tp
        n = math.ceil(b.samples / replicas)
        lengths = self._lengths(b)
        capacity = self.kv_capacity_tokens(s)
        held = held_context(b, lengths)
        concurrency = max(1.0, min(float(n), capacity / held))
        prefill_flops = n * b.prompt_tokens * (2 * m.active_params
                                               + m.layers * m.attn_flops_per_position * b.prompt_tokens / 2) / g.tp
        time = prefill_flops / (s.device.peak_flops(g.dtype) * f["generation_compute"])
        parts["prefill"] = time
        if n > concurrency:  # saturated: `concurrency` slots, each running sequence after sequence
            steps = (n - concurrency) * lengths.mean / concurrency
            time += steps * self._decode_step(s, concurrency, held, parts, steps)
        drain = min(float(n), concurrency)
        end = lengths.longest(drain)
        width = end / SLICES
        for i in range(SLICES):
            t = (i + 0.5) * width
            alive = max(1.0, drain * lengths.survival(t))
            time += width * self._decode_step(s, alive, b.prompt_tokens + t, parts, width)
        return time

    def _lengths(self, b) -> LengthDist:
        return lengths_of(b.mean_new_tokens, b.cap, self.f["length_shape"])

    def _link(self, s: Scenario, group_span: int) -> float:
        """Bytes/s a GPU reaches over the link a group of `group_span` ranks uses."""
        return s.device.link(group_span, s.gpus_per_node) * self.f["link_efficiency"]

    # ---- training ----
    def _local_params(self, s: Scenario) -> tuple[float, float]:
        """(non-expert, expert) parameters one trainer GPU holds."""
        m, t = s.model, s.trainer
        return m.non_expert_params / (t.tp * t.pp), m.expert_total / (t.ep * t.pp)

    def training(self, s: Scenario, parts: dict) -> float:
        f, m, b, t, d = self.f, s.model, s.batch, s.trainer, s.device
        lengths = self._lengths(b)
        p = b.prompt_tokens
        tokens = b.samples * (p + lengths.mean)
        squared = b.samples * (p * p + 2 * p * lengths.mean + lengths.second_moment)
        passes = 3 + b.logprob_passes  # forward + backward counts 3 forwards
        flops = passes * (2 * m.active_params * tokens + m.layers * m.attn_flops_per_position * squared / 2)
        mfu = f["train_mfu_moe"] if m.moe else f["train_mfu_dense"]
        compute = flops / (t.gpus * d.peak_flops(t.dtype) * mfu)
        collectives = 4 + 2 * b.logprob_passes  # per layer: 2 forward + 2 backward, 2 per log-prob forward
        tp_comm = ep_comm = cp_comm = pp_comm = 0.0
        if t.tp > 1:
            tp_comm = (m.layers / t.pp) * collectives * (tokens / (t.dp * t.cp)) * m.hidden * 2 \
                * 2 * (t.tp - 1) / t.tp / self._link(s, t.tp)
        if t.ep > 1:
            ep_comm = (m.moe_layers / t.pp) * collectives * (tokens / (t.dp * t.cp * t.tp)) \
                * m.experts_per_token * m.hidden * 2 * (t.ep - 1) / t.ep / self._link(s, t.tp * t.ep)
        if t.cp > 1:
            # Ring attention: each rank's K and V (decompressed for MLA; a KV head a rank beyond the heads)
            # pass the other cp - 1 ranks.
            share = 1.0 / t.tp if m.mla else kv_share(m, t.tp)
            cp_comm = (m.layers / t.pp) * passes * (tokens / (t.dp * t.cp)) * m.train_kv_bytes_per_token_layer \
                * share * (t.cp - 1) / self._link(s, t.tp * t.cp)
        if t.pp > 1:  # each stage boundary passes a micro-batch's activations forward and their gradient back
            pp_comm = (2 + b.logprob_passes) * (tokens / (t.dp * t.cp * t.tp)) * m.hidden * 2 / self._link(s, t.gpus)
        micro = b.train_global_batch / t.dp
        bubble = (micro + t.pp - 1) / micro
        dense_local, expert_local = self._local_params(s)
        dp_group = t.dp * t.cp
        replicas = expert_dp(t)
        grads = 2 * 2 * (dense_local * (dp_group - 1) / dp_group + expert_local * (replicas - 1) / replicas) \
            / self._link(s, t.gpus // t.pp)  # a stage's data-parallel group
        adam = ADAM_TOUCHED_BYTES * (dense_local / dp_group + expert_local / replicas) / d.hbm
        traffic = tp_comm + ep_comm + cp_comm + pp_comm
        parts["training compute"] = compute
        parts["tp / ep / cp / pp traffic"] = traffic
        parts["pipeline bubble"] = (compute + traffic) * (bubble - 1)
        parts["gradient reduce + Adam"] = b.optimizer_steps * (grads + adam)
        return (compute + traffic) * bubble + b.optimizer_steps * (grads + adam)

    # ---- weight sync ----
    def wire_fraction(self, s: Scenario) -> float:
        """Bytes a version puts on the wire over a full send's: 1, or a delta's cheaper
        encoding (a bit per element and the changed values, or a 4-byte index and the
        value per changed element)."""
        if s.delta_fraction is None:
            return 1.0
        size = s.generator.weight_bytes
        bitmask = 1 / (8 * size) + s.delta_fraction
        index = s.delta_fraction * (size + 4) / size
        return min(1.0, bitmask, index)

    def sync_span(self, s: Scenario) -> int:
        """Consecutive ranks a version's way from the trainer to a generator replica
        spans: colocated (sync mode), the wider of a replica and a trainer model copy;
        apart (async), both sides."""
        g, t = s.generator, s.trainer
        return max(g.tp, model_span(t)) if s.mode == "sync" else g.gpus + t.gpus

    def sync(self, s: Scenario) -> float:
        m, g, t = s.model, s.generator, s.trainer
        span = self.sync_span(s)
        across = s.device.crosses(span, s.gpus_per_node)
        total = m.total_params * g.weight_bytes * (self.wire_fraction(s) if across else 1.0)
        into = total / g.tp
        out = total * (g.gpus // g.tp) / t.gpus
        return max(into, out) / self._link(s, span)

    def swap(self, s: Scenario) -> float:
        """Sync mode: the trainer's state (weights, gradients, optimizer) to the host
        before generation and back after, and the generator's weights off and back
        around training (a sleeping engine keeps them in host memory)."""
        if s.mode != "sync":
            return 0.0
        state = self._trainer_state(s) + s.model.total_params * s.generator.weight_bytes / s.generator.tp
        return 2 * state / (s.device.host_GBps * 1e9 * self.f["host_link_efficiency"])

    def _trainer_state(self, s: Scenario) -> float:
        """Bytes of weights, gradients and (sharded) optimizer state on one trainer GPU."""
        dense_local, expert_local = self._local_params(s)
        t = s.trainer
        replicated, sharded = state_bytes(t.dtype)
        return replicated * (dense_local + expert_local) + sharded * (dense_local / (t.dp * t.cp)
                                                                     + expert_local / expert_dp(t))

    # ---- memory ----
    def generator_memory(self, s: Scenario) -> float:
        """GiB a generator GPU holds (weights, the KV cache its share of the batch
        fills, vLLM's reserve); PlanError when its weights do not fit."""
        m, g, b = s.model, s.generator, s.batch
        weights = m.total_params * g.weight_bytes / g.tp
        if weights > self.generator_room(s):
            raise PlanError(f"{s.name}: the generator's weights, {weights / GiB:.1f} GiB a GPU at tp {g.tp}, do not "
                            f"fit in {GPU_MEMORY_UTILIZATION:.0%} of {s.device.name}'s {s.device.memory_GiB:g} GiB "
                            "less vLLM's reserve: raise generator.tp")
        capacity = self.kv_capacity_tokens(s)
        if capacity < b.max_total_tokens:
            raise PlanError(f"{s.name}: the generator's KV cache does not hold one sequence of max_total_tokens "
                            f"{b.max_total_tokens} beside its weights ({capacity:.0f} tokens a GPU at tp {g.tp}): "
                            "raise generator.tp")
        lengths = self._lengths(b)
        need = min(math.ceil(b.samples / (g.gpus // g.tp)) * held_context(b, lengths), capacity)
        return (weights + need * kv_per_token(s) + GENERATOR_RESERVE_GiB * GiB) / GiB

    def trainer_memory(self, s: Scenario) -> float:
        """GiB a trainer GPU holds (weights, gradients, sharded optimizer state,
        activations); PlanError naming what overflows."""
        m, t, b = s.model, s.trainer, s.batch
        state = self._trainer_state(s)
        # Full activation recomputation, one sequence of max_total_tokens a micro-batch: each of the first
        # stage's layers / pp layers keeps its input (16-bit; fp32 in an fp32 trainer) for the pp micro-batches
        # in flight (layers inputs in all), one layer's working set (~34 bytes a token and hidden unit in 16 bits,
        # Korthikanti et al.; twice that in fp32), and the fp32 logits and their gradient.
        tokens, width = b.max_total_tokens / (t.tp * t.cp), 2 if t.dtype != "fp32" else 4
        activations = (tokens * m.hidden * width * m.layers + 17 * width * tokens * m.hidden
                       + 2 * 4 * b.max_total_tokens / t.cp * m.vocab / t.tp)
        if state + activations > s.device.memory_bytes:
            raise PlanError(f"{s.name}: the trainer needs {(state + activations) / GiB:.1f} GiB a GPU (weights, "
                            f"gradients and optimizer state {state / GiB:.1f}, activations {activations / GiB:.1f}) "
                            f"on {s.device.name}'s {s.device.memory_GiB:g} GiB: raise trainer tp / pp / ep or its "
                            "GPUs")
        return (state + activations) / GiB

    # ---- the step ----
    def predict(self, s: Scenario) -> Prediction:
        memory = {"generator": self.generator_memory(s), "trainer": self.trainer_memory(s)}
        gen_parts: dict = {}
        train_parts: dict = {}
        gen = self.generation(s, gen_parts)
        train = self.training(s, train_parts)
        sync = self.sync(s)
        swap = self.swap(s)
        overhead = self.f["step_overhead_s"]
        overlapped = s.mode == "async" and s.max_staleness >= 1
        step = (max(gen, train) if overlapped else gen + train) + sync + swap + overhead
        terms = {"generation": gen, "training": train, "weight sync": sync, "colocated swap": swap,
                 "fixed step cost": overhead}
        if overlapped:
            side, side_time = ("generation", gen) if gen >= train else ("training", train)
            inner = gen_parts if side == "generation" else train_parts
            top = max(inner, key=inner.get)
            bottleneck = (f"{side} ({side_time:.1f} s against {min(gen, train):.1f} s for the other side; "
                          f"{top} {inner[top] / side_time:.0%} of it)")
        else:
            side = max(terms, key=terms.get)
            inner = {"generation": gen_parts, "training": train_parts}.get(side)
            bottleneck = f"{side} ({terms[side] / step:.0%} of the step"
            if inner:
                top = max(inner, key=inner.get)
                bottleneck += f"; {top} {inner[top] / terms[side]:.0%} of it"
            bottleneck += ")"
        delta = [] if s.delta_fraction is None else [
            "delta sync: only between nodes (receivers within one are written whole, as the library sends)"]
        assumptions = [text for _, text in s.assumptions] + list(self.notes) + delta + [
            f"completion lengths: a Weibull of shape {self.f['length_shape']:.2f} truncated at the cap, with the "
            "batch's mean",
            f"generator: vLLM-like, {GPU_MEMORY_UTILIZATION:.0%} of GPU memory, KV cache in bf16",
            "trainer: Megatron-like, distributed optimizer, full recomputation, micro-batches of one sequence",
            "tensor-, expert-, context- and pipeline-parallel traffic not overlapped with compute",
        ]
        breakdown = {"generation": gen_parts, "training": train_parts,
                     "step": {**terms, "overlapped": overlapped}}
        return Prediction(step, gen, train, sync, swap, memory, bottleneck, assumptions, breakdown)
