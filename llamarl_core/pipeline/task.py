"""Tasks: prompts, a rule-based reward, and the character-level tokenizer.

A task is what a user plugs in: `Task(prompt, reward, alphabet, reference)`.
`prompt(index)` gives the index-th prompt (so a run's data position is one
integer that a checkpoint keeps), `reward(prompt, completion)` scores a decoded
completion (any float; the trainer centres rewards per prompt group), and
`reference(prompt)` (optional) gives a correct completion for the supervised
warm-up. `load_task("module:attribute")` imports a Task, or a callable returning
one, in whichever process needs it (the reward executor, the trainer).

The embedded default, `reverse_task`, asks for a string of letters reversed:
"cabd=" -> "dbac". Its reward is the fraction of positions right (over the longer
of answer and target), so a partly right answer earns partial credit and the
policy gradient has something to climb from the first step.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from dataclasses import dataclass

PAD, BOS, EOS = 0, 1, 2
SPECIAL_TOKENS = 3


class CharTokenizer:
    """One token per character of `alphabet`, after pad (0), bos (1) and eos (2)."""

    def __init__(self, alphabet: str):
        if len(set(alphabet)) != len(alphabet) or not alphabet:
            raise ValueError(f"alphabet must be non-empty characters without repeats, got {alphabet!r}")
        self.alphabet = alphabet
        self.ids = {c: i + SPECIAL_TOKENS for i, c in enumerate(alphabet)}
        self.vocab_size = len(alphabet) + SPECIAL_TOKENS
        self.pad_token_id, self.bos_token_id, self.eos_token_id = PAD, BOS, EOS
        self.stop_token_ids = (EOS,)  # what ends a completion (ModelTokenizer's may hold more)

    def encode(self, text: str) -> list[int]:
        """bos, then one id per character; a character outside the alphabet raises."""
        try:
            return [BOS] + [self.ids[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} of {text!r} is not in the task's alphabet {self.alphabet!r}") from None

    def to_transformers(self):
        """A transformers PreTrainedTokenizerFast with exactly these ids: one token per
        character, bos prepended, decoding concatenates (for exported models and
        for peers that take a transformers tokenizer)."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **self.ids}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
        tok.decoder = decoders.Fuse()
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                       padding_side="left")

    def decode(self, ids) -> str:
        """Characters up to the first eos; pad and bos are skipped."""
        out = []
        for i in ids:
            if i == EOS:
                break
            if i >= SPECIAL_TOKENS:
                out.append(self.alphabet[i - SPECIAL_TOKENS])
        return "".join(out)


@dataclass(frozen=True)
class Task:
    """See the module docstring. max_new_tokens: completion budget, eos included."""

    name: str
    prompt: Callable[[int], str]
    reward: Callable[[str, str], float]
    alphabet: str
    max_new_tokens: int
    reference: Callable[[str], str] | None = None

    def tokenizer(self) -> CharTokenizer:
        return CharTokenizer(self.alphabet)


def load_task(spec: str) -> Task:
    """'module:attribute' -> the Task it names (or that the named callable returns)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"a task is given as 'module:attribute', got {spec!r}")
    try:
        obj = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load task {spec!r}: {exc} (modules load from the installed packages and the "
                         "working folder)") from exc
    task = obj() if callable(obj) and not isinstance(obj, Task) else obj
    if not isinstance(task, Task):
        raise TypeError(f"task {spec!r} gave {type(task).__name__}, not a llamarl_core.pipeline.Task")
    return task


# ----------------------------------------------------------------------------- default task

REVERSE_LETTERS = "abcdefgh"
REVERSE_MIN_LEN, REVERSE_MAX_LEN = 3, 6


def reverse_prompt(index: int, seed: int = 0) -> str:
    rng = random.Random(index * 1_000_003 + seed)
    length = rng.randint(REVERSE_MIN_LEN, REVERSE_MAX_LEN)
    return "".join(rng.choice(REVERSE_LETTERS) for _ in range(length)) + "="


def reverse_reference(prompt: str) -> str:
    return prompt.rstrip("=")[::-1]


def positional_match(target: str, answer: str) -> float:
    """Fraction of positions where answer and target agree, over the longer of the two."""
    longest = max(len(target), len(answer))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(target, answer)) / longest


def reverse_reward(prompt: str, completion: str) -> float:
    return positional_match(reverse_reference(prompt), completion)


def reverse_task() -> Task:
    return Task(
        name="reverse",
        prompt=reverse_prompt,
        reward=reverse_reward,
        alphabet=REVERSE_LETTERS + "=",
        max_new_tokens=REVERSE_MAX_LEN + 1,
        reference=reverse_reference,
    )
