"""Commit batches pipelined on one Redis connection: the next is sent before the last answers.

Contract: :meth:`CommitStream.commit` runs a batch of commit script calls after the batch
before it, as :meth:`~manager_svc.accounting.Ledger.run_calls` does, but sends it at once, on
a connection of the stream's own, while the batches ahead of it are still running. Redis runs
one connection's commands in the order they arrive, so the batches commit in the order they
were sent, as one batch at a time did; Redis no longer stands idle between them while the
manager reads one's answer and sends the next. A batch whose send or answer fails (the
connection, a script Redis no longer has) waits for the batch before it to be done, retries
included, and only then goes again one batch at a time (``again``: ingest passes
:meth:`~manager_svc.accounting.Ledger.run_replies`, which waits out an outage); from the
moment the failure is read until no batch is going that way, every batch goes that way,
after the one before it, none on the stream. So a retry never overtakes what was sent before
it. A batch after one that failed for good is not sent again (its entries would land past
the failed ones' offsets) and fails too.

Only on a plain client with no replica acks (``RLBOOST_REDIS_REPLICA_ACKS``): a cluster client
sends a batch's calls by node and a replica-acked batch ends with WAIT on its own connection,
so there :meth:`ChunkIngest.consume` keeps one batch in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError, ResponseError

from manager_svc.scripts import Call

log = logging.getLogger("manager")
Replies = list[Any]
# Batches in flight at once: the next is queued in Redis while one runs, so Redis goes from
# one to the next without waiting for its caller's event loop.
PIPELINED = 2


class Suspended(RedisError):  # type: ignore[misc]  # redis-py is Any to mypy here
    """Not sent: a batch before it failed and goes again the slow way, so this one must too."""


class CommitStream:
    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self._conn: AbstractConnection | None = None
        self._waiting: deque[tuple[int, asyncio.Future[Replies]]] = deque()  # sent, in order
        self._send = asyncio.Lock()  # bytes and their place in _waiting in one order
        self._reader: asyncio.Task[None] | None = None
        self._loaded: set[str] = set()  # scripts loaded since the connection was made
        self._read_timeout: float | None = None  # the pool's socket timeout, for replies
        # Set the moment a batch fails (as its answer is read, before its caller sees it):
        # from then on every batch goes the slow way, after the one before it, until none is
        # going that way; else one sent meanwhile could run before a failed one's retry.
        self._suspended = False
        self._slow = 0  # batches going the slow way now
        self._closing: set[asyncio.Future[None]] = set()  # connections being closed

    @staticmethod
    def usable(redis: aioredis.Redis, replica_acks: int) -> bool:
        return not replica_acks and not isinstance(redis, RedisCluster)

    async def commit(self, calls: list[Call], before: asyncio.Future[Any] | None,
                     again: Callable[[list[Call]], Awaitable[Replies]]) -> Replies:
        """The replies of ``calls``, run after the batch ``before`` (a future of this method,
        or None); ``again`` sends calls one batch at a time, waiting out an outage."""
        replies: Replies | None = None
        try:
            replies = await (await self.send(calls))
        except Suspended:
            pass
        except RedisError as exc:
            log.warning("pipelined commit failed (%s); sent again after the one before it", exc)
        else:
            if not any(isinstance(reply, NoScriptError) for reply in replies):
                return _raise_errors(replies)
        self._suspended = True
        self._slow += 1
        try:
            await self._after(before)
            if replies is None:
                return await again(calls)
            # Redis lost its scripts (restarted): what ran stands, the rest goes again.
            missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
            for i, reply in zip(missing, await again([calls[i] for i in missing]),
                                strict=True):
                replies[i] = reply
            return _raise_errors(replies)
        finally:
            self._slow -= 1
            if not self._slow and not self._waiting:
                self._suspended = False

    async def commit_all(self, batches: list[list[Call]],
                         again: Callable[[list[Call]], Awaitable[Replies]]) -> list[Replies]:
        """Each batch's replies, committed in order, PIPELINED in flight at a time."""
        sent: list[asyncio.Future[Replies]] = []
        for calls in batches:
            if len(sent) >= PIPELINED:
                await asyncio.wait([sent[-PIPELINED]])
            sent.append(asyncio.ensure_future(
                self.commit(calls, sent[-1] if sent else None, again)))
        return [await done for done in sent]

    @staticmethod
    async def _after(before: asyncio.Future[Any] | None) -> None:
        if before is not None:
            await asyncio.wait([before])
            if before.cancelled() or before.exception() is not None:
                raise RedisError("the commit before this one failed; not sent out of order")

    async def ready(self, scripts: list[AsyncScript]) -> None:
        """Connect, and load ``scripts``, before the first batch needs them: made by the
        first commit, the connection waited for turns of a busy event loop while Redis stood
        idle (the first commit of a backlog)."""
        async with self._send:
            await self._connection()
            await self._load(scripts)

    async def _load(self, scripts: list[AsyncScript]) -> None:
        for script in {script.sha: script for script in scripts}.values():
            if script.sha not in self._loaded:  # not NOSCRIPT answers to retry in order
                await self.redis.script_load(script.script)
                self._loaded.add(script.sha)

    async def send(self, calls: list[Call]) -> asyncio.Future[Replies]:
        """Send ``calls`` now, behind whatever this stream sent before; their replies, in
        order, are the result of the future returned (script errors as exceptions in it)."""
        done: asyncio.Future[Replies] = asyncio.get_running_loop().create_future()
        async with self._send:
            if self._suspended:  # checked once this batch's turn to send has come
                raise Suspended("a batch before this one is going again")
            conn = await self._connection()
            await self._load([call.script for call in calls])
            packed = conn.pack_commands([
                ("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
                for call in calls])
            self._waiting.append((len(calls), done))
            try:
                # No health check: its PING's answer would be read as a batch's.
                await conn.send_packed_command(packed, check_health=False)
            except BaseException as exc:
                self._fail(exc)
                raise
            if self._reader is None or self._reader.done():
                self._reader = asyncio.ensure_future(self._read(conn))
        return done

    async def _connection(self) -> AbstractConnection:
        if self._conn is None or not self._conn.is_connected:
            pool = self.redis.connection_pool
            # No socket timeout of its own: with one, redis-py writes each batch in a task of
            # its own (asyncio.wait_for), a turn of ingest's busy event loop between a
            # batch packed and a batch sent, on every commit of a drained step's ramp. Reads
            # keep the pool's timeout (_read), and a read that times out closes the
            # connection, which ends a write stuck behind a Redis that stopped reading.
            kwargs = pool.connection_kwargs
            self._read_timeout = kwargs.get("socket_timeout")
            self._conn = pool.connection_class(**{**kwargs, "socket_timeout": None})
            await self._conn.connect()
            self._loaded.clear()
        return self._conn

    async def _read(self, conn: AbstractConnection) -> None:
        """Answer the sent batches in the order they were sent; a failed read fails every
        batch still waiting (their commands may or may not have run)."""
        while self._waiting:
            n, done = self._waiting[0]
            replies: Replies = []
            try:
                for _ in range(n):
                    try:
                        # Its own timeout, not read_response's: one passed to that
                        # answers None when it passes, as if it were a reply.
                        async with asyncio.timeout(self._read_timeout):
                            replies.append(await conn.read_response())
                    except ResponseError as exc:  # a script's error: the batch's caller's
                        replies.append(exc)
            except BaseException as exc:
                self._fail(exc)
                if not isinstance(exc, Exception):
                    raise
                return
            if any(isinstance(reply, NoScriptError) for reply in replies):
                self._suspended = True
                self._loaded.clear()
            self._waiting.popleft()
            if not done.done():
                done.set_result(replies)

    def _fail(self, exc: BaseException) -> None:
        error = exc if isinstance(exc, RedisError) else RedisError(f"commit stream: {exc!r}")
        if self._waiting:
            self._suspended = True
        while self._waiting:
            _, done = self._waiting.popleft()
            if not done.done():
                done.set_exception(error)
        conn, self._conn = self._conn, None
        if conn is not None:
            closing = asyncio.ensure_future(self._close(conn))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close(conn: AbstractConnection) -> None:
        with contextlib.suppress(Exception):
            await conn.disconnect(nowait=True)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
        self._fail(RedisError("commit stream closed"))


def _raise_errors(replies: Replies) -> Replies:
    """A script's error ends the batch's commit, as :func:`~manager_svc.scripts.run_batch`."""
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise reply
    return replies
