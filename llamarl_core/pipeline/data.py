"""What a run samples from, and with which tokenizer and model shape.

A run's prompts come from a task (`Task.prompt(i)`, the built-in default or a
user's) or from a JSONL dataset (`--dataset`): one JSON object per line with a
`prompt` (text) or `messages` (a chat: [{"role": ..., "content": ...}, ...]) and
an `answer` (what verifiable rewards check; optional with a reward model). The
last `eval_size` lines are held out for evaluation; the rest are trained on in
a fresh seeded order every pass. A task's held-out prompts are its prompts at
indices far beyond any a run reaches.

Tokens come from the task's character tokenizer with the built-in toy model, or
from the pretrained model's own tokenizer (`--model`), through its chat
template where it has one. `RunData(config)` builds all of this in any process
(controller, generator, trainer, reward) and checks it before anything starts:
every dataset line, every prompt against the model's context, the tokenizer
against the model's vocabulary.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from ..models.checkpoint import ModelSource, context_length
from ..spelling import option
from .config import TrainConfig
from .task import Task, load_task

# A dataset run's completion budget unless --max-new-tokens says otherwise.
DATASET_MAX_NEW_TOKENS = 128
# A task's held-out prompts: indices no run reaches (RL starts at 0, the supervised warm-up at 10**9).
TASK_EVAL_OFFSET = 2 * 10**9
# A task has endless prompts: this many are checked against the context before a run starts.
TASK_PROMPTS_CHECKED = 256


@dataclass(frozen=True)
class Problem:
    """One prompt: text or chat messages, the answer rewards check (or None), and
    the line of the dataset file it came from (None for a task's prompt)."""

    prompt: str | list[dict]
    answer: str | None = None
    line: int | None = None


def read_dataset(path: str | Path, need_answer: bool) -> list[Problem]:
    """The problems of a JSONL file, checked line by line: a line that is not a JSON
    object, has neither `prompt` nor `messages`, or lacks an `answer` where the
    reward needs one raises ValueError naming the file and line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"{option('dataset', str(path))}: {exc.strerror or exc}") from None
    problems = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{option('dataset', str(path))}, line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        prompt = row.get("prompt", row.get("messages"))
        if isinstance(prompt, str) and prompt.strip():
            pass
        elif isinstance(prompt, list) and prompt and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt):
            pass
        else:
            raise ValueError(f"{where}: needs a non-empty \"prompt\" string or a \"messages\" list of "
                             "{\"role\": ..., \"content\": ...}")
        answer = row.get("answer")
        if need_answer and (answer is None or not str(answer).strip()):
            raise ValueError(f"{where}: no \"answer\" (the reward checks completions against it)")
        problems.append(Problem(prompt, None if answer is None else str(answer), number))
    if not problems:
        raise ValueError(f"{option('dataset', str(path))}: no lines")
    return problems


def reward_needs_answer(config: TrainConfig) -> bool:
    """Whether the run's reward checks completions against answers: a rule reward
    that does (math); a reward model, or rewards of your own, do not."""
    from .rewards import RuleReward

    return config.run.reward_model is None and (config.run.reward is None or RuleReward(config.run.reward).needs_answer)


def prompt_text(prompt: str | list[dict]) -> str:
    """A prompt as one string (a chat's messages joined), for rewards and logs."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(m["content"] for m in prompt)


def chat_end_of_turn(tokenizer) -> int | None:
    """The special token a chat template puts right after an assistant's message
    (Qwen's <|im_end|>, Llama 3's <|eot_id|>), or None where it puts none: a
    [user, assistant] exchange rendered, and the first token after the assistant's
    content taken if it is a special one."""
    import jinja2

    content = "llamarl-probe"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": content}], tokenize=False)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError):
        return None  # a template that renders no such exchange has no end of turn to learn from it
    at = text.rfind(content)
    if at < 0:
        return None
    after = tokenizer(text[at + len(content):], add_special_tokens=False)["input_ids"]
    added = tokenizer.added_tokens_decoder.get(after[0]) if after else None
    return after[0] if added is not None and added.special else None


class ModelTokenizer:
    """A pretrained model's transformers tokenizer behind the interface the pipeline
    uses (CharTokenizer's): encode(prompt) -> ids, decode(ids) -> text up to the
    first stop token, vocab_size, pad / eos ids. With chat_template (and a
    tokenizer that has one), a prompt becomes a user message, and a chat is
    rendered with the generation prompt appended; otherwise text is encoded as is
    (bos added if the tokenizer adds one).

    stop_token_ids: what ends a completion, eos first: the tokenizer's eos, the
    model's generation config eos id(s) (`generation_eos`: an int, a list or
    None), and with the chat template its end-of-turn token. They differ on
    many models (Qwen2.5 base: eos <|endoftext|>, turns end with <|im_end|>;
    Llama 3: <|end_of_text|> and <|eot_id|>); stopping at eos alone runs past the
    answer into a made-up next turn."""

    def __init__(self, tokenizer, chat_template: bool, generation_eos: int | list[int] | None = None):
        if tokenizer.eos_token_id is None:
            raise ValueError("the model's tokenizer has no eos token: completions would never end")
        self.hf = tokenizer
        self.use_chat = chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.vocab_size = len(tokenizer)
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        stops = [self.eos_token_id]
        stops += [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or ())
        end_of_turn = chat_end_of_turn(tokenizer) if self.use_chat else None
        if end_of_turn is not None:
            stops.append(end_of_turn)
        self.stop_token_ids = tuple(dict.fromkeys(stops))  # unique, in that order

    def encode(self, prompt: str | list[dict]) -> list[int]:
        if isinstance(prompt, list) and not self.use_chat:
            raise ValueError("a chat prompt (messages) needs a tokenizer with a chat template")
        if self.use_chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            # transformers 5 returns a BatchEncoding here, 4.x a list.
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return list(self.hf(prompt)["input_ids"])

    def decode(self, ids) -> str:
        ids = list(ids)
        cut = next((i for i, t in enumerate(ids) if t in self.stop_token_ids), len(ids))
        return self.hf.decode(ids[:cut], skip_special_tokens=True)


def model_and_tokenizer(config: TrainConfig, task: Task | None):
    """(ModelSource or None, transformers config, tokenizer) of a run: the
    pretrained model's (--model), its tokenizer checked against its vocabulary; or
    the built-in model sized for the task's character tokenizer."""
    if config.run.model is None:
        tokenizer = task.tokenizer()
        return None, config.run.toy_model_config(tokenizer.vocab_size), tokenizer
    source = ModelSource(config.run.model)
    model_config = source.config()
    generation = source.generation_config()
    tokenizer = ModelTokenizer(source.tokenizer(), config.run.chat_template,
                               generation.eos_token_id if generation is not None else None)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(f"{option('model', config.run.model)}: its tokenizer has {tokenizer.vocab_size} tokens, "
                         f"more than the model's vocab_size {model_config.vocab_size}")
    return source, model_config, tokenizer


class RunData:
    """See the module docstring. Attributes: task (None with a dataset), tokenizer,
    model_config (a transformers config), model (a ModelSource or None),
    max_new_tokens, train_size (None for a task: endless) and eval_size."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.task: Task | None = None if config.run.dataset else load_task(config.run.task)
        self.model, self.model_config, self.tokenizer = model_and_tokenizer(config, self.task)
        self.max_new_tokens = config.generator.max_new_tokens or (self.task.max_new_tokens if self.task else
                                                        DATASET_MAX_NEW_TOKENS)
        self.eval_size = config.run.eval_size if config.run.eval_every else 0
        self.train_size: int | None = None
        self._order: tuple[int, list[int]] = (-1, [])  # (pass, the dataset's order in it)
        if config.run.dataset:
            problems = read_dataset(config.run.dataset, need_answer=reward_needs_answer(config))
            if len(problems) <= self.eval_size:
                raise ValueError(f"{option('dataset', config.run.dataset)}: {len(problems)} lines leave none to "
                                 f"train on after holding out {option('eval_size', self.eval_size)}")
            cut = len(problems) - self.eval_size
            self.train_problems, self.eval_problems = problems[:cut], problems[cut:]
            self.train_size = cut

    # -- problems ----------------------------------------------------------------------
    def problem(self, index: int) -> Problem:
        """The index-th training problem: a task's prompt(index), or the dataset's
        lines in a fresh order each pass (seeded by the run's seed and the pass)."""
        if self.task is not None:
            return Problem(self.task.prompt(index))
        epoch, position = divmod(index, self.train_size)
        if self._order[0] != epoch:  # one shuffle per pass, not per look-up (47 ms at 100k lines)
            order = list(range(self.train_size))
            random.Random(f"{self.config.run.seed}/{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self.train_problems[self._order[1][position]]

    def eval_problem(self, index: int) -> Problem:
        if self.task is not None:
            return Problem(self.task.prompt(TASK_EVAL_OFFSET + index))
        return self.eval_problems[index]

    def prompt_ids(self, index: int, eval: bool = False) -> list[int]:
        problem = self.eval_problem(index) if eval else self.problem(index)
        return self.tokenizer.encode(problem.prompt)

    @property
    def supervised_warmup(self) -> bool:
        """Whether the trainer warms the built-in model up on the task's reference answers."""
        return bool(self.config.trainer.warmup_steps) and self.model is None and self.task.reference is not None

    # -- checks ------------------------------------------------------------------------
    def check_prompts_fit(self) -> None:
        """ValueError naming the first prompt that does not fit the model's context
        with the completion budget after it (every dataset line; a task's first
        prompts and its held-out ones), or whose characters a task's tokenizer lacks;
        with the supervised warm-up, the first warm-up prompts and their reference
        answers too (found in the trainer otherwise, after every executor started)."""
        limit = context_length(self.model_config)
        if self.supervised_warmup:
            from .learner import WARMUP_PROMPT_OFFSET

            for index in range(WARMUP_PROMPT_OFFSET, WARMUP_PROMPT_OFFSET + TASK_PROMPTS_CHECKED):
                prompt = self.task.prompt(index)
                try:
                    self.tokenizer.encode(prompt)
                    self.tokenizer.encode(self.task.reference(prompt))
                except Exception as exc:  # a bad character, or the user's reference failing
                    raise ValueError(f"task {self.task.name!r}, warm-up prompt {prompt!r} or its reference answer: "
                                     f"{type(exc).__name__}: {exc}") from None
        if self.task is not None:
            problems = [self.problem(i) for i in range(TASK_PROMPTS_CHECKED)]
        else:
            problems = list(self.train_problems)
        for problem in problems + [self.eval_problem(i) for i in range(self.eval_size)]:
            what = (f"line {problem.line} of {self.config.run.dataset}" if problem.line is not None
                    else f"prompt {prompt_text(problem.prompt)!r}")
            try:
                ids = self.tokenizer.encode(problem.prompt)
            except Exception as exc:  # a chat template refusing a message (jinja2's TemplateError), a bad character
                raise ValueError(f"{what}: cannot be encoded: {type(exc).__name__}: {exc}") from None
            if len(ids) + self.max_new_tokens > limit:
                raise ValueError(f"{what}: {len(ids)} prompt tokens + max_new_tokens {self.max_new_tokens} exceed "
                                 f"the model's context of {limit} tokens")
