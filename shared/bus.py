"""Connections to NATS and Redis, and the typed request/reply every service uses.

Contract: clients are created by the service that owns them (never at module level) and closed
by it. Connecting retries until a deadline, because in a real deployment the brokers may start
after the services. A request always has a timeout; a missing reply is a :class:`PeerTimeout`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TypeVar

import msgspec
import nats
import redis.asyncio as aioredis
from nats.aio.client import Client as Nats
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from shared import names
from shared.errors import PeerError, PeerTimeout, ProtocolError
from shared.protocol import Ack, decode, encode
from shared.settings import mask_url

log = logging.getLogger(__name__)
R = TypeVar("R")


async def connect_nats(url: str, name: str, deadline_s: float = 30.0) -> Nats:
    """Connect, retrying until ``deadline_s``; once up, the client reconnects forever."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            return await nats.connect(
                url,
                name=name,
                connect_timeout=2,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                ping_interval=5,
                max_outstanding_pings=3,
            )
        except Exception as exc:  # nats raises a zoo of errors on connect; all mean "not yet"
            if time.monotonic() > end:
                raise
            log.info("waiting for NATS at %s: %s", mask_url(url), exc)
            await asyncio.sleep(0.5)


async def ensure_chunk_stream(js: JetStreamContext) -> None:
    """The durable stream token chunks ride on; a message leaves it once the manager acks it."""
    config = StreamConfig(
        name=names.CHUNK_STREAM,
        subjects=[names.CHUNK_WILDCARD],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_age=3600.0,
    )
    try:
        await js.add_stream(config)
    except BadRequestError:
        await js.update_stream(config)


async def connect_redis(url: str, deadline_s: float = 30.0) -> aioredis.Redis:
    end = time.monotonic() + deadline_s
    while True:
        client: aioredis.Redis = aioredis.Redis.from_url(
            url, decode_responses=True, socket_timeout=5, socket_connect_timeout=2,
            health_check_interval=5,
        )
        try:
            await client.ping()
            return client
        except Exception as exc:
            await client.aclose()
            if time.monotonic() > end:
                raise
            log.info("waiting for Redis at %s: %s", mask_url(url), exc)
            await asyncio.sleep(0.5)


async def request(
    nc: Nats, subject: str, msg: msgspec.Struct, reply_type: type[R], timeout_s: float = 2.0
) -> R:
    """Send ``msg`` and decode the typed reply; no reply in time is a :class:`PeerTimeout`."""
    try:
        reply = await nc.request(subject, encode(msg), timeout=timeout_s)
    except (TimeoutError, NatsTimeout, NoRespondersError):
        raise PeerTimeout(subject, timeout_s) from None
    except NatsError as exc:  # disconnected, reconnecting, closed: the bus will come back
        raise PeerTimeout(f"{subject} ({type(exc).__name__})", timeout_s) from None
    try:
        return decode(reply.data, reply_type)
    except ProtocolError:
        # A handler that failed answers with an Ack instead of the expected reply.
        ack = decode(reply.data, Ack)
        if ack.ok:
            raise
        raise PeerError(subject, ack.detail, ack.retryable) from None
