"""Tasks for the pipeline tests, imported by the executors (tests/ on PYTHONPATH)."""

import multiprocessing
import time
from collections import deque

import torch

from llamarl_core.pipeline import Generator, GeneratorContext, Task
from llamarl_core.sync import SyncError
from llamarl_core.pipeline.task import reverse_prompt, reverse_reference, reverse_reward


def _failing_reward(prompt: str, completion: str) -> float:
    if len(completion) > 5:  # past the probe's completions ("", "probe"): fails in the run
        raise KeyError("a user's reward bug")
    return reverse_reward(prompt, completion)


def failing_task() -> Task:
    return Task("failing", reverse_prompt, _failing_reward, "abcdefgh=", 11, reverse_reference)


def _nan_reward(prompt: str, completion: str) -> float:
    return float("nan") if len(completion) > 5 else reverse_reward(prompt, completion)  # past the probe, as above


def nan_task() -> Task:
    return Task("nan", reverse_prompt, _nan_reward, "abcdefgh=", 11, reverse_reference)


def generator_start_fails_task() -> Task:
    """Loads everywhere but in the generator (process names come from the controller)."""
    if multiprocessing.current_process().name.startswith("llamarl-generator"):
        raise RuntimeError("a generator-only start-up failure")
    return Task("generator-start-fails", reverse_prompt, reverse_reward, "abcdefgh=", 11, reverse_reference)


def length_reward(prompts, completions, answers):
    """A user's batched rule reward (`--reward pipeline_tasks:length_reward`)."""
    return [float(len(c)) for c in completions]


def upper_reference_task() -> Task:
    """Its reference answers use characters its alphabet lacks (found by the warm-up check)."""
    return Task("upper-reference", reverse_prompt, reverse_reward, "abcdefgh=", 11, lambda p: p[:-1].upper())


_scored = 0


def _hanging_reward(prompt: str, completion: str) -> float:
    global _scored
    _scored += 1
    if _scored > 120 and multiprocessing.current_process().name.startswith("llamarl-reward"):
        time.sleep(3600)
    return reverse_reward(prompt, completion)


def hanging_reward_task() -> Task:
    """A reward that stops answering (a verifier that hangs) from the reward executor's
    121st completion on: the generators wait for prompts, the trainer for a batch."""
    return Task("hanging-reward", reverse_prompt, _hanging_reward, "abcdefgh=", 11, reverse_reference)


class HFGenerateGenerator(Generator):
    """A framework's own engine, as an integrator would plug it in: transformers'
    `generate()` on a model of the trainer's class, whose parameters the weight
    sync fills in place. Each segment re-prefills prompt + tokens so far (left
    padded) and samples at most segment_tokens tokens; `stop()` ends it between
    decode steps (a stopping criterion), so unfinished samples go on under the
    next version: partial rollouts."""

    def __init__(self, context: GeneratorContext):
        import transformers

        torch.manual_seed(context.seed)
        self.context = context
        self.model = transformers.AutoModelForCausalLM.from_config(context.model_config, dtype=context.dtype)
        self.model.requires_grad_(False).eval()
        self.receiver = context.weight_receiver(self.model)
        self.waiting, self.running = deque(), []
        self.eos = set(context.eos_token_ids)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, samples):
        self.waiting.extend(samples)

    def update_weights(self, version, timeout_s, relay_to=None):
        try:
            self.version = self.receiver.receive(timeout=timeout_s, expect=version)
        except SyncError:
            self.version = None  # torn, or never came: nothing is sampled until a version lands
            raise
        return self.version

    def run_segment(self, stop):
        import transformers

        ctx = self.context
        while self.waiting and len(self.running) < ctx.max_batch:
            self.running.append(self.waiting.popleft())
        rows = [s.prompt + s.tokens for s in self.running]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), ctx.pad_token_id)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row):], attention[i, width - len(row):] = torch.tensor(row), 1

        class Stop(transformers.StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), bool(stop()))

        out = self.model.generate(input_ids=ids, attention_mask=attention, do_sample=True, temperature=ctx.temperature,
                                  top_k=0, top_p=1.0, max_new_tokens=ctx.segment_tokens, output_logits=True,
                                  return_dict_in_generate=True, pad_token_id=ctx.pad_token_id,
                                  eos_token_id=list(self.eos), stopping_criteria=[Stop()])
        new = out.sequences[:, width:]
        logprobs = torch.log_softmax(torch.stack(out.logits, 1).float() / ctx.temperature, -1)
        logprobs = logprobs.gather(-1, new.unsqueeze(-1)).squeeze(-1)
        done, running = [], []
        for i, sample in enumerate(self.running):
            for j in range(new.shape[1]):
                if sample.finished or len(sample.tokens) == ctx.max_new_tokens:
                    break
                token = int(new[i, j])
                sample.tokens.append(token)
                sample.logprobs.append(float(logprobs[i, j]))
                sample.versions.append(self.version)
                sample.finished = token in self.eos
            (done if sample.finished or len(sample.tokens) == ctx.max_new_tokens else running).append(sample)
        self.running = running
        return done


def two_argument_reward(prompts, completions):
    """A reward of the wrong signature (no answers)."""
    return [0.0] * len(completions)


def text_reward(prompts, completions, answers):
    """A reward that returns strings."""
    return ["good"] * len(completions)


def leave_one_out(rewards, group_ids):
    """A user's advantage estimator (RLOO written out)."""
    out = torch.empty_like(rewards)
    for g in group_ids.unique():
        mine = group_ids == g
        n = int(mine.sum())
        out[mine] = rewards[mine] - (rewards[mine].sum() - rewards[mine]) / (n - 1)
    return out


def aipo_by_hand(logprobs, batch):
    """A user's loss on per-token log-probs: AIPO, -min(exp(logp - b), 4) A logp."""
    weight = torch.exp(logprobs.detach() - batch.behavior_logprobs).clamp(max=4.0)
    return -weight * batch.advantages * logprobs


def count_tokens_hook(context, step):
    """A user's step hook: runs the step and logs the tokens it trained on."""
    stats = step()
    return {"hook_tokens": stats.counted_tokens, "hook_step": context.step}


def trl_answer_reward(prompts, completions, answer, **kwargs):
    """A reward in TRL's signature that reads the dataset's answer column."""
    return [float(c == a) for c, a in zip(completions, answer)]


def trl_kwargs_reward(prompts, completions, **kwargs):
    """A reward in TRL's signature that reads columns through **kwargs."""
    return [len(c) + (0.5 if kwargs["answer"][i] is None else 0.0) for i, c in enumerate(completions)]


def trl_ids_reward(prompts, completions, completion_ids, **kwargs):
    """A reward in TRL's signature that needs the completions' token ids (which the pipeline does not pass)."""
    return [float(len(ids)) for ids in completion_ids]
