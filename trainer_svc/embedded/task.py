"""The embedded verifiable task: continue an arithmetic sequence of digits, mod 10.

Contract (other services call these names; token ids are part of the wire format, so they
never change without bumping ``TASK_VERSION``):

- A prompt is ``[BOS, a, d, SEP]`` where ``a`` (start digit, 0..9) and ``d`` (step, 1..3) are
  digit tokens. The correct response is the next ``RESPONSE_LEN`` terms
  ``(a + d) % 10, (a + 2d) % 10, ...`` as digit tokens, followed by ``EOS``.
- ``reward(prompt, response)`` is partial credit in ``[0, 1]``:

  1. The response is cut at its first ``EOS`` (everything after it is ignored by the content
     check, but counts as malformed, see 3); the part before it is the *answer*.
  2. ``base = (number of i < RESPONSE_LEN with answer[i] == reference[i]) / RESPONSE_LEN``.
     A missing or extra answer position simply earns nothing at that position.
  3. The response is *well-formed* iff it is exactly ``RESPONSE_LEN`` tokens followed by one
     ``EOS`` and nothing else. A malformed response earns ``base * MALFORMED_FACTOR``
     (0.8): the digits still count, the format costs a fifth. So a perfect answer is 1.0,
     a perfect answer without its EOS (e.g. truncated by ``max_new_tokens``) is 0.8,
     and a response with no correct digit is 0.0, well-formed or not.

- ``make_prompts(seed, step, n)`` is a pure function of its arguments: it draws from a private
  ``random.Random`` seeded from ``(seed, step)``, never from the global RNG, so any process
  (trainer, manager, tests) regenerates the same prompts for a run step.

The task knows nothing of models or tensors: only token id lists.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

TASK_NAME = "arith-seq"
# Bump when ids, prompt format or reward change: cached warm-up models are keyed on it.
TASK_VERSION = 1

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SEP_ID = 3
_DIGIT_BASE = 4  # token id of "0"; "9" is 13

VOCAB: list[str] = ["<pad>", "<bos>", "<eos>", "<sep>"] + [str(d) for d in range(10)]
DIGIT_IDS: list[int] = list(range(_DIGIT_BASE, _DIGIT_BASE + 10))

RESPONSE_LEN = 5
# Room for the answer, its EOS and two spare tokens, so a rambling policy is visibly malformed
# rather than silently truncated at exactly the right length.
DEFAULT_MAX_NEW_TOKENS = 8
PROMPT_LEN = 4
MALFORMED_FACTOR = 0.8

MIN_STEP = 1
MAX_STEP = 3


def digit_id(digit: int) -> int:
    """Token id of the digit ``digit`` (0..9)."""
    if not 0 <= digit <= 9:
        raise ValueError(f"not a digit: {digit}")
    return _DIGIT_BASE + digit


def id_digit(token_id: int) -> int | None:
    """The digit a token id stands for, or None for a special token or an unknown id."""
    d = token_id - _DIGIT_BASE
    return d if 0 <= d <= 9 else None


def make_prompt(start: int, step: int) -> list[int]:
    """The prompt for the sequence that starts at digit ``start`` and advances by ``step``."""
    if not MIN_STEP <= step <= MAX_STEP:
        raise ValueError(f"step {step} outside {MIN_STEP}..{MAX_STEP}")
    return [BOS_ID, digit_id(start), digit_id(step), SEP_ID]


def all_prompts() -> list[list[int]]:
    """Every distinct prompt of the task (30 of them), in a fixed order."""
    return [make_prompt(a, d) for d in range(MIN_STEP, MAX_STEP + 1) for a in range(10)]


def _parse_prompt(prompt_token_ids: Sequence[int]) -> tuple[int, int]:
    if len(prompt_token_ids) != PROMPT_LEN:
        raise ValueError(f"prompt must have {PROMPT_LEN} tokens, got {list(prompt_token_ids)}")
    bos, a_id, d_id, sep = prompt_token_ids
    a, d = id_digit(a_id), id_digit(d_id)
    if bos != BOS_ID or sep != SEP_ID or a is None or d is None or not MIN_STEP <= d <= MAX_STEP:
        raise ValueError(f"not a task prompt: {list(prompt_token_ids)}")
    return a, d


def reference_response(prompt_token_ids: list[int]) -> list[int]:
    """The correct response to a prompt: ``RESPONSE_LEN`` digit tokens then ``EOS``."""
    a, d = _parse_prompt(prompt_token_ids)
    return [digit_id((a + k * d) % 10) for k in range(1, RESPONSE_LEN + 1)] + [EOS_ID]


def reward(prompt_token_ids: list[int], response_token_ids: list[int]) -> float:
    """Partial credit in [0, 1] for a response; the rules are in the module docstring.

    Raises ValueError for a prompt that is not a task prompt: a reward for a prompt this task
    never issued would be a silent bug upstream.
    """
    target = reference_response(prompt_token_ids)[:RESPONSE_LEN]
    response = list(response_token_ids)
    cut = response.index(EOS_ID) if EOS_ID in response else len(response)
    answer = response[:cut]
    correct = sum(1 for got, want in zip(answer, target, strict=False) if got == want)
    base = correct / RESPONSE_LEN
    well_formed = cut == RESPONSE_LEN and len(response) == RESPONSE_LEN + 1
    return base if well_formed else base * MALFORMED_FACTOR


def _rng(seed: int, step: int) -> random.Random:
    # Hash (seed, step) rather than e.g. seed * K + step, so nearby runs and steps do not
    # share streams; sha256 is stable across processes, unlike hash().
    digest = hashlib.sha256(f"{TASK_NAME}/{seed}/{step}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def make_prompts(seed: int, step: int, n: int) -> list[list[int]]:
    """``n`` prompts for step ``step`` of a run seeded ``seed``; a pure function of its inputs.

    Prompts are drawn with replacement (the task has only 30 distinct prompts).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = _rng(seed, step)
    return [
        make_prompt(rng.randrange(10), rng.randint(MIN_STEP, MAX_STEP)) for _ in range(n)
    ]


def detokenize(token_ids: Sequence[int]) -> str:
    """Token ids as space-separated vocabulary strings (for logs and debugging)."""
    return " ".join(VOCAB[t] if 0 <= t < len(VOCAB) else f"<unk:{t}>" for t in token_ids)
