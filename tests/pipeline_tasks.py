"""Tasks for the pipeline tests, imported by the executors (tests/ on PYTHONPATH)."""

import multiprocessing
import time

from llamarl_core.pipeline import Task
from llamarl_core.pipeline.task import reverse_prompt, reverse_reference, reverse_reward


def _failing_reward(prompt: str, completion: str) -> float:
    if len(completion) > 3:
        raise KeyError("a user's reward bug")
    return reverse_reward(prompt, completion)


def failing_task() -> Task:
    return Task("failing", reverse_prompt, _failing_reward, "abcdefgh=", 11, reverse_reference)


def nan_task() -> Task:
    return Task("nan", reverse_prompt, lambda prompt, completion: float("nan"), "abcdefgh=", 11, reverse_reference)


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
