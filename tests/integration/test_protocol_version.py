"""An instance of another protocol version is refused at join, both versions named: on a real
manager process and real NATS, a heartbeat of a later version, and one of an image from before
versions (no ``protocol`` field, and a field this release does not know), each get a
:class:`~shared.protocol.Refused` the instance reads, counted and logged once per instance, and
never register; a rollout instance so refused leaves with an error naming both versions."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import nats

from rlboost.stack import Stack
from rollout_svc.engines import create_engine
from rollout_svc.service import RolloutService
from shared import names
from shared.config import RolloutConfig
from shared.protocol import (
    PROTOCOL_VERSION,
    Heartbeat,
    HeartbeatReply,
    Refused,
    decode_beat_reply,
    encode,
)
from tests.integration.test_manager_api import metric
from tests.support.manager import running_manager


def beat_json(instance_id: str, **changes: object) -> bytes:
    """A heartbeat of this release, with ``changes`` (None: the field left out)."""
    body = json.loads(encode(Heartbeat(instance_id=instance_id, kind="spot", engine="emu",
                                       state="ready")))
    body.update(changes)
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()


def test_a_beat_of_another_version_is_refused_naming_both(brokers: Stack,
                                                          tmp_path: Path) -> None:
    async def exchange() -> list[HeartbeatReply | Refused]:
        nc = await nats.connect(brokers.nats.url, inbox_prefix=names.inbox_prefix("spot-1"))
        replies = []
        for data in (beat_json("spot-1", protocol=PROTOCOL_VERSION + 1),
                     beat_json("spot-1", protocol=PROTOCOL_VERSION + 1),  # logged once
                     beat_json("spot-1", protocol=None, decode_steps=7),  # before versions
                     beat_json("spot-1")):
            msg = await nc.request(names.heartbeat_subject("spot-1"), data, timeout=5)
            replies.append(decode_beat_reply(msg.data))
            if isinstance(replies[-1], Refused):
                listed = manager.get("/v1/instances").json()
                assert listed == [], listed  # refused ones never register
        await nc.close()
        return replies

    with running_manager(brokers, tmp_path) as manager:
        later, again, legacy, current = asyncio.run(exchange())
        assert isinstance(later, Refused) and isinstance(legacy, Refused)
        assert f"version {PROTOCOL_VERSION + 1}" in later.detail
        assert f"speaks {PROTOCOL_VERSION}" in later.detail and "spot-1" in later.detail
        assert again == later and later.protocol == PROTOCOL_VERSION
        assert "version 0" in legacy.detail and f"speaks {PROTOCOL_VERSION}" in legacy.detail
        assert isinstance(current, HeartbeatReply)  # this release's beat is let in
        assert [i["id"] for i in manager.get("/v1/instances").json()] == ["spot-1"]
        refused = re.search(r"^rlboost_protocol_refused_total (\S+)$",
                            manager.get("/metrics").text, re.MULTILINE)
        assert refused is not None and float(refused.group(1)) == 3
        malformed = metric(manager, "rlboost_malformed_messages_total",
                           subject=names.HEARTBEAT_ANY)
        assert malformed == 0  # refused, not dropped as malformed
    logged = (tmp_path / "manager.log").read_text().count("refused at join: instance spot-1")
    assert logged == 1


def test_a_refusal_of_a_later_manager_still_reads() -> None:
    data = b'{"type":"Refused","detail":"speaks 9","protocol":9,"hint":"upgrade"}'
    assert decode_beat_reply(data) == Refused(detail="speaks 9", protocol=9)


class _StaleImage(RolloutService):
    """An instance built before protocol versions: its beats carry none."""

    def _heartbeat(self) -> Heartbeat:
        beat = super()._heartbeat()
        beat.protocol = 0
        return beat


def test_a_refused_instance_leaves_naming_both_versions(brokers: Stack, tmp_path: Path) -> None:
    cfg = RolloutConfig.from_env({**brokers.env("rollout"), "RLBOOST_INSTANCE_ID": "stale-0",
                                  "RLBOOST_DATA_DIR": str(tmp_path / "data"),
                                  "RLBOOST_HEARTBEAT_S": "0.1", "RLBOOST_GRACE_S": "1"})
    service = _StaleImage(cfg, create_engine("emu", time_scale=0.0))
    with running_manager(brokers, tmp_path) as manager:
        asyncio.run(asyncio.wait_for(service.run(), 30))  # it ends by itself
        assert manager.get("/v1/instances").json() == []
    assert service.refused is not None
    assert "version 0" in service.refused and f"speaks {PROTOCOL_VERSION}" in service.refused
