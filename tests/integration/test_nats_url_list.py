"""A service given every node of a NATS cluster (RLBOOST_NATS_URL, comma-separated) connects
while one of them is down: the manager's and rollout's connection (shared.bus.connect_nats)
and the weight service's announcer alike. Each is given a dead node first, then the live
server, and must reach the live one and carry a message over it."""

from __future__ import annotations

import asyncio

import nats

from rlboost.stack import Stack
from shared import names
from shared.bus import connect_nats
from shared.ports import free_port
from shared.protocol import WeightsAnnounce, decode
from weight_svc.announce import Announcer


def with_a_dead_node(brokers: Stack) -> str:
    return f"nats://127.0.0.1:{free_port()},{brokers.nats.url}"


async def test_connect_nats_skips_a_dead_node(brokers: Stack) -> None:
    nc = await connect_nats(with_a_dead_node(brokers), "test-url-list", deadline_s=10)
    try:
        sub = await nc.subscribe("rlb.test")
        await nc.publish("rlb.test", b"over the live node")
        assert (await sub.next_msg(timeout=5)).data == b"over the live node"
        assert nc.connected_url is not None and nc.connected_url.port == brokers.nats.port
    finally:
        await nc.close()


async def test_the_announcer_announces_through_a_live_node(brokers: Stack) -> None:
    listener = await nats.connect(brokers.nats.url)
    announcer = Announcer(with_a_dead_node(brokers))
    try:
        sub = await listener.subscribe(names.WEIGHTS_ANNOUNCE)
        announcer.start()
        for _ in range(100):
            if announcer.connected:
                break
            await asyncio.sleep(0.1)
        assert announcer.connected
        assert await announcer.announce("run-1", 3)
        got = decode((await sub.next_msg(timeout=5)).data, WeightsAnnounce)
        assert (got.run_id, got.weight_version) == ("run-1", 3)
    finally:
        await announcer.close()
        await listener.close()
