"""Exactly-once token accounting in Redis: every state change of a response is one Lua script.

Contract: a response ("request") is a Redis hash; its tokens are committed only by
:meth:`Ledger.commit_many` (token frames in stream order, each frame's entries in one script
call), which for each entry checks atomically that its lease epoch is the current one and its
lease is alive (fencing), that its offset is the next uncommitted position, and then appends.
So a redelivered entry is a counted duplicate, an entry from a revoked or expired owner is a
counted stale entry, and no interleaving of manager restarts, redeliveries or zombies can
commit a token twice. Ownership changes (:meth:`assign`, :meth:`revoke`) bump the epoch in
the same atomic way, and each stamps the response's ``progress_at`` (the no-progress check,
:meth:`stalled_leases`). The scripts are ``manager_svc/lua/{commit,assign,revoke,renew_many}.lua``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from manager_svc.crash import STEP_CREATE_COMMIT, STEP_CREATE_REQUESTS, CrashPoints
from manager_svc.scripts import Call, register, run_batch
from shared.digest import (
    RowDigest,
    row_digest,
    rows_digest,
    token_csv,
    turns_json,
    versions_text,
)
from shared.names import Keys, parse_request_id, request_id
from shared.protocol import Assignment, Digest, Sample, TokenFrame, unpack_logprobs
from shared.turns import Turn, loss_mask, response_turns

log = logging.getLogger("manager")
# Entries per commit script: frames are packed into one script until they reach this many (a
# frame is never split). A script holds Redis while it runs (several us an entry), so a big
# batch goes as several pipelined scripts and other clients' commands get in between them.
COMMIT_SLICE = 256
# Responses written per step-creation script. Redis serves nobody while a script runs (and,
# with appendfsync always, until its AOF write is synced), so a step's creation goes in slices
# small enough for pings and the event loop to keep up (docs/ingest-history.md has the figures).
CREATE_BATCH = 512
# Responses read by one script call: a reply stays a few MB even at reasoning lengths, and
# Redis serves other clients between calls.
READ_SLICE = 256
STEP_KEYS = 1024  # step keys remembered by the commit's packing (a key per step, not entry)
_json = msgspec.json.Encoder()


def _flat(fields: dict[str, Any]) -> bytes:
    """A hash's fields as the JSON list of alternating names and values a script unpacks."""
    return _json.encode([str(x) for kv in fields.items() for x in kv])


_int_list = msgspec.json.Decoder(list[int])


# A response as stored: p, s, version, prompt, tokens, finish, instances, obs (an agentic
# response's observation turns), env_reward (its environment's reward), logprobs (hex),
# versions (an asynchronous run's "<first token>:<version>" CSV)
Row = list[str | None]


def stored_turns(row: Row) -> list[Turn]:
    """A stored response's turns: none for a single-turn one (every token a model token)."""
    return response_turns(row[7], row[4] or "")


def stored_versions(row: Row) -> list[list[int]]:
    """An asynchronous run's response: [first token, weight version] per run of tokens one
    version made (leases that committed nothing left out); empty in a synchronous run, where
    the sample's ``weight_version`` made every token."""
    text = row[10] if len(row) > 10 else None
    if not text:
        return []
    n = row[4].count(",") + 1 if row[4] else 0
    out: list[list[int]] = []
    for part in text.split(","):
        start, version = (int(x) for x in part.split(":"))
        if start >= n:
            continue  # a lease that committed nothing
        if out and out[-1][0] == start:
            out.pop()  # the earlier lease at this token committed nothing
        if not out or out[-1][1] != version:
            out.append([start, version])
    return out


def stored_logprobs(row: Row) -> list[float]:
    """A stored response's behaviour log-probs, one per token; empty unless every token has
    one (an entry without any leaves the stored ones short of the tokens)."""
    hexed, tokens = row[9] if len(row) > 9 else None, row[4]
    n = tokens.count(",") + 1 if tokens else 0
    if not hexed or len(hexed) != 8 * n:
        return []
    return unpack_logprobs(bytes.fromhex(hexed))


def turns_mask(turns: list[Turn]) -> list[int]:
    """The loss mask a stored response's turns give (empty for a single-turn one): samples
    carry it beside their turns, and the trainer checks that the two agree."""
    return loss_mask(turns, turns[-1].end) if turns else []


def stored_digest(row: Row) -> RowDigest:
    """A stored response's part of the step's digest, hashed from its stored text."""
    p, s, version, prompt, tokens = row[:5]
    return row_digest(int(p or 0), int(s or 0), int(version or 0), prompt or "", tokens or "",
                      turns_json(stored_turns(row)) if row[7] else "",
                      versions_text(stored_versions(row)))


def _ints(text: str | None) -> list[int]:
    # The CSV as a JSON array, parsed by msgspec in one C call rather than a split and an int()
    # a token: the manager parses every response at its group's end and again at the barrier.
    return _int_list.decode(f"[{text}]") if text else []


_EXTEND_REFUSED = {
    -1: "the step does not exist or does not use dynamic sampling",
    -2: "the step is closed, or its prompt count is not the extension's first index",
    -3: "the extension would pass max_gen_batches * prompts_per_step prompts",
}


class StepRefused(Exception):
    """A dynamic-sampling change the step's state does not allow (the trainer re-reads it)."""


@dataclass(frozen=True, slots=True)
class CommitResult:
    status: str  # ok | final | group | step | duplicate | stale | gap | wrong_version | ...
    committed: int  # tokens committed for the response after this entry


def commit_results(replies: list[Any]) -> list[CommitResult]:
    """The commit script's replies ("<status> <n>,..." per call) as one result per entry."""
    return [CommitResult(status, int(n)) for reply in replies
            for status, n in (item.split(" ") for item in str(reply).split(","))]


def commit_statuses(replies: list[Any]) -> list[str]:
    """Each entry's status alone, of :func:`commit_results`: all ingest counts, and it spares
    ingest's hot path a result object per entry."""
    return [item.partition(" ")[0] for reply in replies for item in str(reply).split(",")]


class Ledger:
    """The manager's view of responses; stateless itself, everything lives in Redis."""

    def __init__(self, redis: aioredis.Redis, lease_ttl_s: float, migration: str = "token",
                 lease_key: Callable[[str, int], str] = lambda rid, epoch: "",
                 crash: CrashPoints | None = None, replica_acks: int = 0) -> None:
        self.r = redis
        # Replicas a commit must reach before its frames are acked (RLBOOST_REDIS_REPLICA_ACKS).
        self.replica_acks = replica_acks
        self.crash = crash or CrashPoints("", Path("."))
        self.lease_key = lease_key  # the MAC key of a lease, sent in its Assignment
        self.migration = migration  # "token" (resume) or "request" (restart: the ablation)
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.commit_script = register(redis, "commit.lua")
        self._assign = register(redis, "assign.lua")
        self._revoke = register(redis, "revoke.lua")
        self._renew_many = register(redis, "renew_many.lua")
        self._create_requests = register(redis, "create_requests.lua")
        self._create_step = register(redis, "create_step.lua")
        self._extend_step = register(redis, "extend_step.lua")
        self._close_step = register(redis, "close_step.lua")
        self._read_samples = register(redis, "read_samples.lua")
        self._expired_leases = register(redis, "expired_leases.lua")
        self._stalled_leases = register(redis, "stalled_leases.lua")
        # The commit script finds a step's sets by suffix; names.Keys stays the one definition.
        base = Keys.step("r", 0)
        self._step_keys: dict[str, str] = {}  # "<run>:<step>" -> the step's key (_frame_arg)
        self._step_suffixes = [k.removeprefix(base) for k in (
            Keys.leased("r", 0), Keys.done("r", 0), Keys.pending("r", 0), Keys.tooling("r", 0))]

    async def create_step(
        self, run_id: str, step: int, version: int, prompts: list[list[int]], samples: int,
        max_new_tokens: int, extra: dict[str, str | int | float] | None = None,
        seeding: dict[str, Any] | None = None,
    ) -> bool:
        """Create every response of the step once, and with the step ``seeding`` as the run's
        seeding state; a repeated call changes nothing. Responses go in awaited batches of
        CREATE_BATCH (a big step never holds Redis, nor the event loop, for long), then the
        step's hash in one script: that is the step's existence, so a crash anywhere before
        it leaves a step a retry creates whole, and nothing reads a half-made one."""
        skey = Keys.step(run_id, step)
        if await self.r.hexists(skey, "created"):
            return False
        pending = Keys.pending(run_id, step)
        head: list[str | int] = [run_id, step, version, max_new_tokens]
        args: list[str | int] = list(head)
        for p, prompt in enumerate(prompts):
            csv = token_csv(prompt)
            for s in range(samples):
                args += [request_id(run_id, step, p, s), p, s, csv]
                if len(args) - len(head) >= 4 * CREATE_BATCH:
                    if not await self._write_requests(skey, pending, args):
                        return False
                    args = list(head)
        if len(args) > len(head) and not await self._write_requests(skey, pending, args):
            return False
        self.crash.reach(STEP_CREATE_COMMIT)
        total = len(prompts) * samples
        now = time.time()
        extra = dict(extra or {})
        if "window_s" in extra:
            extra["window_end"] = now + float(extra["window_s"])
        # A dynamic-sampling step holds one extra count in ``remaining`` until the trainer
        # closes it: completing every response it has so far is not its barrier.
        hold = int(extra.get("dynamic", 0))
        fields: dict[str, str | int | float] = {
            "version": version, "total": total, "remaining": total + hold, "state": "rollout",
            "prompts": len(prompts), "tokens_discarded": 0,
            "started_at": now, "tokens": 0, "migrations": 0, "preemptions": 0,
            "duplicate_chunks_dropped": 0, "stale_chunks_rejected": 0, "tokens_regenerated": 0,
            "forged_chunks_rejected": 0, "invalid_chunks_dropped": 0,
            "tokens_reserved": 0, "tokens_spot": 0, **extra,
            **{f"g:{p}": samples for p in range(len(prompts))},
        }
        created = await self._create_step(keys=[skey, Keys.seeding(run_id)], args=[
            _flat(fields), _flat(seeding or {})])
        return bool(created)

    async def extend_step(self, run_id: str, step: int, first: int, prompts: list[list[int]],
                          samples: int, max_new_tokens: int, max_prompts: int) -> int:
        """Dynamic sampling: add ``prompts`` as prompt indices ``first ..`` of a created step,
        in one script (``lua/extend_step.lua``); returns the step's prompt count after it (a
        retry of an applied extension returns it unchanged). Raises :class:`StepRefused` when
        the step is not dynamic, is closed, has another count than ``first``, or would pass
        ``max_prompts``."""
        args: list[str | int] = [first, samples, max_prompts, max_new_tokens, run_id, step]
        for i, prompt in enumerate(prompts):
            csv = token_csv(prompt)
            for s in range(samples):
                args += [request_id(run_id, step, first + i, s), first + i, s, csv]
        got = int(await self._extend_step(
            keys=[Keys.step(run_id, step), Keys.pending(run_id, step)], args=args))
        if got < 0:
            raise StepRefused(_EXTEND_REFUSED[got])
        return got

    async def close_step(self, run_id: str, step: int, keep: list[int], filtered: list[int],
                         capped: bool) -> tuple[int, list[tuple[str, str]]]:
        """Dynamic sampling: the step trains on exactly the groups ``keep``; everything else
        leaves it, in one script (``lua/close_step.lua``). Returns the tokens it discarded and
        (owner, request id) of each response aborted in flight, for the caller to tell its
        owner (a lost message is made up for by the owner's next heartbeat, whose lease
        renewal fails). A retry after it applied returns (0, []) and changes nothing."""
        got = await self._close_step(
            keys=[Keys.step(run_id, step), Keys.pending(run_id, step),
                  Keys.leased(run_id, step), Keys.done(run_id, step),
                  Keys.dropped(run_id, step)],
            args=[int(capped), token_csv(sorted(keep)), token_csv(sorted(filtered))])
        status = int(got[0])
        if status == -1:
            raise StepRefused("the step does not exist or does not use dynamic sampling")
        if status == -2:
            raise StepRefused(f"kept group {got[1]} is not complete")
        if status == 0:
            return 0, []
        told = [str(x).split("|", 1) for x in got[2:]]
        return int(got[1]), [(owner, rid) for owner, rid in told]

    async def _write_requests(self, skey: str, pending: str, args: list[str | int]) -> bool:
        """One batch of responses; False once the step exists (another call created it)."""
        written = await self._create_requests(keys=[skey, pending], args=args)
        self.crash.reach(STEP_CREATE_REQUESTS)
        return bool(written)

    async def commit(self, frame: TokenFrame) -> list[CommitResult]:
        """One frame's entries, in order: a result per entry."""
        return await self.commit_many([frame])

    async def commit_many(self, frames: list[TokenFrame], wait_for_redis: bool = False
                          ) -> list[CommitResult]:
        """Commit the entries of ``frames`` in this order, in one round trip: pipelined
        scripts of whole frames, up to COMMIT_SLICE entries each. Each entry gets exactly the
        checks and updates a commit of it alone would (fencing, in-order offsets, duplicates),
        in order; frames only save messages, round trips and fsyncs. Returns one result per
        entry, frame after frame. ``wait_for_redis``: as :meth:`run_calls`."""
        return await self.run_calls(self.pack(frames), wait_for_redis)

    async def run_calls(self, calls: list[Call],
                        wait_for_redis: bool = False) -> list[CommitResult]:
        """Run the calls :meth:`pack` made in one round trip (as the benchmark's Redis-only
        bound does one at a time, with no NATS and no manager in front of it). With
        ``wait_for_redis`` an outage is waited out, never skipped: the stream holds later
        frames behind these, so every offset stays in sequence. The calls are then sent
        again; their executed part reads as duplicates, as a lost reply to one commit does."""
        return commit_results(await self.run_replies(calls, wait_for_redis))

    async def run_replies(self, calls: list[Call], wait_for_redis: bool = False) -> list[Any]:
        """:meth:`run_calls`, its replies as Redis gave them."""
        delay = 0.05
        while True:
            try:
                return await run_batch(self.r, calls, self.replica_acks)
            except RedisError as exc:
                if not wait_for_redis:
                    raise
                log.warning("commit waits for Redis: %s", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _frame_arg(self, frame: TokenFrame, texts: list[bytes] | None) -> bytes:
        entries = []
        step_keys = self._step_keys
        for i, e in enumerate(frame.entries):
            scope = e.request_id.rsplit(":", 2)[0]  # "<run>:<step>": one step key per step
            skey = step_keys.get(scope)
            if skey is None:
                if len(step_keys) >= STEP_KEYS:
                    step_keys.clear()
                run_id, step, _, _ = parse_request_id(e.request_id)
                skey = step_keys[scope] = Keys.step(run_id, step)
            # Epoch and tokens go as text: Lua numbers are doubles, and the lease check and
            # the stored response must see exactly the integers that were sent.
            # The CSV as a JSON string spliced from the ids' JSON array (digits and commas
            # need no escaping) where ingest encoded it already.
            csv = token_csv(e.token_ids) if texts is None else msgspec.Raw(
                b'"' + texts[i][1:-1] + b'"')
            entries.append([e.request_id, str(e.epoch), e.weight_version, e.offset,
                            e.n_tokens, csv, e.final, e.finish_reason or "", skey,
                            e.logprobs.hex()])
        return _json.encode([frame.instance_id, frame.kind, entries])

    def pack(self, frames: list[TokenFrame], texts: list[list[bytes]] | None = None
             ) -> list[Call]:
        """The commit script's calls for ``frames``, in order: one per COMMIT_SLICE entries,
        and a new one where the run changes (a call reaches the keys of one run: one slot of
        a Redis Cluster). Every entry of a frame is of the run of its subject (ingest).
        ``texts``: per frame, :func:`~shared.digest.token_json` of each entry's ids."""
        head: list[str | bytes | float] = [time.time(), *self._step_suffixes]
        calls: list[Call] = []
        args, size, run_id = list(head), 0, ""
        for n, frame in enumerate(frames):
            if not frame.entries:
                continue
            frame_run = parse_request_id(frame.entries[0].request_id)[0]
            if size and (size >= COMMIT_SLICE or frame_run != run_id):
                calls.append(Call(self.commit_script, [Keys.run(run_id)], args))
                args, size = list(head), 0
            run_id = frame_run
            args.append(self._frame_arg(frame, None if texts is None else texts[n]))
            size += len(frame.entries)
        if size:
            calls.append(Call(self.commit_script, [Keys.run(run_id)], args))
        return calls

    async def assign(
        self, rid: str, instance_id: str, temperature: float, seed: int, eos_token_id: int
    ) -> Assignment | None:
        got = await self.assign_many([rid], instance_id, temperature, seed, eos_token_id)
        return got[0] if got else None

    async def assign_many(
        self, rids: list[str], instance_id: str, temperature: float, seed: int,
        eos_token_id: int,
    ) -> list[Assignment]:
        """Lease responses of one step to one instance in one atomic script; those another
        pass took (or that are done) are left out of the result."""
        [got] = await self.assign_plan([(instance_id, rids)], temperature, seed, eos_token_id)
        return got

    async def assign_plan(
        self, plan: list[tuple[str, list[str]]], temperature: float, seed: int,
        eos_token_id: int, versions: dict[str, int] | None = None,
    ) -> list[list[Assignment]]:
        """Lease each (instance, responses of one step) of ``plan``: one atomic script each,
        all pipelined in one round trip, so a step's first pass over 128 instances waits for
        Redis (and its fsync, appendfsync always) once, not 128 times in a row. Returns, per
        entry, the assignments made (what another pass took or is done is left out).
        ``versions``: in an asynchronous run, each instance's weight version, which its
        leases are of (lua/assign.lua); None: the step's own."""
        out: list[list[Assignment]] = [[] for _ in plan]
        calls = [(k, instance_id, rids) for k, (instance_id, rids) in enumerate(plan) if rids]
        for _, _, rids in calls:
            run_id, step, _, _ = parse_request_id(rids[0])
            # The script takes one step's pending and leased sets: an id of another step
            # would be leased against the wrong ones.
            if any(parse_request_id(r)[:2] != (run_id, step) for r in rids):
                raise ValueError(f"assign_many takes responses of one step, got {rids[0]}...")
        if not calls:
            return out
        now = time.time()
        replies = await run_batch(self.r, [
            self._assign_call(instance_id, rids, now,
                              None if versions is None else versions[instance_id])
            for _, instance_id, rids in calls])
        for (k, _, rids), reply in zip(calls, replies, strict=True):
            out[k] = self._assignments(rids, reply, temperature, seed, eos_token_id)
        return out

    def _assign_call(self, instance_id: str, rids: list[str], now: float,
                     version: int | None = None) -> Call:
        run_id, step, _, _ = parse_request_id(rids[0])
        return Call(self._assign, [Keys.pending(run_id, step), Keys.leased(run_id, step),
                                   Keys.step(run_id, step), Keys.held(run_id, instance_id),
                                   Keys.holders(run_id)],
                    [instance_id, self.lease_ttl_ms, now, "" if version is None else version,
                     *rids])

    def _assignments(self, rids: list[str], got: list[Any], temperature: float, seed: int,
                     eos_token_id: int) -> list[Assignment]:
        out: list[Assignment] = []
        for rid, item in zip(rids, got, strict=True):
            if not item:
                continue
            epoch, tokens, prompt, version, max_new = item
            run_id, step, p, s = parse_request_id(rid)
            out.append(Assignment(
                request_id=rid, run_id=run_id, step=step, prompt_index=p, sample_index=s,
                weight_version=int(version), epoch=int(epoch),
                lease_key=self.lease_key(rid, int(epoch)), prompt_token_ids=_ints(prompt),
                committed_token_ids=_ints(tokens), max_new_tokens=int(max_new),
                temperature=temperature, seed=seed, eos_token_id=eos_token_id,
            ))
        return out

    async def revoke(self, rid: str, expected_epoch: int | None = None) -> bool:
        """Take ``rid`` back (at ``expected_epoch``, if given): the manager's own decision."""
        return await self._revoke_as(rid, expected_epoch, "") == 1

    async def hand_back(self, rid: str, epoch: int, holder: str) -> int:
        """``holder`` hands ``rid`` back at ``epoch``: 1 revoked, 0 nothing to do (done or
        another epoch), -1 refused because ``holder`` does not hold it."""
        return await self._revoke_as(rid, epoch, holder)

    async def _revoke_as(self, rid: str, expected_epoch: int | None, holder: str) -> int:
        run_id, step, _, _ = parse_request_id(rid)
        return int(await self._revoke(
            keys=[Keys.request(rid), Keys.lease(rid), Keys.pending(run_id, step),
                  Keys.leased(run_id, step), Keys.step(run_id, step)],
            args=[rid, "" if expected_epoch is None else expected_epoch, self.migration,
                  holder],
        ))

    async def expired_leases(self, run_id: str, step: int) -> list[str]:
        """The step's leased responses whose lease nobody renewed in time, sorted."""
        gone = await self._expired_leases(keys=[Keys.leased(run_id, step)])
        return sorted(str(r) for r in gone)

    async def stalled_leases(self, run_id: str, step: int, bound_s: float
                             ) -> list[tuple[str, str, float]]:
        """(request id, owner, seconds since its last commit or grant) of each leased response
        of the step that has committed nothing for ``bound_s``, sorted."""
        flat = await self._stalled_leases(keys=[Keys.leased(run_id, step)],
                                          args=[time.time(), bound_s])
        return sorted((str(flat[i]), str(flat[i + 1]), float(flat[i + 2]))
                      for i in range(0, len(flat), 3))

    async def renew_many(self, instance_id: str, held: list[tuple[str, int, int]]) -> list[str]:
        """Renew every (request id, epoch, buffered) lease an instance reports; returns the
        request ids whose lease is no longer the instance's. One script call per run."""
        by_run: dict[str, list[str | int]] = {}
        for rid, epoch, buffered in held:
            by_run.setdefault(parse_request_id(rid)[0], []).extend((rid, epoch, buffered))
        replies = await run_batch(self.r, [
            Call(self._renew_many, [Keys.run(run_id)], [instance_id, self.lease_ttl_ms, *args])
            for run_id, args in by_run.items()])
        return [str(r) for lost in replies for r in lost]

    async def rows(self, rids: list[str]) -> list[Row]:
        """Each response's stored (p, s, version, prompt, tokens, finish, instances), in
        ``rids`` order: READ_SLICE responses a script call, every call in one round trip."""
        if not rids:
            return []
        calls: list[Call] = []
        run_id = ""
        for rid in rids:  # READ_SLICE at most a call, each call of one run (its slot)
            of = rid.partition(":")[0]
            if of != run_id or len(calls[-1].args) >= READ_SLICE:
                run_id = of
                calls.append(Call(self._read_samples, [Keys.run(of)], []))
            calls[-1].args.append(rid)
        rows = [row for part in await run_batch(self.r, calls) for row in part]
        for rid, row in zip(rids, rows, strict=True):
            if row[0] is None:  # listed as complete yet gone: never made up as an empty sample
                raise LookupError(f"response {rid} has no stored record")
        return rows

    async def samples(self, rids: list[str]) -> list[Sample]:
        """The responses ``rids`` as samples, in (prompt, sample) order."""
        out = []
        for rid, row in zip(rids, await self.rows(rids), strict=True):
            p, s, version, prompt, tokens, finish, instances = row[:7]
            out.append(Sample(
                request_id=rid, prompt_index=int(p or 0), sample_index=int(s or 0),
                weight_version=int(version or 0), prompt_token_ids=_ints(prompt),
                response_token_ids=_ints(tokens), finish_reason=finish or "",
                instances=[i for i in (instances or "").split(",") if i],
                turns=(turns := stored_turns(row)), loss_mask=turns_mask(turns),
                env_reward=None if row[8] is None else float(row[8]),
                behaviour_logprobs=stored_logprobs(row), token_versions=stored_versions(row),
            ))
        out.sort(key=lambda x: (x.prompt_index, x.sample_index))
        return out

    async def done_digest(self, run_id: str, step: int,
                          known: dict[str, RowDigest] | None = None) -> Digest:
        """The digest of the step's complete responses, as :func:`sample_digest` of
        :meth:`done_samples` computes it, hashed from the stored CSV text itself: the barrier
        then neither parses every token nor prints it back. Responses in ``known`` (parts
        :meth:`samples` gave) are not read again: a complete response never changes."""
        known = known or {}
        rids = await self._done_rids(run_id, step)
        missing = [rid for rid in rids if rid not in known]
        read = dict(zip(missing, map(stored_digest, await self.rows(missing)), strict=True))
        return rows_digest([known[rid] if rid in known else read[rid] for rid in rids])

    async def done_samples(self, run_id: str, step: int) -> list[Sample]:
        return await self.samples(await self._done_rids(run_id, step))

    async def _done_rids(self, run_id: str, step: int) -> list[str]:
        return sorted(await self.r.smembers(Keys.done(run_id, step)))
