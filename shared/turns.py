"""A multi-turn sample's turns, and the loss mask they give its response tokens.

Contract: a multi-turn trajectory is the prompt's ids, then alternating model turns (sampled,
trained) and observation turns (a tool's output, tokenized once, never trained). A sample
carries them as ``turns``: one :class:`Turn` per turn, each naming its token range
``[start, end)`` within ``response_token_ids``. :func:`loss_mask` is the one place that turns
become the per-token loss mask the trainer multiplies into every loss term (1: a model-turn
token, trained; 0: an observation token, no gradient and no place in any denominator).

Valid turns cover the response exactly, in order: the first starts at 0, each starts where the
previous ended, the last ends at the response's length; a turn may be empty (an observation cut
to nothing by its token budget). No turns at all is a single-turn sample: one model turn over
the whole response, trained exactly as before turns existed. Anything else is a
:class:`TurnsError` naming the turn and what is wrong with it: a mask that silently trained an
observation, or dropped a model token, would bias the gradient without any visible failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

# The emulated model's turns (EMULATION): its content ids start at EMU_FIRST_TOKEN (those below
# are pad/bos/eos in most vocabularies), and every emu observation ends with EMU_TURN_MARK, an
# id no content token takes, so its engine finds where a model turn starts from the committed
# ids alone (rollout_svc.engines.emu, trainer_svc.agentic.EmuTurns).
EMU_FIRST_TOKEN = 3
EMU_TURN_MARK = 1

Role = Literal["model", "observation"]
ROLES: tuple[Role, ...] = ("model", "observation")


class Turn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One turn of a trajectory: who produced tokens ``[start, end)`` of the response."""

    role: Role
    start: int  # first token of the turn, an index into response_token_ids
    end: int  # one past its last token
    call_id: str = ""  # the tool call an observation answers ("" for a model turn)
    observation: str = ""  # the observation's text as the environment returned it


class TurnsError(ValueError):
    """A sample's turns do not describe its response tokens (the message says how)."""


def check_turns(turns: Sequence[Turn], n_tokens: int) -> None:
    """Raise :class:`TurnsError` unless ``turns`` cover ``n_tokens`` response tokens exactly,
    in order, with known roles (module doc); no turns is always valid."""
    at = 0
    for i, t in enumerate(turns):
        if t.role not in ROLES:
            raise TurnsError(f"turn {i}: role {t.role!r} is not one of {', '.join(ROLES)}")
        if t.start != at:
            raise TurnsError(f"turn {i}: starts at token {t.start}, want {at} (turns must be "
                             "in order, each starting where the previous ended)")
        if t.end < t.start:
            raise TurnsError(f"turn {i}: ends at {t.end}, before its start {t.start}")
        if t.end > n_tokens:
            raise TurnsError(f"turn {i}: ends at {t.end}, past the response's {n_tokens} "
                             "tokens")
        at = t.end
    if turns and at != n_tokens:
        raise TurnsError(f"turns end at token {at} but the response has {n_tokens} tokens")


def loss_mask(turns: Sequence[Turn], n_tokens: int,
              given: Sequence[int] | None = None) -> list[int]:
    """Per response token: 1 where a model turn produced it, 0 in an observation turn.

    With no turns every token is trained. ``given`` is a mask the sample already carries (its
    ``loss_mask`` field); when non-empty it must equal the one the turns give, or the two
    writers disagree about what is trained and neither can be trusted.
    """
    check_turns(turns, n_tokens)
    if not turns:
        mask = [1] * n_tokens
    else:
        mask = []
        for t in turns:
            mask += [1 if t.role == "model" else 0] * (t.end - t.start)
    if given and list(given) != mask:
        raise TurnsError(f"loss_mask {_brief(given)} differs from the turns' {_brief(mask)}")
    return mask


def response_turns(stored: str | None, tokens: str) -> list[Turn]:
    """A stored agentic response's turns: its observation turns as the manager keeps them
    (``stored``, the JSON list of [start, end, call id, text] manager_svc/lua/turn.lua
    writes), with the model turns between them, over its ``tokens`` (their CSV). None
    stored: a single-turn response, no turns."""
    if not stored:
        return []
    n = tokens.count(",") + 1 if tokens else 0
    out: list[Turn] = []
    at = 0
    for start, end, call_id, text in msgspec.json.decode(stored):
        if start > at:
            out.append(Turn(role="model", start=at, end=int(start)))
        out.append(Turn(role="observation", start=int(start), end=int(end),
                        call_id=str(call_id), observation=str(text)))
        at = int(end)
    if n > at:
        out.append(Turn(role="model", start=at, end=n))
    return out


def _brief(mask: Sequence[int]) -> str:
    text = "".join(str(int(m)) for m in mask)
    return text if len(text) <= 40 else f"{text[:37]}... ({len(text)} tokens)"
