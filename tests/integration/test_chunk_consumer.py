"""The managers' durable chunk consumer is brought to the running manager's configuration.

A JetStream stream outlives manager upgrades; a manager that merely bound to the consumer an
older one created kept that one's ack_wait (30 s), so frames pulled by a SIGKILLed manager sat
unacked for 30 s instead of one lease. The consumer is also one pinned priority group, so that
of several manager replicas one at a time commits (in stream order); an older consumer gains it
in place. Real nats-server with JetStream.
"""

from __future__ import annotations

import json

import nats
from nats.aio.client import Client as Nats
from nats.js.api import AckPolicy, ConsumerConfig

from manager_svc.ingest import bind_consumer
from rlboost.stack import Stack
from shared import names
from shared.bus import ensure_chunk_stream


async def priority(nc: Nats) -> tuple[list[str], str, float]:
    """The consumer's priority settings, which nats-py's ConsumerConfig does not carry."""
    reply = await nc.request(
        f"$JS.API.CONSUMER.INFO.{names.CHUNK_STREAM}.{names.CHUNK_CONSUMER}", b"", timeout=5)
    config = json.loads(reply.data)["config"]
    return (config.get("priority_groups"), config.get("priority_policy"),
            config.get("priority_timeout", 0) / 1e9)


async def test_bind_creates_then_updates_an_older_consumer(brokers: Stack) -> None:
    nc = await nats.connect(brokers.nats.url)
    try:
        js = nc.jetstream()
        await ensure_chunk_stream(js)
        await bind_consumer(nc, 8.0)  # none yet: created
        info = await js.consumer_info(names.CHUNK_STREAM, names.CHUNK_CONSUMER)
        assert info.config.ack_wait == 8.0
        assert info.config.filter_subject == names.CHUNK_WILDCARD
        assert await priority(nc) == (["managers"], "pinned_client", 8.0)
        # What an older manager left behind, with a frame pulled and never acked.
        await js.add_consumer(names.CHUNK_STREAM, ConsumerConfig(
            durable_name=names.CHUNK_CONSUMER, filter_subject=names.CHUNK_WILDCARD,
            ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0, max_ack_pending=65536))
        assert (await js.consumer_info(names.CHUNK_STREAM, names.CHUNK_CONSUMER)
                ).config.ack_wait == 30.0
        await js.publish(names.CHUNK_WILDCARD.replace("*", "x").replace(">", "x"), b"frame")
        sub = await js.pull_subscribe_bind(names.CHUNK_CONSUMER, names.CHUNK_STREAM)
        assert len(await sub.fetch(1, timeout=5)) == 1  # pulled, not acked
        await bind_consumer(nc, 8.0)
        info = await js.consumer_info(names.CHUNK_STREAM, names.CHUNK_CONSUMER)
        assert info.config.ack_wait == 8.0
        assert info.num_ack_pending == 1  # updated in place: the pulled frame is still owed
        assert await priority(nc) == (["managers"], "pinned_client", 8.0)
        await bind_consumer(nc, 8.0)  # the same configuration again: no error, no change
        assert (await js.consumer_info(names.CHUNK_STREAM, names.CHUNK_CONSUMER)
                ).config.ack_wait == 8.0
    finally:
        await nc.close()
