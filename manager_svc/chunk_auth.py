"""Frame entries bound to their lease holder: per-lease MAC keys, and the checks ingest makes
first.

Contract: the manager holds one secret (created once in Redis under ``Keys.chunk_key``, so
every manager replica and every restart agree, and nothing else is stored). The key of a lease
is HMAC(secret, "<request id>|<epoch>"): derived, never stored, and sent only in the lease's
:class:`~shared.protocol.Assignment`, on its holder's own subject. The holder stamps each entry
of its frames with :func:`~shared.protocol.entry_mac` under it. :meth:`ChunkAuth.forged_frame`
rejects a frame whose instance differs from the subject it was published on (with the shipped
NATS config an instance can publish on its own chunk subjects only), and :meth:`ChunkAuth.forged`
an entry whose MAC does not check out or whose run differs from the subject's, before the commit
script ever sees it: knowing a request id and its epoch is not enough to commit a token. The
check is per entry, as strong as when every response had its own message. :func:`invalid`
names what else is dropped: negative offsets, token ids outside the run's vocabulary.
"""

from __future__ import annotations

import hmac
import secrets

import redis.asyncio as aioredis

from shared.names import Keys
from shared.protocol import FrameEntry, TokenFrame, entry_digest

# Lease keys remembered: a lease's entries arrive every flush for the whole response, and
# deriving its key again each time was a second HMAC per entry on the ingest path.
KEY_CACHE = 1 << 16


class ChunkAuth:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._keys: dict[tuple[str, int], bytes] = {}

    @classmethod
    async def load(cls, redis: aioredis.Redis) -> ChunkAuth:
        """The manager's secret: made by whichever manager starts first, read by the rest."""
        await redis.set(Keys.chunk_key(), secrets.token_hex(32), nx=True)
        value = await redis.get(Keys.chunk_key())
        return cls(bytes.fromhex(str(value)))

    def lease_key(self, request_id: str, epoch: int) -> str:
        """The key of a lease, in hex as its Assignment carries it."""
        return self._key(request_id, epoch).hex()

    def _key(self, request_id: str, epoch: int) -> bytes:
        key = self._keys.get((request_id, epoch))
        if key is None:
            if len(self._keys) >= KEY_CACHE:
                self._keys.clear()
            key = self._keys[(request_id, epoch)] = hmac.digest(
                self._secret, f"{request_id}|{epoch}".encode(), "sha256")
        return key

    @staticmethod
    def forged_frame(frame: TokenFrame, subject: str) -> str | None:
        """Why ``frame``, published on ``subject`` (rlb.chunk.<run>.<instance>), is not from
        the instance it names; None if it may be."""
        parts = subject.split(".")
        if len(parts) != 4 or parts[3] != frame.instance_id:
            return "instance differs from its subject"
        return None

    def forged(self, frame: TokenFrame, entry: FrameEntry, entry_run: str, subject_run: str,
               tokens: bytes | None = None) -> str | None:
        """Why ``entry`` of ``frame`` is not from its lease holder; None if it is.
        ``entry_run`` is its request id's run, ``subject_run`` the run its subject names;
        ``tokens``, where the caller has it, :func:`~shared.protocol.token_json` of its ids."""
        if entry_run != subject_run:
            return "run differs from its subject"
        expected = entry_digest(self._key(entry.request_id, entry.epoch), frame.instance_id,
                                entry, tokens).hex().encode()
        # surrogatepass: a MAC is whatever text the wire carried, lone surrogates included
        if not hmac.compare_digest(entry.mac.encode("utf-8", "surrogatepass"), expected):
            return "bad MAC"
        return None


def invalid(entry: FrameEntry, vocab_size: int, tokens_checked: bool = False) -> str | None:
    """Why ``entry`` cannot be committed whoever sent it; None if it can be considered.
    ``tokens_checked``: its token ids were decoded within this vocabulary
    (:func:`~shared.protocol.decode_frame`)."""
    if entry.offset < 0:
        return f"negative offset {entry.offset}"
    if not tokens_checked and entry.token_ids and (min(entry.token_ids) < 0 or (
            vocab_size > 0 and max(entry.token_ids) >= vocab_size)):
        return f"token id outside the vocabulary of {vocab_size}"
    return None
