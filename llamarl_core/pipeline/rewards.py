"""Rewards: verifiable rule rewards scored in batches, and a reward model.

`--reward` names a sum of weighted terms, `NAME` or `WEIGHT*NAME` joined by `+`:
    math            1 if the completion's answer equals the problem's answer: the
                    content of its last \\boxed{...}, else the last number it writes
                    (numbers compare by value: "1,000" = "1000.0", "3/4" = "0.75")
    format          1 if the completion gives its answer in a \\boxed{...}
    module:attr     a function of yours (in Python, the function itself)
e.g. `--reward math+0.1*format`. Without --reward a task's own per-sample
reward(prompt, completion) scores it, through `per_sample`.

Every reward has one signature, on a batch of lists:
    fn(prompts, completions, answers) -> one float per completion
(prompts: str or chat messages; answers: the dataset's, None for a task's
prompts), or TRL's: a function that takes **kwargs, fn(prompts, completions,
**kwargs), is called with keywords as TRL calls it, the answers as `answer=` (a
dataset column, as TRL passes them). Before any executor starts, each reward function is called once on a
probe (the run's first two prompts, an empty completion and a short one): a
function that cannot take those arguments, or returns anything but one real
number per completion, is refused naming it.

`--reward-model PATH` instead scores each (prompt, completion) with a
transformers `AutoModelForSequenceClassification` with one output, in batches,
in the reward executor's own process.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

from ..spelling import option
from .data import Problem, prompt_text
from .plugins import check_arity, load

BatchReward = Callable[[list, list[str], list], list[float]]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def boxed_answer(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1: j].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The answer a completion gives: its last \\boxed{} content, else its last number."""
    boxed = boxed_answer(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str) -> Fraction | None:
    """A number written as an integer, decimal or fraction (commas, spaces, `$`,
    `%` and a trailing period ignored), exactly; None if it is not one."""
    cleaned = text.strip().replace(",", "").replace(" ", "").replace("$", "").rstrip(".%")
    try:
        value = Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def answers_match(given: str | None, expected: str) -> bool:
    if given is None:
        return False
    a, b = parse_number(given), parse_number(expected)
    if a is not None and b is not None:
        return a == b
    return given.strip() == expected.strip()


def math_reward(prompts: list, completions: list[str], answers: list) -> list[float]:
    return [float(answers_match(extract_answer(c), str(a))) for c, a in zip(completions, answers)]


def format_reward(prompts: list, completions: list[str], answers: list) -> list[float]:
    return [float(bool(boxed_answer(c))) for c in completions]


BUILTIN_REWARDS: dict[str, BatchReward] = {"math": math_reward, "format": format_reward}
NEEDS_ANSWER = {"math"}


def batch_reward(fn) -> BatchReward:
    """`fn` as fn(prompts, completions, answers): a reward in TRL's signature,
    fn(prompts, completions, **kwargs) (one that takes **kwargs), wrapped to be
    called as TRL calls it, with keywords, the answers as `answer=` (a parameter
    it names without a default other than these three is refused by the probe,
    naming it); any other as it is."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: the probe call will tell
        return fn
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return fn

    def trl_signature(prompts: list, completions: list[str], answers: list) -> list[float]:
        return fn(prompts=prompts, completions=completions, answer=answers)

    trl_signature.__name__ = trl_signature.__qualname__ = getattr(fn, "__qualname__", "reward")
    trl_signature.__module__ = getattr(fn, "__module__", "?")
    return trl_signature


def per_sample(reward: Callable[[str, str], float], what: str) -> BatchReward:
    """A per-sample reward(prompt text, completion) -> float (a Task's) as a batched
    reward; an error in it names `what`, the prompt and the completion."""

    def batched(prompts: list, completions: list[str], answers: list) -> list[float]:
        rewards = []
        for prompt, completion in zip(map(prompt_text, prompts), completions):
            try:
                rewards.append(float(reward(prompt, completion)))
            except Exception as exc:
                raise RuntimeError(f"{what} failed on prompt {prompt!r}, completion {completion!r}: {exc}") from exc
        return rewards

    return batched


def check_scores(scores, count: int, what: str) -> list[float]:
    """`scores` as a list of `count` floats; ValueError naming `what` unless it is a
    sequence (list, tuple, 1-D array or tensor) of that many real numbers."""
    if isinstance(scores, (str, bytes, dict)) or not hasattr(scores, "__len__"):
        raise ValueError(f"{what} returned a {type(scores).__name__}; a list of one float per completion expected")
    if getattr(scores, "ndim", 1) != 1 or len(scores) != count:
        shape = tuple(scores.shape) if hasattr(scores, "shape") else len(scores)
        raise ValueError(f"{what} returned {shape} scores for {count} completions; one float per completion expected")
    values = [s.item() if hasattr(s, "item") else s for s in scores]
    bad = [v for v in values if not isinstance(v, numbers.Real)]
    if bad:
        raise ValueError(f"{what} returned {bad[0]!r} ({type(bad[0]).__name__}) among its scores; real numbers expected")
    return [float(v) for v in values]


class RuleReward:
    """A `--reward` spec (see the module docstring), parsed and its functions loaded:
    call it with problems and completions for one float per completion."""

    def __init__(self, spec: str):
        self.spec = spec
        self.terms: list[tuple[float, str, BatchReward]] = []
        for term in spec.split("+"):
            weight_text, star, name = term.strip().rpartition("*")
            name = name.strip()
            try:
                weight = float(weight_text) if star else 1.0
            except ValueError:
                raise ValueError(f"{option('reward', spec)}: {weight_text!r} is not a weight (terms are NAME or "
                                 "WEIGHT*NAME, joined by +)") from None
            if name in BUILTIN_REWARDS:
                fn = BUILTIN_REWARDS[name]
            elif ":" in name:
                fn = batch_reward(load(name, option("reward"), "function"))
            else:
                raise ValueError(f"{option('reward', spec)}: unknown reward {name!r} (built in: "
                                 f"{', '.join(BUILTIN_REWARDS)}; or module:function)")
            self.terms.append((weight, name, fn))

    @property
    def needs_answer(self) -> bool:
        return any(name in NEEDS_ANSWER for _, name, _ in self.terms)

    def __call__(self, problems: list[Problem], completions: list[str]) -> list[float]:
        prompts = [p.prompt for p in problems]
        answers = [p.answer for p in problems]
        total = [0.0] * len(completions)
        for weight, name, fn in self.terms:
            scores = check_scores(fn(prompts, completions, answers), len(completions), f"reward {name!r}")
            total = [t + weight * score for t, score in zip(total, scores)]
        return total


def check_rewards(problems: list[Problem], completions: list[str], rewards: list[float], what: str) -> None:
    """ValueError naming the first completion whose reward is not a finite number."""
    for problem, completion, reward in zip(problems, completions, rewards):
        if not math.isfinite(reward):
            raise ValueError(f"{what} returned {reward} for prompt {prompt_text(problem.prompt)!r}, "
                             f"completion {completion!r}")


class RewardModel:
    """A sequence-classification model with one output that scores (prompt,
    completion) pairs: rendered with its tokenizer's chat template (user prompt,
    assistant completion) where it has one, else the two texts joined. Scores
    batch_size pairs per forward, in float32 on CPU."""

    def __init__(self, path: str | Path, batch_size: int):
        import torch
        import transformers

        self.path, self.batch_size = check_reward_model(path), batch_size
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.use_chat = bool(getattr(self.tokenizer, "chat_template", None))
        self.model = transformers.AutoModelForSequenceClassification.from_pretrained(self.path, dtype=torch.float32)
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.eval()

    def _text(self, prompt, completion: str) -> str:
        if self.use_chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            return self.tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": completion}],
                                                      tokenize=False)
        return prompt_text(prompt) + completion

    def __call__(self, problems: list[Problem], completions: list[str]) -> list[float]:
        import torch

        texts = [self._text(p.prompt, c) for p, c in zip(problems, completions)]
        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                # A rendered chat template already holds its special tokens (bos): none added twice.
                batch = self.tokenizer(texts[start: start + self.batch_size], return_tensors="pt", padding=True,
                                       add_special_tokens=not self.use_chat)
                scores.extend(self.model(**batch).logits[:, 0].tolist())
        return scores


def check_reward_model(path: str | Path) -> Path:
    """ValueError unless `path` is a model folder of a sequence classifier with one
    output (read from its config.json, nothing loaded); returns the path."""
    import json

    path = Path(path).expanduser()
    where = option("reward_model", str(path))
    if not (path / "config.json").is_file():
        raise ValueError(f"{where}: no config.json (give a transformers AutoModelForSequenceClassification folder)")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{where}: no *.safetensors weights")
    config = json.loads((path / "config.json").read_text())
    archs = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(f"{where}: architectures {archs} holds no ...ForSequenceClassification model")
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)
    if labels != 1:
        raise ValueError(f"{where}: a reward model has one output (num_labels 1), this one has {labels}")
    return path


def check_reward_config(config, data) -> None:
    """ValueError, before anything starts, for a reward that cannot run: a --reward
    spec that does not parse or load, one that checks answers where the prompts
    have none (a task's), a --reward-model folder that is not a one-output
    sequence classifier."""
    if config.run.reward_model is not None:
        check_reward_model(config.run.reward_model)
    rule = None if config.run.reward is None else RuleReward(config.run.reward)
    if rule is not None and rule.needs_answer and data.task is not None:
        raise ValueError(f"{option('reward', config.run.reward)} checks answers: give a {option('dataset')} "
                         "whose lines have them "
                         f"(task {data.task.name!r} has none)")
    if config.run.reward_model is None:
        _probe_reward(rule, data)


def _probe_reward(rule: RuleReward | None, data) -> None:
    """Call each function of the run's rule reward (None: its task's reward) once,
    on the first two training prompts with an empty and a one-word completion;
    ValueError naming the function unless it takes (prompts, completions,
    answers) (a task's: (prompt, completion)) and returns one finite number each."""
    problems = [data.problem(0), data.problem(1)]
    prompts, answers, completions = [p.prompt for p in problems], [p.answer for p in problems], ["", "probe"]
    if rule is not None:
        terms = [(f"{option('reward')} term {name!r}", fn) for _, name, fn in rule.terms]
    else:
        what = f"the reward function of task {data.task.name!r}"
        check_arity(data.task.reward, (prompts[0], completions[0]), what)
        terms = [(what, per_sample(data.task.reward, what))]
    for what, fn in terms:
        check_arity(fn, (prompts, completions, answers), what)
        try:
            scores = fn(prompts, completions, answers)
        except Exception as exc:
            raise ValueError(f"{what} failed on a probe (the run's first two prompts, completions {completions}): "
                             f"{type(exc).__name__}: {exc}") from exc
        check_rewards(problems, completions, check_scores(scores, len(completions), what), f"{what} (on a probe)")


def make_scorer(config, data) -> tuple[Callable[[list[Problem], list[str]], list[float]], str]:
    """The run's reward as score(problems, completions) -> rewards, and its name for
    messages: the reward model, the --reward spec, or the task's own reward (per
    sample; an error in it names the prompt and completion)."""
    if config.run.reward_model is not None:
        run = config.run
        return RewardModel(run.reward_model, run.reward_batch), f"the reward model {run.reward_model}"
    if config.run.reward is not None:
        return RuleReward(config.run.reward), f"the reward {config.run.reward!r}"
    what = f"the reward function of task {data.task.name!r}"
    reward = per_sample(data.task.reward, what)
    return lambda problems, completions: reward([p.prompt for p in problems], completions, [None] * len(problems)), what
