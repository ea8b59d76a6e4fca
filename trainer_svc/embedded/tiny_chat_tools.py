"""The embedded text model ``"tiny-chat-tools"``: tiny-chat warmed up to use the calculator.

Contract:

- ``build_tiny_chat_tools(data_dir, seed)`` returns an HF model directory
  ``data_dir/models/tiny-chat-tools-<hash>/`` laid out as tiny-chat's (same architecture, chat
  template, special tokens and generation config; built once, atomically). ``<hash>`` covers
  tiny-chat's key for the seed (its whole recipe) and this module's recipe.
- The tokenizer is tiny-chat's pipeline trained on tiny-chat's corpus plus the tool
  conversations' text, so ``<calc>``, ``</calc>`` and ``tool`` are a few tokens each.
- The warm-up is tiny-chat's (same steps, batch, schedule, loss on the model's turns only)
  on a mixture. With probability ``TOOL_SHARE`` a problem becomes a conversation with the
  ``calculator`` environment (``trainer_svc/inputs/calculator.py``): an assistant turn
  ``<calc>EXPRESSION</calc>`` (the worked equation's left side, ``7+5``), the tool's answer as
  the chat template renders it between turns (the ids the trainer's ``ChatFormat.observation``
  gives; no loss on them), then an assistant turn ``#### VALUE``. Otherwise it is tiny-chat's
  direct answer, whose final value is wrong with probability ``WARMUP_NOISE``.
- Why this mixture: the tool path is right whenever the expression is (the calculator does
  the arithmetic), the direct path half the time. The warmed-up policy calls the tool on
  about ``TOOL_SHARE`` of its samples; RL with the calculator environment has one habit to
  learn, calling it, and the reward rises as it does. Greedy decoding of the warmed-up model
  answers directly; the trained one calls the tool.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from trainer_svc.embedded import tiny_chat, word_problems
from trainer_svc.embedded.model_dir import build_once

NAME = "tiny-chat-tools"
TOOL_SHARE = 0.3
CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"  # the calculator environment's call syntax
TOOL_ROLE = "tool"
# Bump when the recipe changes in a way the hash inputs do not capture.
BUILDER_VERSION = 1


def tiny_chat_tools_key(seed: int) -> str:
    """The cache key (directory suffix) of the tiny-chat-tools model built with ``seed``."""
    spec = {
        "tiny_chat": tiny_chat.tiny_chat_key(seed),
        "tools": [TOOL_SHARE, CALL_OPEN, CALL_CLOSE, TOOL_ROLE],
        "builder": BUILDER_VERSION,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def expression(problem: word_problems.Problem) -> str:
    """What the model asks the calculator: the worked equation's left side (``7+5``)."""
    return problem.answer.split("=", 1)[0]


def tool_call(problem: word_problems.Problem) -> str:
    return f"{CALL_OPEN}{expression(problem)}{CALL_CLOSE}"


def _corpus() -> list[str]:
    train, _ = word_problems.splits()
    tools = [f"user\n{p.prompt}\nassistant\n{tool_call(p)}\n{TOOL_ROLE}\n{p.value}\n"
             f"assistant\n#### {p.value}\n" for p in train]
    return tiny_chat.corpus() + tools


def train_tokenizer() -> PreTrainedTokenizerFast:
    return tiny_chat.train_tokenizer(texts=_corpus())


def observation_text(tokenizer: PreTrainedTokenizerFast, value: str) -> str:
    """The text after a model turn's end-of-turn token up to the next model turn: the template's
    tool message holding ``value``, then its generation prompt."""
    turn = [{"role": "assistant", "content": ""}]
    base = tokenizer.apply_chat_template(turn, tokenize=False)
    full = tokenizer.apply_chat_template([*turn, {"role": TOOL_ROLE, "content": value}],
                                         tokenize=False, add_generation_prompt=True)
    if not (isinstance(base, str) and isinstance(full, str) and full.startswith(base)):
        raise TypeError("tiny-chat's template must render a conversation as text, as a prefix "
                        "of its continuation")
    ended = base.rindex(tiny_chat.IM_END) + len(tiny_chat.IM_END)
    return base[ended:] + full[len(base):]


def mixed_target(tokenizer: PreTrainedTokenizerFast) -> tiny_chat.Target:
    """The warm-up target (module docstring): a tool conversation or a noisy direct answer."""
    im_end = tiny_chat.token_id(tokenizer, tiny_chat.IM_END)
    direct = tiny_chat.answer_target(tokenizer)

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def target(problem: word_problems.Problem, rng: random.Random) -> list[tuple[list[int], bool]]:
        if rng.random() >= TOOL_SHARE:
            return direct(problem, rng)
        return [([*ids(tool_call(problem)), im_end], True),
                (ids(observation_text(tokenizer, str(problem.value))), False),
                ([*ids(f"#### {problem.value}"), im_end], True)]

    return target


def build_tiny_chat_tools(data_dir: Path, seed: int) -> Path:
    """Build (or return the cached) tiny-chat-tools directory for ``seed`` under ``data_dir``."""
    final = Path(data_dir) / "models" / f"{NAME}-{tiny_chat_tools_key(seed)}"
    return build_once(final, lambda out_dir: tiny_chat.build_into(
        out_dir, seed, final.name, train_tokenizer(), mixed_target, f"{NAME}-warmup"))
