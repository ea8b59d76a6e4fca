"""Frame entries bound to their lease holder: per-lease MAC keys, and the checks ingest makes
first.

Contract: the manager holds one secret (created once in Redis under ``Keys.chunk_key``, so
every manager replica and every restart agree, and nothing else is stored). The key of a lease
is HMAC(secret, "<request id>|<epoch>"): derived, never stored, and sent only in the lease's
:class:`~shared.protocol.Assignment`, on its holder's own subject. The holder stamps each entry
of its frames with :func:`~shared.mac.entry_mac` under it. :meth:`ChunkAuth.forged_frame`
rejects a frame whose instance differs from the subject it was published on (with the shipped
NATS config an instance can publish on its own chunk subjects only), and :meth:`ChunkAuth.forged`
an entry whose MAC does not check out or whose run differs from the subject's, before the commit
script ever sees it: knowing a request id and its epoch is not enough to commit a token. The
check is per entry, as strong as when every response had its own message. :func:`invalid`
names what else is dropped: negative offsets, tokens that are not whole ids, token ids
outside the run's vocabulary.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections import Counter

import redis.asyncio as aioredis

from manager_svc.metrics import ManagerMetrics
from manager_svc.scripts import Call, register, run_batch
from shared import names
from shared.logs import Throttled
from shared.mac import entry_digest
from shared.names import Keys
from shared.protocol import TOKEN_WIDTH, FrameEntry, TokenFrame

# Lease keys remembered: a lease's entries arrive every flush for the whole response, and
# deriving its key again each time was a second HMAC per entry on the ingest path.
KEY_CACHE = 1 << 16
LOG_EVERY_S = 10.0  # at most one line per kind of dropped entry this often
# The rejected_entries label of each reason this module gives, by how its text begins.
LABELS = (("token id outside", "vocabulary"), ("negative offset", "offset"),
          ("bytes of tokens", "partial_token"), ("bad MAC", "mac"),
          ("run differs", "run"), ("instance differs", "instance"), ("log-probs", "logprobs"))
# The behaviour log-probs an entry may carry: below the floor no float32 softmax of finite
# logits reaches (a probability under e^-1e4 rounds to 0 there and then -inf), at most a
# rounding error above 0.
LOGPROB_MIN, LOGPROB_MAX = -1e4, 1e-3


def label(why: str) -> str:
    return next((name for start, name in LABELS if why.startswith(start)), "other")
log = logging.getLogger("manager")


class ChunkAuth:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._keys: dict[str, tuple[int, bytes]] = {}  # request id -> (epoch, its key)

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
        # By request id alone: its entries arrive with the epoch of their lease, which
        # changes only when the lease moves (and a tuple key cost a tuple and its hash).
        got = self._keys.get(request_id)
        if got is None or got[0] != epoch:
            if len(self._keys) >= KEY_CACHE:
                self._keys.clear()
            got = self._keys[request_id] = (epoch, hmac.digest(
                self._secret, f"{request_id}|{epoch}".encode(), "sha256"))
        return got[1]

    @staticmethod
    def forged_frame(frame: TokenFrame, subject: str) -> str | None:
        """Why ``frame``, published on ``subject`` (rlb.chunk.<run>.<instance>[.<key>]), is
        not from the instance it names; None if it may be."""
        if names.chunk_sender(subject)[0] != frame.instance_id:
            return "instance differs from its subject"
        return None

    def forged(self, frame: TokenFrame, entry: FrameEntry, entry_run: str, subject_run: str
               ) -> str | None:
        """Why ``entry`` of ``frame`` is not from its lease holder; None if it is.
        ``entry_run`` is its request id's run, ``subject_run`` the run its subject names."""
        if entry_run != subject_run:
            return "run differs from its subject"
        expected = entry_digest(self._key(entry.request_id, entry.epoch), frame.instance_id,
                                entry).hex()
        try:
            if hmac.compare_digest(entry.mac, expected):
                return None
        except TypeError:  # a MAC of non-ASCII text: never one the manager's keys make
            pass
        return "bad MAC"


def invalid(entry: FrameEntry, vocab_size: int, ids: list[int]) -> str | None:
    """Why ``entry`` cannot be committed whoever sent it; None if it can be considered.
    ``ids``: its token ids, unpacked by the caller where they are
    :attr:`~shared.protocol.FrameEntry.whole` (the caller commits them)."""
    if entry.offset < 0:
        return f"negative offset {entry.offset}"
    if not entry.whole:
        return f"{len(entry.tokens)} bytes of tokens are not whole {TOKEN_WIDTH}-byte ids"
    if vocab_size > 0 and ids and max(ids) >= vocab_size:
        return f"token id outside the vocabulary of {vocab_size}"
    if entry.logprobs:
        if len(entry.logprobs) != len(entry.tokens):
            return (f"log-probs of {len(entry.logprobs)} bytes for {entry.n_tokens} tokens "
                    "(one float32 each)")
        # NaN fails both comparisons; a float32 log_softmax may round a sure token a hair
        # above 0, so the bound allows that and nothing a probability could not give.
        if not all(LOGPROB_MIN <= v <= LOGPROB_MAX for v in entry.logprob_values):
            return f"log-probs outside [{LOGPROB_MIN:g}, {LOGPROB_MAX:g}] or not finite"
    return None


class Rejections:
    """Entries ingest drops (forged or invalid), counted and logged without a Redis round trip
    each: a hostile instance can send them as fast as it likes, and ingest is one loop. The
    metrics count each at once (by outcome, and by reason); one warning line per kind per
    LOG_EVERY_S (with how many it held back); a step's record counts them in one pipelined
    call per checked slice (:meth:`flush`), and only for a step that exists (a forged id must
    not create a key). What quarantines their sender is the quarantine's own tally."""

    def __init__(self, redis: aioredis.Redis, metrics: ManagerMetrics) -> None:
        self.redis = redis
        self.metrics = metrics
        self._count = register(redis, "count_if_exists.lua")
        self._due: Counter[tuple[str, str]] = Counter()  # (step key, field) -> entries
        self._logs = {"forged": Throttled(log, LOG_EVERY_S), "invalid": Throttled(log, LOG_EVERY_S)}
        for name in {name for _, name in LABELS} | {"other"}:
            metrics.rejected_entries.labels(name)  # each reason shows, at 0, from the start

    def add(self, frame: TokenFrame, entry: FrameEntry, subject: str, result: str,
            why: str) -> None:
        self.metrics.chunks.labels(result).inc()
        self.metrics.rejected_entries.labels(label(why)).inc()
        if result == "forged":
            self.metrics.forged.inc()
        self._logs[result].warning("%s entry of %s as %s on %s: %s", result,
                                   entry.request_id[:100], frame.instance_id, subject[:120], why)
        if names.valid_request_id(entry.request_id):  # forged: perhaps no step to count it in
            run_id, step, _, _ = names.parse_request_id(entry.request_id)
            field = "forged_chunks_rejected" if result == "forged" else "invalid_chunks_dropped"
            self._due[(Keys.step(run_id, step), field)] += 1

    async def flush(self) -> None:
        due, self._due = self._due, Counter()
        await run_batch(self.redis, [Call(self._count, [key], [field, n])
                                     for (key, field), n in due.items()])
