"""Prompt text in, token ids out, and back: chat templates, system prompts, EOS ids.

Contract:

- :class:`ChatFormat` turns a dataset's prompt string into what the model is fed. With a chat
  template (``chat_template=True``, the default when the tokenizer has one) the prompt becomes
  one user message, after an optional ``system_prompt`` message, rendered by the tokenizer's
  own ``apply_chat_template(..., add_generation_prompt=True)``; the rendered text is then
  tokenized *without* added special tokens, because the template already wrote them (a second
  BOS would shift every position the model was trained on). Without a template the prompt is
  fed as is, with the tokenizer's usual special tokens (e.g. a BOS).
- ``decode`` gives a response's text with special tokens skipped: what reward functions see.
- :func:`eos_token_ids` is every id that ends a response: ``generation_config``'s
  ``eos_token_id`` (an int or a list; chat models list the end-of-turn token there), then the
  tokenizer's EOS if it is not among them. Engines stop on any of them.

Bad combinations fail at construction with :class:`ChatFormatError`, never on the first step.
Nothing here knows models or tensors: strings and id lists only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError


class ChatFormatError(ValueError):
    """A chat option that the tokenizer cannot honour; ``reason`` says which and why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A dataset prompt as the model sees it."""

    prompt: str  # the dataset's string, before any template
    prompt_text: str  # as fed to the model, template applied
    prompt_token_ids: list[int]


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template (a string, or a dict of named ones)."""
    return bool(getattr(tokenizer, "chat_template", None))


class ChatFormat:
    """Renders prompts and decodes responses for one tokenizer and one run's chat options."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: bool | None = None,
        system_prompt: str | None = None,
    ) -> None:
        available = has_chat_template(tokenizer)
        use_template = available if chat_template is None else chat_template
        if use_template and not available:
            raise ChatFormatError(
                "chat_template is true but the tokenizer has no chat template "
                "(set chat_template to false to feed prompts as plain text)"
            )
        if system_prompt is not None and not use_template:
            # Inventing a plain-text layout for it would train on a format no one asked for.
            raise ChatFormatError("system_prompt needs a chat template (chat_template is false)")
        self.tokenizer = tokenizer
        self.use_template = use_template
        self.system_prompt = system_prompt

    def messages(self, prompt: str) -> list[dict[str, str]]:
        """The conversation a prompt becomes: optional system message, then the user turn."""
        out = [] if self.system_prompt is None else [
            {"role": "system", "content": self.system_prompt}
        ]
        out.append({"role": "user", "content": prompt})
        return out

    def render(self, prompt: str) -> RenderedPrompt:
        """``prompt`` as text and token ids, ready for generation."""
        if not self.use_template:
            ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            return RenderedPrompt(prompt, prompt, ids)
        text = self.tokenizer.apply_chat_template(
            self.messages(prompt), tokenize=False, add_generation_prompt=True
        )
        if not isinstance(text, str):
            raise ChatFormatError(f"the chat template rendered {type(text).__name__}, not text")
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return RenderedPrompt(prompt, text, ids)

    def observation(self, text: str, turn_end: int) -> list[int]:
        """The ids of an environment's answer ``text`` after a model turn whose last sampled
        id is ``turn_end`` (its end-of-turn token): the template's tool message, then the
        generation prompt of the next model turn. Tokenized once, here; what the model
        sampled is never rendered again. The template's text between the two turns is found
        as the difference of two renderings (with and without the tool message), from where
        the model's turn ended; a template that knows no ``tool`` role gets the answer as a
        user message. Without a template the answer follows as plain text."""
        if not self.use_template:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        history = [*self.messages("\x00"), {"role": "assistant", "content": "\x01"}]
        base = self._render(history, generation_prompt=False)
        try:
            full = self._render([*history, {"role": "tool", "content": text}], True)
        except TemplateError:  # a template that refuses the role (raise_exception)
            full = self._render([*history, {"role": "user", "content": text}], True)
        ended = self.tokenizer.decode([turn_end])
        after_turn = base.index("\x01") + 1
        cut = base.find(ended, after_turn) if ended else -1
        if not full.startswith(base) or cut < 0:
            raise ChatFormatError("the chat template does not render a conversation as a "
                                  "prefix of its continuation; it cannot serve turns")
        rest = base[cut + len(ended):] + full[len(base):]
        return list(self.tokenizer(rest, add_special_tokens=False)["input_ids"])

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt)
        if not isinstance(text, str):
            raise ChatFormatError(f"the chat template rendered {type(text).__name__}, not text")
        return text

    def decode(self, token_ids: Sequence[int]) -> str:
        """A response's text, special tokens (EOS, end of turn, padding) skipped."""
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        return str(text)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def eos_token_ids(model_dir: Path | None, tokenizer: Any) -> list[int]:
    """Every token id that ends a response: the generation config's, then the tokenizer's.

    ``model_dir`` may be None (a tokenizer alone); a missing ``generation_config.json``
    falls back to the tokenizer's EOS. Raises ``ChatFormatError`` when neither names one:
    generation would then only ever stop at ``max_new_tokens``.
    """
    ids: list[int] = []
    if model_dir is not None:
        path = Path(model_dir) / "generation_config.json"
        if path.is_file():
            ids = _as_id_list(json.loads(path.read_text(encoding="utf-8")).get("eos_token_id"))
    ids += _as_id_list(getattr(tokenizer, "eos_token_id", None))
    unique = list(dict.fromkeys(ids))
    if not unique:
        raise ChatFormatError(
            f"no EOS token id in {model_dir}/generation_config.json or the tokenizer"
        )
    return unique
