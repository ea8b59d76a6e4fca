"""Generated GSM8K-style word problems: the text task the embedded ``"tiny-chat"`` model learns.

Contract:

- A :class:`Problem` is a ``prompt`` (one or two arithmetic operations on small whole numbers,
  phrased in words) and an ``answer`` in GSM8K's shape: a worked equation, a newline, then
  ``#### <value>``. ``value`` is the whole-number result, never negative.
- ``generate(seed, n)`` and ``splits(seed, n_train, n_eval)`` are pure functions of their
  arguments (a private ``random.Random``, never the global RNG). ``splits`` never puts a prompt
  in both splits, so the eval split is held out text, not a re-draw of training prompts.
- The files shipped under ``examples/data/`` are ``python -m trainer_svc.embedded.word_problems
  --out examples/data`` with the defaults below; a test checks they still equal the generator's
  output. The tiny-chat builder calls this module rather than reading those files, so a model
  builds wherever the package is installed (the images copy packages, not ``examples/``).

Bump ``GENERATOR_VERSION`` whenever the output changes: cached tiny-chat models are keyed on it.

Why these problems: a sub-million-parameter model trained for a minute on one core can learn
to copy two or three numbers out of a sentence and add or subtract one-digit ones, imperfectly.
Every operand is a single digit (a subtraction's first one excepted: it is a sum's result)
and every answer at most 20, so an answer is one or two digit tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

GENERATOR_VERSION = 1
DEFAULT_SEED = 0
DEFAULT_TRAIN = 3000
DEFAULT_EVAL = 200
TRAIN_FILE = "word-problems-train.jsonl"
EVAL_FILE = "word-problems-eval.jsonl"

# (name, subject pronoun)
PEOPLE: list[tuple[str, str]] = [
    ("Tom", "He"), ("Anna", "She"), ("Ben", "He"), ("Maria", "She"), ("Sam", "He"),
    ("Lucy", "She"), ("Omar", "He"), ("Mia", "She"), ("Jack", "He"), ("Zoe", "She"),
    ("Ravi", "He"), ("Lena", "She"), ("Leo", "He"), ("Emma", "She"), ("Noah", "He"),
    ("Sara", "She"),
]
ITEMS: list[str] = [
    "apples", "pencils", "marbles", "stickers", "books", "cookies", "shells", "cards",
    "coins", "stamps", "balloons", "crayons", "eggs", "flowers", "toy cars", "buttons",
]
CONTAINERS: list[str] = ["bags", "boxes", "jars", "baskets", "packs"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One word problem: the prompt text, its GSM8K-style answer, and the final value."""

    prompt: str
    answer: str
    value: int

    def to_json(self) -> dict[str, str]:
        return {"prompt": self.prompt, "answer": self.answer}


def _answer(equation: str, value: int) -> str:
    return f"{equation}={value}\n#### {value}"


def _add(rng: random.Random) -> Problem:
    (name, he), item = rng.choice(PEOPLE), rng.choice(ITEMS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    prompt = rng.choice([
        f"{name} has {a} {item}. {he} gets {b} more {item}. How many {item} does {name} have now?",
        f"{name} had {a} {item} and found {b} more. How many {item} does {name} have?",
    ])
    return Problem(prompt, _answer(f"{a}+{b}", a + b), a + b)


def _sub(rng: random.Random) -> Problem:
    (name, he), (friend, _), item = rng.choice(PEOPLE), rng.choice(PEOPLE), rng.choice(ITEMS)
    b = rng.randint(2, 9)
    a = rng.randint(b + 1, b + 9)
    friend = friend if friend != name else "a friend"
    prompt = rng.choice([
        f"{name} has {a} {item}. {he} gives {b} {item} to {friend}. "
        f"How many {item} does {name} have left?",
        f"{name} had {a} {item} and lost {b} of them. How many {item} are left?",
    ])
    return Problem(prompt, _answer(f"{a}-{b}", a - b), a - b)


def _mul(rng: random.Random) -> Problem:
    (name, _), item, box = rng.choice(PEOPLE), rng.choice(ITEMS), rng.choice(CONTAINERS)
    a, b = rng.randint(2, 4), rng.randint(2, 5)
    prompt = (
        f"{name} has {a} {box} with {b} {item} in each. How many {item} does {name} have in all?"
    )
    return Problem(prompt, _answer(f"{a}*{b}", a * b), a * b)


def _add_sub(rng: random.Random) -> Problem:
    (name, he), item = rng.choice(PEOPLE), rng.choice(ITEMS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(2, min(9, a + b - 1))
    prompt = (
        f"{name} has {a} {item}. {he} buys {b} more and then gives away {c}. "
        f"How many {item} does {name} have now?"
    )
    value = a + b - c
    return Problem(prompt, _answer(f"{a}+{b}-{c}", value), value)


# Weights: mostly one operation, a quarter two-step problems for a harder tail.
KINDS: list[tuple[Callable[[random.Random], Problem], int]] = [
    (_add, 3), (_sub, 3), (_mul, 1), (_add_sub, 2),
]


def _rng(seed: int, stream: str) -> random.Random:
    # A string seed is hashed with sha512 by random.Random: stable across processes/versions.
    return random.Random(f"word-problems/v{GENERATOR_VERSION}/{seed}/{stream}")


def _draw(rng: random.Random) -> Problem:
    makers = [k for k, _ in KINDS]
    weights = [w for _, w in KINDS]
    return rng.choices(makers, weights=weights)[0](rng)


def generate(seed: int, n: int) -> list[Problem]:
    """``n`` problems drawn from ``seed``; repeats are possible (see ``splits`` for unique ones)."""
    rng = _rng(seed, "draw")
    return [_draw(rng) for _ in range(n)]


def splits(
    seed: int = DEFAULT_SEED, n_train: int = DEFAULT_TRAIN, n_eval: int = DEFAULT_EVAL
) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train and eval problems: every prompt appears once, in one split only."""
    rng = _rng(seed, "splits")
    seen: set[str] = set()
    out: list[Problem] = []
    while len(out) < n_train + n_eval:
        p = _draw(rng)
        if p.prompt not in seen:
            seen.add(p.prompt)
            out.append(p)
    return out[:n_train], out[n_train:]


def to_jsonl(problems: Iterable[Problem]) -> str:
    """One ``{"prompt", "answer"}`` object per line, keys in that order, UTF-8 as is."""
    return "".join(json.dumps(p.to_json(), ensure_ascii=False) + "\n" for p in problems)


def write_splits(out_dir: Path, seed: int = DEFAULT_SEED) -> tuple[Path, Path]:
    """Write the default train and eval files into ``out_dir``; returns their paths."""
    train, held_out = splits(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = (out_dir / TRAIN_FILE, out_dir / EVAL_FILE)
    for path, problems in zip(paths, (train, held_out), strict=True):
        path.write_text(to_jsonl(problems), encoding="utf-8")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    for path in write_splits(args.out, args.seed):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
