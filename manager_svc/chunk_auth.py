"""Chunks bound to their lease holder: per-lease MAC keys, and the checks ingest makes first.

Contract: the manager holds one secret (created once in Redis under ``Keys.chunk_key``, so
every manager replica and every restart agree, and nothing else is stored). The key of a lease
is HMAC(secret, "<request id>|<epoch>"): derived, never stored, and sent only in the lease's
:class:`~shared.protocol.Assignment`, on its holder's own subject. The holder stamps each chunk
with :func:`~shared.protocol.chunk_mac` under it. :meth:`ChunkAuth.forged` rejects a chunk whose
MAC does not check out, or whose instance or run differs from the subject it was published on
(with the shipped NATS config an instance can publish on its own chunk subjects only), before
the commit script ever sees it: knowing a request id and its epoch is not enough to commit a
token. :func:`invalid` names what else is dropped: negative offsets, token ids outside the
run's vocabulary.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import redis.asyncio as aioredis

from shared.names import Keys, parse_request_id
from shared.protocol import TokenChunk, chunk_mac


class ChunkAuth:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    @classmethod
    async def load(cls, redis: aioredis.Redis) -> ChunkAuth:
        """The manager's secret: made by whichever manager starts first, read by the rest."""
        await redis.set(Keys.chunk_key(), secrets.token_hex(32), nx=True)
        value = await redis.get(Keys.chunk_key())
        return cls(bytes.fromhex(str(value)))

    def lease_key(self, request_id: str, epoch: int) -> str:
        return hmac.new(self._secret, f"{request_id}|{epoch}".encode(),
                        hashlib.sha256).hexdigest()

    def forged(self, chunk: TokenChunk, subject: str) -> str | None:
        """Why ``chunk``, published on ``subject`` (rlb.chunk.<run>.<instance>), is not from
        its lease holder; None if it is."""
        parts = subject.split(".")
        run_id = parse_request_id(chunk.request_id)[0]
        if len(parts) != 4 or parts[3] != chunk.instance_id or parts[2] != run_id:
            return "instance or run differs from its subject"
        expected = chunk_mac(self.lease_key(chunk.request_id, chunk.epoch), chunk)
        if not hmac.compare_digest(chunk.mac.encode(), expected.encode()):
            return "bad MAC"
        return None


def invalid(chunk: TokenChunk, vocab_size: int) -> str | None:
    """Why ``chunk`` cannot be committed whoever sent it; None if it can be considered."""
    if chunk.offset < 0:
        return f"negative offset {chunk.offset}"
    if chunk.token_ids and (min(chunk.token_ids) < 0 or (
            vocab_size > 0 and max(chunk.token_ids) >= vocab_size)):
        return f"token id outside the vocabulary of {vocab_size}"
    return None
