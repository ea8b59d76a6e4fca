"""Turns to loss masks (shared.turns), and turns in the barrier digest (shared.digest)."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from shared.digest import sample_digest
from shared.protocol import Sample, decode, encode
from shared.turns import Turn, TurnsError, check_turns, loss_mask


def _model(start: int, end: int) -> Turn:
    return Turn(role="model", start=start, end=end)


def _obs(start: int, end: int, call_id: str = "c0", text: str = "42") -> Turn:
    return Turn(role="observation", start=start, end=end, call_id=call_id, observation=text)


TURNS = [_model(0, 3), _obs(3, 5), _model(5, 6), _obs(6, 6, "c1", ""), _model(6, 8)]


def _sample(turns: list[Turn] | None = None, response: list[int] | None = None,
            p: int = 0, s: int = 0) -> Sample:
    return Sample(request_id=f"r:0:{p}:{s}", prompt_index=p, sample_index=s, weight_version=0,
                  prompt_token_ids=[1, 2], response_token_ids=response or list(range(10, 18)),
                  finish_reason="stop", instances=["i1"], turns=turns or [])


def test_model_tokens_are_trained_and_observation_tokens_are_not() -> None:
    assert loss_mask(TURNS, 8) == [1, 1, 1, 0, 0, 1, 1, 1]
    assert loss_mask([], 5) == [1] * 5  # no turns: the whole response, as before turns
    assert loss_mask([_obs(0, 2)], 2) == [0, 0]
    # A mask the sample carries must be the one its turns give.
    assert loss_mask(TURNS, 8, [1, 1, 1, 0, 0, 1, 1, 1]) == [1, 1, 1, 0, 0, 1, 1, 1]
    with pytest.raises(TurnsError, match="differs from the turns'"):
        loss_mask(TURNS, 8, [1] * 8)
    with pytest.raises(TurnsError, match="differs"):
        loss_mask([], 3, [1, 0, 1])


@pytest.mark.parametrize(("turns", "n", "problem"), [
    ([_model(1, 3)], 3, "turn 0: starts at token 1, want 0"),
    ([_model(0, 3), _obs(4, 5)], 5, "turn 1: starts at token 4, want 3"),  # a gap
    ([_model(0, 3), _obs(2, 5)], 5, "turn 1: starts at token 2, want 3"),  # an overlap
    ([_obs(3, 5), _model(0, 3)], 5, "turn 0: starts at token 3"),  # out of order
    ([_model(0, 3), _obs(3, 2)], 3, "turn 1: ends at 2, before its start 3"),
    ([_model(0, 9)], 8, "turn 0: ends at 9, past the response's 8 tokens"),
    ([_model(0, 5)], 8, "turns end at token 5 but the response has 8 tokens"),
    ([Turn(role="tool", start=0, end=8)],  # type: ignore[arg-type]
     8, "turn 0: role 'tool' is not one of"),
])
def test_bad_turns_are_a_clear_error(turns: list[Turn], n: int, problem: str) -> None:
    with pytest.raises(TurnsError, match=problem.replace("(", r"\(")):
        check_turns(turns, n)
    with pytest.raises(TurnsError):
        loss_mask(turns, n)


def test_samples_carry_turns_over_the_wire_and_refuse_unknown_roles() -> None:
    sample = _sample(TURNS)
    back = decode(encode(sample), Sample)
    assert back.turns == TURNS and back.turns[1].call_id == "c0"
    # A single-turn sample from before turns existed still decodes, with none.
    old = msgspec.json.encode({k: v for k, v in msgspec.structs.asdict(_sample()).items()
                               if k not in ("turns", "loss_mask")})
    assert msgspec.json.decode(old, type=Sample).turns == []
    bad = msgspec.json.encode({**msgspec.to_builtins(sample),
                               "turns": [{"role": "tool", "start": 0, "end": 8}]})
    with pytest.raises(msgspec.ValidationError, match="role"):
        msgspec.json.decode(bad, type=Sample)


def test_the_digest_covers_turns_and_is_unchanged_without_them() -> None:
    plain = [_sample(p=0), _sample(p=1)]
    # The format before turns, written out: a regression here breaks every stored digest.
    rows = sorted((p, hashlib.sha256(f"{p}:0:0|1,2|10,11,12,13,14,15,16,17;".encode()).digest())
                  for p in (0, 1))
    h = hashlib.sha256()
    for _, row in rows:
        h.update(row)
    assert sample_digest(plain).sha256 == h.hexdigest()
    assert (sample_digest(plain).responses, sample_digest(plain).tokens) == (2, 16)

    turned = [_sample(TURNS, p=0), _sample(p=1)]
    assert sample_digest(turned) != sample_digest(plain)
    assert sample_digest(turned).tokens == 16  # tokens are tokens, trained or not
    # Any field of a turn changes it: its range, its role, its call id, its observation.
    variants = [
        [_model(0, 2), _obs(2, 5), *TURNS[2:]],
        [_model(0, 3), _model(3, 5), *TURNS[2:]],
        [TURNS[0], _obs(3, 5, call_id="c9"), *TURNS[2:]],
        [TURNS[0], _obs(3, 5, text="41"), *TURNS[2:]],
    ]
    digests = {sample_digest([_sample(t, p=0), _sample(p=1)]).sha256 for t in variants}
    assert len(digests) == len(variants)
    assert sample_digest(turned).sha256 not in digests
    assert sample_digest(turned) == sample_digest([_sample(list(TURNS), p=0), _sample(p=1)])
