"""Connections to NATS and Redis, and the typed request/reply every service uses.

Contract: clients are created by the service that owns them (never at module level) and closed
by it. Connecting retries until a deadline, because in a real deployment the brokers may start
after the services (and a rollout instance's login waits for the manager's auth callout). A
request always has a timeout; a missing reply is a :class:`PeerTimeout`.

A rollout instance connects with ``nkey_seed`` (its process's own key, see
:mod:`shared.identity`): the password of its URL then goes as nats-py's token beside the
signed nonce (nats-py sends a user and password only without an nkey), and the URL that
reaches nats-py carries no credential.

With ``tls`` (:meth:`shared.tls.Tls.client`) the client opens TLS before the server says a
word (``handshake_first``; the shipped compose/nats-tls.conf asks the same of every client):
a server, or anyone between, that claims not to need TLS never sees a password in clear.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Any, TypeVar, cast
from urllib.parse import unquote, urlsplit, urlunsplit

import msgspec
import nats
import redis.asyncio as aioredis
from nats.aio.client import Client as Nats
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError
from redis.asyncio.cluster import RedisCluster

from shared import names
from shared.errors import PeerError, PeerTimeout, ProtocolError
from shared.protocol import Ack, decode, encode
from shared.settings import mask_url, split_urls

log = logging.getLogger(__name__)
R = TypeVar("R")


def split_credentials(url: str) -> tuple[str, str | None]:
    """``url`` without its user info, and the password (or bare token) it carried."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at:
        return url, None
    user, colon, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=hostport)), unquote(password if colon else user)


async def connect_nats(url: str, name: str, deadline_s: float = 30.0,
                       nkey_seed: str | None = None, inbox_prefix: str | None = None,
                       tls: ssl.SSLContext | None = None) -> Nats:
    """Connect, retrying until ``deadline_s``; once up, the client reconnects forever."""
    end = time.monotonic() + deadline_s
    options: dict[str, Any] = {}
    if tls is not None:
        options.update(tls=tls, tls_handshake_first=True)
    if inbox_prefix is not None:
        options["inbox_prefix"] = inbox_prefix
    servers = split_urls(url)  # every node of a cluster, or one server
    if nkey_seed is not None:
        split = [split_credentials(one) for one in servers]
        servers = [one for one, _ in split]
        options["nkeys_seed_str"] = nkey_seed
        if (secret := next((s for _, s in split if s is not None), None)) is not None:
            options["token"] = secret
    while True:
        try:
            return await nats.connect(
                servers,
                name=name,
                **options,
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


# A frame's most bytes on the stream: the shipped server's max_payload (compose/nats.conf).
# A rollout frame is far smaller (4096 entries of a flush's new tokens, ~100 B of fields
# each plus 4/3 B per token of base64), and one larger is refused at publish, not stored.
MAX_FRAME_BYTES = 8 << 20


def chunk_stream_config(replicas: int = 1, max_bytes: int = -1) -> StreamConfig:
    """The chunk stream's configuration (:func:`ensure_chunk_stream`)."""
    return StreamConfig(
        name=names.CHUNK_STREAM,
        subjects=[names.CHUNK_WILDCARD],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_age=3600.0,
        num_replicas=replicas,
        max_bytes=max_bytes,
        max_msg_size=MAX_FRAME_BYTES,
        # Full: refuse new frames (the instance's publish fails, it keeps its tokens buffered
        # and retries; its lease may lapse and the response migrate, i.e. waste) rather than
        # discard the oldest, which may be committed-but-unacked tokens nobody would resend.
        discard=DiscardPolicy.NEW,
        # No credential, the manager's included, can empty the stream or drop a frame from it:
        # a frame leaves only by its ack (work-queue retention) or by max_age.
        deny_purge=True,
        deny_delete=True,
    )


async def ensure_chunk_stream(js: JetStreamContext, replicas: int = 1,
                              max_bytes: int = -1) -> None:
    """The durable stream token chunks ride on; a message leaves it once the manager acks it.
    ``replicas``: copies a JetStream cluster keeps (R3 survives one server lost);
    ``max_bytes``: what the stream holds at most (-1: the server's limits).

    Created, never updated: the manager's NATS permissions allow no stream update, which
    would let a stolen manager credential lift deny_purge. A stream that exists with another
    configuration (an older release's) is kept as it is, and said so; an operator updates it
    (``nats stream edit`` as a user with the JetStream API)."""
    config = chunk_stream_config(replicas, max_bytes)
    try:
        await js.add_stream(config)
    except BadRequestError as exc:
        log.warning("chunk stream %s exists with another configuration (%s); kept as it is: "
                    "update it to %s", names.CHUNK_STREAM, exc.description,
                    {k: v for k, v in config.as_dict().items() if k != "subjects"})


REDIS_CONNECTIONS = 64  # per client; more concurrent commands wait for one
# Per node of a Redis Cluster, whose pools refuse (rather than wait) past their size.
CLUSTER_CONNECTIONS = 512


async def connect_redis(url: str, deadline_s: float = 30.0) -> aioredis.Redis:
    """A client of the Redis at ``url``: of the whole cluster when that server is a node of
    a Redis Cluster (``cluster_enabled``: the same URL variable names any one node, and the
    client finds the others and the slot of every key), else of that server."""
    client = await _connect_one(url, deadline_s)
    if int((await client.info("cluster")).get("cluster_enabled", 0)) != 1:
        return client
    await client.aclose()
    cluster = RedisCluster.from_url(
        url, decode_responses=True, socket_timeout=5, socket_connect_timeout=2,
        health_check_interval=5, max_connections=CLUSTER_CONNECTIONS)
    await cluster.initialize()
    log.info("Redis at %s is a cluster of %d nodes", mask_url(url),
             len(cluster.get_primaries()))
    # The cluster client serves every command, pipeline and script call the services make
    # (each call reaches one slot: shared.names.Keys), so the parts hold it as a client.
    return cast(aioredis.Redis, cluster)


async def _connect_one(url: str, deadline_s: float) -> aioredis.Redis:
    end = time.monotonic() + deadline_s
    while True:
        # A blocking pool: a burst of handlers (hundreds of instances heartbeating at once)
        # waits for a connection instead of failing with "Too many connections" (redis-py's
        # pool raises past its 100 by default), which took a loaded manager's heartbeats down.
        pool = aioredis.BlockingConnectionPool.from_url(
            url, decode_responses=True, socket_timeout=5, socket_connect_timeout=2,
            health_check_interval=5, max_connections=REDIS_CONNECTIONS, timeout=10,
        )
        client: aioredis.Redis = aioredis.Redis.from_pool(pool)
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
    return decode_reply(subject, await request_bytes(nc, subject, msg, timeout_s), reply_type)


async def request_bytes(nc: Nats, subject: str, msg: msgspec.Struct, timeout_s: float = 2.0
                        ) -> bytes:
    """Send ``msg``; the reply as it came (for a caller that reads it leniently first)."""
    try:
        reply = await nc.request(subject, encode(msg), timeout=timeout_s)
    except (TimeoutError, NatsTimeout, NoRespondersError):
        raise PeerTimeout(subject, timeout_s) from None
    except NatsError as exc:  # disconnected, reconnecting, closed: the bus will come back
        raise PeerTimeout(f"{subject} ({type(exc).__name__})", timeout_s) from None
    return bytes(reply.data)


def decode_reply(subject: str, data: bytes, reply_type: type[R]) -> R:
    """The typed reply to a request on ``subject``; a refusal is a :class:`PeerError`."""
    try:
        return decode(data, reply_type)
    except ProtocolError:
        # A handler that failed answers with an Ack instead of the expected reply.
        ack = decode(data, Ack)
        if ack.ok:
            raise
        raise PeerError(subject, ack.detail, ack.retryable) from None
