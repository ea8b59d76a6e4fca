"""What an instance sends is bounded while parsing: an oversized field is a ProtocolError.

A hostile or broken instance's heartbeat, release or frame reaches Redis keys and Lua scripts;
the bounds in shared/protocol.py stop an oversized value at decode, before any handler. Each
case is paired with the largest value that still parses, so a bound set too tight fails too.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from shared import names
from shared.errors import ProtocolError
from shared.identity import new_user_seed, public_key
from shared.protocol import (
    FRAME_ENTRIES,
    HELD_MAX,
    FrameEntry,
    Heartbeat,
    Held,
    Release,
    TokenFrame,
    decode,
    encode,
)

HELD = Held(request_id="run-a:0:1:2", epoch=3)
ENTRY = FrameEntry.of(request_id="run-a:0:1:2", epoch=1, weight_version=0, offset=0,
                      token_ids=[5, 6])


def beat(**fields: Any) -> Heartbeat:
    return Heartbeat(**{"instance_id": "spot-0", "kind": "spot", "engine": "emu",
                        "state": "ready", **fields})


@pytest.mark.parametrize(("ok", "too_big"), [
    ({"engine": "e" * 64}, {"engine": "e" * 65}),
    ({"session": "s" * 64}, {"session": "s" * 65}),
    ({"run_id": "r" * 64}, {"run_id": "r" * 65}),
    ({"held": [HELD] * HELD_MAX}, {"held": [HELD] * (HELD_MAX + 1)}),
    ({"capacity": HELD_MAX}, {"capacity": HELD_MAX + 1}),
    ({"capacity": 1}, {"capacity": 0}),
    ({"weight_version": 2**31 - 1}, {"weight_version": 2**31}),
    ({"pid": 0}, {"pid": -1}),
    ({"metrics_port": 65535}, {"metrics_port": 65536}),
    ({"held": [Held(request_id="run-a:0:1:2", epoch=2**31 - 1)]},
     {"held": [Held(request_id="run-a:0:1:2", epoch=2**31)]}),
])
def test_heartbeat_fields_are_bounded(ok: dict[str, Any], too_big: dict[str, Any]) -> None:
    assert decode(encode(beat(**ok)), Heartbeat) == beat(**ok)
    with pytest.raises(ProtocolError):
        decode(encode(beat(**too_big)), Heartbeat)


def test_release_and_frame_fields_are_bounded() -> None:
    release = Release(instance_id="spot-0", held=[HELD] * HELD_MAX, session="s" * 64)
    assert decode(encode(release), Release) == release
    for bad in (msgspec.structs.replace(release, held=[HELD] * (HELD_MAX + 1)),
                msgspec.structs.replace(release, session="s" * 65)):
        with pytest.raises(ProtocolError):
            decode(encode(bad), Release)
    frame = TokenFrame(instance_id="spot-0", entries=[ENTRY] * FRAME_ENTRIES)
    assert len(decode(encode(frame), TokenFrame).entries) == FRAME_ENTRIES
    for entry in (msgspec.structs.replace(ENTRY, tokens=b"\0" * (4 << 18) + b"\0\0\0\0"),
                  msgspec.structs.replace(ENTRY, mac="m" * 129)):
        with pytest.raises(ProtocolError):
            decode(encode(TokenFrame(instance_id="spot-0", entries=[entry])), TokenFrame)


def test_instance_subjects_name_the_key_of_their_login() -> None:
    """The subjects the callout grants one login name its id and its key's fingerprint, and
    the manager reads both back; a subject of any other shape names no instance."""
    seed, other = new_user_seed(), new_user_seed()
    fp = names.fingerprint(public_key(seed))
    assert len(fp) == names.FINGERPRINT_LEN and fp != names.fingerprint(public_key(other))
    publish, subscribe = names.rollout_permissions("spot-0", fp)
    assert names.assign_subject("spot-0", fp) in subscribe
    assert names.assign_subject("spot-0") not in subscribe  # where no login may read
    assert not any(fp not in s for s in subscribe if s.startswith("rlb.inst."))
    assert {names.heartbeat_subject("spot-0", fp), names.release_subject("spot-0", fp)} \
        <= set(publish)
    assert names.release_subject("spot-0") not in publish
    assert names.chunk_subject("*", "spot-0", fp) in publish
    assert names.chunk_subject("*", "spot-0") not in publish
    assert names.chunk_sender(names.chunk_subject("run-a", "spot-0", fp)) == ("spot-0", fp)
    assert names.chunk_sender(names.chunk_subject("run-a", "spot-0")) == ("spot-0", "")
    assert names.chunk_sender(f"rlb.chunk.run-a.spot-0.{fp}.x") == ("", "")
    for subject in (names.heartbeat_subject("spot-0", fp), names.release_subject("spot-0", fp)):
        assert names.subject_owner(subject) == ("spot-0", fp)
    assert names.subject_owner(names.heartbeat_subject("spot-0")) == ("spot-0", "")
    for bad in (f"rlb.inst.heartbeat.spot-0.{fp}.x", "rlb.inst.heartbeat.spot-0.short",
                f"rlb.inst.heartbeat.spot-0.{fp.lower()}", "rlb.inst.heartbeat",
                "rlb.other.heartbeat.spot-0", "rlb.inst.heartbeat.spot:0"):
        assert names.subject_owner(bad) == ("", ""), bad
