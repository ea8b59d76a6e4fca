"""Exactly-once token accounting in Redis: every state change of a response is one Lua script.

Contract: a response ("request") is a Redis hash; its tokens are committed only by
:meth:`Ledger.commit`, which in one atomic script checks that the chunk's lease epoch is the
current one and its lease is alive (fencing), that its offset is the next uncommitted position,
and then appends. So a redelivered chunk is a counted duplicate, a chunk from a revoked or
expired owner is a counted stale chunk, and no interleaving of manager restarts, redeliveries
or zombies can commit a token twice. Ownership changes (:meth:`assign`, :meth:`revoke`) bump
the epoch in the same atomic way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared.names import Keys, parse_request_id, request_id
from shared.protocol import Assignment, Sample, TokenChunk

_COMMON = """
local function csv_append(key, field, value)
  local cur = redis.call('HGET', key, field) or ''
  if cur == '' then redis.call('HSET', key, field, value)
  else redis.call('HSET', key, field, cur .. ',' .. value) end
end
local function release_owner(req, rid, held_prefix)
  local owner = redis.call('HGET', req, 'owner')
  if owner and owner ~= '' then redis.call('SREM', held_prefix .. owner .. ':held', rid) end
  redis.call('HSET', req, 'owner', '')
end
"""

# KEYS: req, lease, step, leased, done | ARGV: rid, instance, epoch, version, offset, ntok,
# tokens_csv, final, finish, held_prefix, pending_key, kind, now
_COMMIT = _COMMON + """
local req, lease, step = KEYS[1], KEYS[2], KEYS[3]
if redis.call('EXISTS', req) == 0 then return {'unknown', 0} end
local st = redis.call('HMGET', req, 'done', 'epoch', 'n', 'version', 'max', 'last', 'p')
local epoch, ntok, offset = tonumber(ARGV[3]), tonumber(ARGV[6]), tonumber(ARGV[5])
local cur, n = tonumber(st[2]), tonumber(st[3])
if st[1] == '1' then
  if epoch == cur then
    redis.call('HINCRBY', step, 'duplicate_chunks_dropped', 1)
    return {'duplicate', n}
  end
  redis.call('HINCRBY', step, 'stale_chunks_rejected', 1)
  redis.call('HINCRBY', step, 'tokens_regenerated', ntok)
  return {'stale', n}
end
if epoch ~= cur or redis.call('GET', lease) ~= (ARGV[2] .. ':' .. ARGV[3]) then
  redis.call('HINCRBY', step, 'stale_chunks_rejected', 1)
  redis.call('HINCRBY', step, 'tokens_regenerated', ntok)
  return {'stale', n}
end
if (ntok > 0 and offset + ntok <= n) or (ntok == 0 and offset < n) then
  redis.call('HINCRBY', step, 'duplicate_chunks_dropped', 1)
  return {'duplicate', n}
end
local function revoke(why)
  redis.call('HINCRBY', req, 'epoch', 1)
  redis.call('DEL', lease)
  release_owner(req, ARGV[1], ARGV[10])
  redis.call('SMOVE', KEYS[4], ARGV[11], ARGV[1])
  redis.call('HINCRBY', step, 'tokens_regenerated', ntok)
  return {why, n}
end
if offset ~= n then
  redis.call('HINCRBY', step, 'gaps', 1)
  return revoke('gap')
end
if tonumber(ARGV[4]) ~= tonumber(st[4]) then
  redis.call('HINCRBY', step, 'wrong_version_chunks', 1)
  return revoke('wrong_version')
end
if n + ntok > tonumber(st[5]) then
  redis.call('HINCRBY', step, 'overlong_chunks', 1)
  return revoke('overlong')
end
if ntok > 0 then
  csv_append(req, 'tokens', ARGV[7])
  n = n + ntok
  redis.call('HSET', req, 'n', n)
  redis.call('HINCRBY', step, 'tokens', ntok)
  redis.call('HINCRBY', step, 'tokens_' .. ARGV[12], ntok)
  redis.call('HSETNX', step, ARGV[12] .. '_first_at', ARGV[13])
end
if st[6] ~= ARGV[2] and ntok > 0 then
  csv_append(req, 'instances', ARGV[2])
  redis.call('HSET', req, 'last', ARGV[2])
end
if ARGV[8] ~= '1' then return {'ok', n} end
redis.call('HSET', req, 'done', '1', 'finish', ARGV[9])
redis.call('DEL', lease)
release_owner(req, ARGV[1], ARGV[10])
redis.call('SREM', KEYS[4], ARGV[1])
redis.call('SADD', KEYS[5], ARGV[1])
local left = redis.call('HINCRBY', step, 'g:' .. st[7], -1)
local remaining = redis.call('HINCRBY', step, 'remaining', -1)
if remaining == 0 then return {'step', n} end
if left == 0 then return {'group', n} end
return {'final', n}
"""

# KEYS: req, lease, pending, leased, step | ARGV: rid, instance, ttl_ms, now, held_prefix
_ASSIGN = """
local req = KEYS[1]
if redis.call('HGET', req, 'done') == '1' then return nil end
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 0 then return nil end
local epoch = redis.call('HINCRBY', req, 'epoch', 1)
redis.call('SET', KEYS[2], ARGV[2] .. ':' .. epoch, 'PX', ARGV[3])
redis.call('SMOVE', KEYS[3], KEYS[4], ARGV[1])
redis.call('SADD', ARGV[5] .. ARGV[2] .. ':held', ARGV[1])
local st = redis.call('HMGET', req, 'n', 'last', 'tokens', 'prompt')
if tonumber(st[1]) > 0 and st[2] ~= ARGV[2] then redis.call('HINCRBY', KEYS[5], 'migrations', 1) end
redis.call('HSET', req, 'owner', ARGV[2], 'assigned_at', ARGV[4])
return {epoch, st[3] or '', st[4]}
"""

# KEYS: req, lease, pending, leased, step | ARGV: rid, expected_epoch ('' = any), held_prefix,
# mode ('token': the next owner resumes after the committed tokens; 'request': it starts over)
_REVOKE = _COMMON + """
local req = KEYS[1]
if redis.call('HGET', req, 'done') == '1' then return 0 end
local cur = redis.call('HGET', req, 'epoch')
if ARGV[2] ~= '' and cur ~= ARGV[2] then return 0 end
if redis.call('SISMEMBER', KEYS[4], ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', req, 'epoch', 1)
redis.call('DEL', KEYS[2])
release_owner(req, ARGV[1], ARGV[3])
redis.call('SMOVE', KEYS[4], KEYS[3], ARGV[1])
-- Waste: tokens the owner last reported generated but not yet published are lost (chunks it
-- published but that arrive after this are counted when they are rejected as stale); in
-- request mode the committed tokens are thrown away too.
local n = tonumber(redis.call('HGET', req, 'n'))
local waste = tonumber(redis.call('HGET', req, 'seen') or '0')
if ARGV[4] == 'request' and n > 0 then
  waste = waste + n
  redis.call('HSET', req, 'tokens', '', 'n', 0, 'instances', '', 'last', '')
  redis.call('HINCRBY', KEYS[5], 'tokens', -n)
end
redis.call('HSET', req, 'seen', 0)
redis.call('HINCRBY', KEYS[5], 'tokens_regenerated', waste)
return 1
"""

# ARGV: lease_prefix, req_prefix, instance, ttl_ms, then (rid, epoch, buffered) triples.
# One round trip per heartbeat however many responses the instance holds.
_RENEW_MANY = """
local lost = {}
for i = 5, #ARGV, 3 do
  local rid = ARGV[i]
  local lease = ARGV[1] .. rid
  if redis.call('GET', lease) == (ARGV[3] .. ':' .. ARGV[i + 1]) then
    redis.call('PEXPIRE', lease, ARGV[4])
    redis.call('HSET', ARGV[2] .. rid, 'seen', ARGV[i + 2])
  else
    lost[#lost + 1] = rid
  end
end
return lost
"""

def _csv(values: list[int]) -> str:
    return ",".join(map(str, values))


def _ints(text: str | None) -> list[int]:
    return [int(t) for t in text.split(",")] if text else []


@dataclass(frozen=True, slots=True)
class CommitResult:
    status: str  # ok | final | group | step | duplicate | stale | gap | wrong_version | ...
    committed: int  # tokens committed for the response after this chunk


class Ledger:
    """The manager's view of responses; stateless itself, everything lives in Redis."""

    def __init__(self, redis: aioredis.Redis, lease_ttl_s: float, migration: str = "token") -> None:
        self.r = redis
        self.migration = migration  # "token" (resume) or "request" (restart: the ablation)
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self._commit = redis.register_script(_COMMIT)
        self._assign = redis.register_script(_ASSIGN)
        self._revoke = redis.register_script(_REVOKE)
        self._renew_many = redis.register_script(_RENEW_MANY)
        self._held_prefix = Keys.instance("")

    async def create_step(
        self, run_id: str, step: int, version: int, prompts: list[list[int]], samples: int,
        max_new_tokens: int, extra: dict[str, str | int | float] | None = None,
    ) -> bool:
        """Create every response of the step once; a repeated call changes nothing."""
        skey = Keys.step(run_id, step)
        if not await self.r.hsetnx(skey, "created", "1"):
            return False
        pipe = self.r.pipeline(transaction=True)
        total = len(prompts) * samples
        now = time.time()
        extra = dict(extra or {})
        if "window_s" in extra:
            extra["window_end"] = now + float(extra["window_s"])
        fields: dict[str, str | int | float] = {
            "version": version, "total": total, "remaining": total, "state": "rollout",
            "started_at": now, "tokens": 0, "migrations": 0, "preemptions": 0,
            "duplicate_chunks_dropped": 0, "stale_chunks_rejected": 0, "tokens_regenerated": 0,
            "tokens_reserved": 0, "tokens_spot": 0, **extra,
        }
        for p, prompt in enumerate(prompts):
            fields[f"g:{p}"] = samples
            for s in range(samples):
                rid = request_id(run_id, step, p, s)
                pipe.hset(Keys.request(rid), mapping={
                    "run": run_id, "step": step, "p": p, "s": s, "version": version,
                    "prompt": _csv(prompt), "tokens": "", "n": 0, "epoch": 0, "owner": "",
                    "done": "0", "finish": "", "instances": "", "last": "", "seen": 0,
                    "max": max_new_tokens,
                })
                pipe.sadd(Keys.pending(run_id, step), rid)
        pipe.hset(skey, mapping=fields)
        await pipe.execute()
        return True

    async def commit(self, chunk: TokenChunk) -> CommitResult:
        run_id, step, _, _ = parse_request_id(chunk.request_id)
        rid = chunk.request_id
        status, n = await self._commit(
            keys=[Keys.request(rid), Keys.lease(rid), Keys.step(run_id, step),
                  Keys.leased(run_id, step), Keys.done(run_id, step)],
            args=[rid, chunk.instance_id, chunk.epoch, chunk.weight_version, chunk.offset,
                  len(chunk.token_ids), _csv(chunk.token_ids), "1" if chunk.final else "0",
                  chunk.finish_reason or "", self._held_prefix, Keys.pending(run_id, step),
                  chunk.kind, time.time()],
        )
        return CommitResult(str(status), int(n))

    async def assign(
        self, rid: str, instance_id: str, temperature: float, seed: int, eos_token_id: int
    ) -> Assignment | None:
        run_id, step, p, s = parse_request_id(rid)
        got = await self._assign(
            keys=[Keys.request(rid), Keys.lease(rid), Keys.pending(run_id, step),
                  Keys.leased(run_id, step), Keys.step(run_id, step)],
            args=[rid, instance_id, self.lease_ttl_ms, time.time(), self._held_prefix],
        )
        if not got:
            return None
        epoch, tokens, prompt = got
        meta = await self.r.hmget(Keys.request(rid), ["version", "max"])
        return Assignment(
            request_id=rid, run_id=run_id, step=step, prompt_index=p, sample_index=s,
            weight_version=int(meta[0]), epoch=int(epoch), prompt_token_ids=_ints(prompt),
            committed_token_ids=_ints(tokens), max_new_tokens=int(meta[1]),
            temperature=temperature, seed=seed, eos_token_id=eos_token_id,
        )

    async def revoke(self, rid: str, expected_epoch: int | None = None) -> bool:
        run_id, step, _, _ = parse_request_id(rid)
        done = await self._revoke(
            keys=[Keys.request(rid), Keys.lease(rid), Keys.pending(run_id, step),
                  Keys.leased(run_id, step), Keys.step(run_id, step)],
            args=[rid, "" if expected_epoch is None else expected_epoch, self._held_prefix,
                  self.migration],
        )
        return bool(done)

    async def renew_many(self, instance_id: str, held: list[tuple[str, int, int]]) -> list[str]:
        """Renew every (request id, epoch, buffered) lease of one heartbeat; returns the
        request ids whose lease is no longer the instance's."""
        if not held:
            return []
        args: list[str | int] = [Keys.lease(""), Keys.request(""), instance_id, self.lease_ttl_ms]
        for rid, epoch, buffered in held:
            args += [rid, epoch, buffered]
        lost = await self._renew_many(keys=[], args=args)
        return [str(r) for r in lost]

    async def samples(self, rids: list[str]) -> list[Sample]:
        pipe = self.r.pipeline(transaction=False)
        for rid in rids:
            pipe.hmget(Keys.request(rid), ["p", "s", "version", "prompt", "tokens", "finish",
                                           "instances"])
        rows = await pipe.execute()
        out = []
        for rid, row in zip(rids, rows, strict=True):
            p, s, version, prompt, tokens, finish, instances = row
            out.append(Sample(
                request_id=rid, prompt_index=int(p), sample_index=int(s),
                weight_version=int(version), prompt_token_ids=_ints(prompt),
                response_token_ids=_ints(tokens), finish_reason=finish or "",
                instances=[i for i in (instances or "").split(",") if i],
            ))
        out.sort(key=lambda x: (x.prompt_index, x.sample_index))
        return out

    async def done_samples(self, run_id: str, step: int) -> list[Sample]:
        rids = sorted(await self.r.smembers(Keys.done(run_id, step)))
        return await self.samples(rids)

    async def group_samples(
        self, run_id: str, step: int, prompt_index: int, n: int
    ) -> list[Sample]:
        return await self.samples([request_id(run_id, step, prompt_index, s) for s in range(n)])
