"""A small arithmetic dataset with exact answers, for example runs on a real
model: `llamarl dataset arithmetic OUT.jsonl [--lines N] [--seed S]`.

Each line is {"prompt": ..., "answer": ...}: bare sums and differences ("What is
17 + 25?"), and word problems of one or two steps shaped like GSM8K's shortest
ones ("A baker makes 12 rolls and sells 5. How many rolls are left?"), with
whole-number answers. A third of the lines each kind, in a seeded order.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

NAMES = ("Ana", "Ben", "Carla", "Dev", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jack", "Kai", "Lena", "Mia", "Noah")
ITEMS = ("apples", "pencils", "marbles", "stickers", "cookies", "books", "coins", "shells", "cards", "eggs")
INSTRUCTION = "Give the final answer as a number."


def bare(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", a + b
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}?", a - b


def one_step(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
    if kind == 1:
        a = rng.randint(10, 50)
        b = rng.randint(1, a - 1)
        return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b
    if kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 12)
        return f"{name} buys {a} bags with {b} {item} in each bag. How many {item} is that in all?", a * b
    b, q = rng.randint(2, 9), rng.randint(2, 12)
    return f"{name} shares {b * q} {item} equally among {b} friends. How many {item} does each friend get?", q


def two_steps(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if rng.random() < 0.5:
        a, b, c = rng.randint(10, 40), rng.randint(2, 20), rng.randint(1, 9)
        return (f"{name} has {a} {item}, finds {b} more, then loses {c}. How many {item} does {name} have?",
                a + b - c)
    a, b, c = rng.randint(2, 6), rng.randint(2, 10), rng.randint(1, 15)
    return (f"{name} buys {a} boxes of {b} {item} and already had {c}. How many {item} does {name} have now?",
            a * b + c)


def arithmetic_problems(lines: int, seed: int = 0) -> list[dict]:
    """`lines` problems {"prompt", "answer"}, a third of each kind, shuffled."""
    if lines < 1:
        raise ValueError(f"lines must be >= 1, got {lines}")
    rng = random.Random(seed)
    makers = (bare, one_step, two_steps)
    rows = []
    for i in range(lines):
        question, answer = makers[i % len(makers)](rng)
        rows.append({"prompt": f"{question} {INSTRUCTION}", "answer": str(answer)})
    rng.shuffle(rows)
    return rows


def main(argv=None) -> int:
    from ..cli import HelpFormatter

    parser = argparse.ArgumentParser(prog="llamarl dataset arithmetic", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("out", type=Path, help="the JSONL file to write")
    parser.add_argument("--lines", type=int, default=600, help="problems to write (default 600)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)
    try:
        rows = arithmetic_problems(args.lines, args.seed)
    except ValueError as exc:
        raise SystemExit(f"llamarl dataset arithmetic: {exc}") from None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} problems to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
