"""What a commit completed, told to the trainer: group events and the step's barrier.

Contract: :meth:`Announcer.tally` reads a committed part's results (counts, revocations, the
groups and steps it completed) and :meth:`Announcer.announce` then publishes a ``GroupDone``
per completed group, with its samples when they fit a message, before the ``Barrier`` of a
completed step. A response that completes before its group is read then and held for the
group's event, so the step's last part reads little more than its own responses. The barrier
freezes the step's digest once per replica however many callers find the step complete
(ingest's commit, the dispatcher's pass, a dynamic-sampling close). A step whose completing
part this replica is announcing is this replica's to announce: other callers wait for it
rather than read the whole step a second time alongside it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import redis.asyncio as aioredis
from nats.aio.client import Client as Nats
from redis.exceptions import RedisError

from manager_svc.accounting import (
    Ledger,
    Row,
    stored_digest,
    stored_logprobs,
    stored_turns,
    stored_versions,
    turns_mask,
)
from manager_svc.metrics import ManagerMetrics
from manager_svc.runs import RunStore
from manager_svc.soft_state import SoftState
from shared import names
from shared.digest import RowDigest
from shared.names import Keys, request_id
from shared.protocol import MESSAGE_BUDGET, Barrier, FrameEntry, GroupDone, TokenFrame, encode
from shared.spec import RunSpec
from shared.turns import Turn

log = logging.getLogger("manager")
CACHE_SIZE = 64  # runs whose spec, and steps whose barrier count, are remembered
ROW_STEPS = 4  # steps whose announced responses' digest parts are kept for their barrier
# Complete responses held for their group's event, read when they end rather than when the
# group does. No part's are read once this much text is held (a 2 M-token step is ~10 MB), so
# it is passed by one part's at most; what is not held, a group reads when it completes.
FINISHED_BYTES = 128 << 20
# Group events made and published between yields to the event loop: the commit in flight
# waits for its answer to be read, and Redis for the next commit, meanwhile.
GROUPS_PER_YIELD = 8
Group = tuple[str, int, int]  # run id, step, prompt index
StepKey = tuple[str, int]


@dataclass
class Tally:
    """A committed part's results, counted."""

    statuses: Counter[str] = field(default_factory=Counter)
    tokens: int = 0
    discarded: int = 0
    ended: list[Group] = field(default_factory=list)  # groups complete, in commit order
    finished: list[str] = field(default_factory=list)  # responses complete, groups not
    steps: list[StepKey] = field(default_factory=list)  # steps complete
    # responses whose model turn ended, awaiting their environment's answer (manager_svc.turns)
    turned: list[str] = field(default_factory=list)


class _StoredSample(msgspec.Struct, kw_only=True):
    """A :class:`~shared.protocol.Sample` as the trainer decodes it, with the token lists
    spliced in from their stored text ("1,2,3" is the JSON array's body) rather than parsed
    and printed back, which was most of what announcing a drained step's last groups cost."""

    request_id: str
    prompt_index: int
    sample_index: int
    weight_version: int
    prompt_token_ids: msgspec.Raw
    response_token_ids: msgspec.Raw
    finish_reason: str
    instances: list[str]
    turns: list[Turn] = []
    loss_mask: list[int] = []
    env_reward: float | None = None
    behaviour_logprobs: list[float] = []
    token_versions: list[list[int]] = []


class _StoredGroupDone(msgspec.Struct, tag="GroupDone", kw_only=True):
    """:class:`~shared.protocol.GroupDone` on the wire, of stored samples."""

    run_id: str
    step: int
    prompt_index: int
    samples: list[_StoredSample]


_encode = msgspec.json.Encoder().encode
Held = tuple[_StoredSample, RowDigest, int]  # a response's sample, digest part, size (bytes)


def _stored_sample(rid: str, row: Row) -> _StoredSample:
    p, s, version, prompt, tokens, finish, instances = row[:7]
    return _StoredSample(
        request_id=rid, prompt_index=int(p or 0), sample_index=int(s or 0),
        weight_version=int(version or 0),
        prompt_token_ids=msgspec.Raw(f"[{prompt or ''}]".encode()),
        response_token_ids=msgspec.Raw(f"[{tokens or ''}]".encode()),
        finish_reason=finish or "", instances=[i for i in (instances or "").split(",") if i],
        turns=(turns := stored_turns(row)), loss_mask=turns_mask(turns),
        env_reward=None if row[8] is None else float(row[8]),
        behaviour_logprobs=stored_logprobs(row), token_versions=stored_versions(row))


class Announcer:
    def __init__(self, redis: aioredis.Redis, nc: Nats, ledger: Ledger, runs: RunStore,
                 metrics: ManagerMetrics, soft: SoftState) -> None:
        self.redis = redis
        self.nc = nc
        self.ledger = ledger
        self.runs = runs
        self.metrics = metrics
        self.soft = soft
        self._specs: dict[str, RunSpec] = {}  # run id -> its spec, written once at submission
        self._barriers: dict[StepKey, asyncio.Future[None]] = {}  # being made now
        self._rows: dict[StepKey, dict[str, RowDigest]] = {}  # see _known_rows
        self._parts: set[asyncio.Future[None]] = set()  # committing or being announced
        self._made: Counter[StepKey] = Counter()  # barriers made, by step (see barrier)
        self._finished: dict[StepKey, dict[str, Held]] = {}  # see _hold_finished
        self._finished_bytes = 0

    def track(self, part: asyncio.Future[None]) -> None:
        """``part`` commits and announces frames until it is done."""
        self._parts.add(part)
        part.add_done_callback(self._parts.discard)

    def tally(self, frames: list[TokenFrame], statuses: Iterator[str]) -> Tally:
        """Count a committed part's results (one status per entry, in order) and take back
        what was revoked."""
        # Counted once per part, not per entry: a labelled counter costs microseconds a call.
        t = Tally()
        for frame in frames:
            for entry in frame.entries:
                status = next(statuses)
                t.statuses[status] += 1
                if status in ("ok", "final", "group", "step", "tool"):
                    t.tokens += entry.n_tokens
                elif status == "aborted":  # its step closed without it (dynamic sampling)
                    t.discarded += entry.n_tokens
                if status in ("gap", "wrong_version", "overlong"):
                    self._taken_back(frame, entry, status)
                elif status == "final":
                    t.finished.append(entry.request_id)
                elif status == "tool":
                    t.turned.append(entry.request_id)
                elif status in ("group", "step"):
                    run_id, step, prompt, _ = names.parse_request_id(entry.request_id)
                    t.ended.append((run_id, step, prompt))
                    if status == "step":
                        t.steps.append((run_id, step))
        for status, n in t.statuses.items():
            self.metrics.chunks.labels(status).inc(n)
        self.metrics.tokens.inc(t.tokens)
        self.metrics.discarded.inc(t.discarded)
        return t

    async def announce(self, t: Tally, before: asyncio.Future[None] | None = None) -> None:
        """Announce the groups and steps a tallied part completed, after the part ``before``
        it (its groups first, whatever became of it): every group in one read of what is not
        held already (:meth:`_hold_finished`), before the barrier of its step."""
        # The part's complete responses are read while the part before it is announced: the
        # group that ends later (mostly in the step's last part, which the barrier waits for)
        # then reads only what its own part completed, not the step's last groups whole
        # after the last commit, where the barrier waits for them.
        hold = asyncio.ensure_future(self._hold_finished(t.finished)) if t.finished else None
        if before is not None:
            await asyncio.wait([before])
        if hold is not None:
            await hold
        await self._announce_groups(t.ended)
        for run_id, step in t.steps:
            await self._barrier_once(run_id, step)

    def _taken_back(self, frame: TokenFrame, entry: FrameEntry, status: str) -> None:
        """The commit script revoked the entry's response: dispatch leases it again."""
        self.metrics.revocations.labels(status).inc()
        log.info("entry of %s from %s: %s; taken back", entry.request_id, frame.instance_id,
                 status)
        self.soft.wake.set()

    async def _spec(self, run_id: str) -> RunSpec | None:
        spec = self._specs.get(run_id)
        if spec is None:
            spec = await self.runs.spec(run_id)  # a read and a decode: once, not per group
            if spec is not None:
                if len(self._specs) >= CACHE_SIZE:
                    self._specs.clear()
                self._specs[run_id] = spec
        return spec

    async def _announce_groups(self, groups: list[Group]) -> None:
        """Tell the trainer these groups are complete, each with its samples when they fit."""
        wanted: list[tuple[Group, int]] = []
        for group in groups:
            spec = await self._spec(group[0])
            if spec is not None:  # else the run's record is gone: nobody trains the group
                wanted.append((group, spec.samples_per_prompt))
        members = [((run_id, step), request_id(run_id, step, prompt, s))
                   for (run_id, step, prompt), n in wanted for s in range(n)]
        got = {rid: held for key, rid in members
               if (held := self._take_finished(key, rid)) is not None}
        missing = [rid for _, rid in members if rid not in got]
        for rid, row in zip(missing, await self.ledger.rows(missing), strict=True):
            got[rid] = (_stored_sample(rid, row), stored_digest(row), 0)
        for i, ((run_id, step, prompt), n) in enumerate(wanted, 1):
            if not i % GROUPS_PER_YIELD:
                await asyncio.sleep(0)  # the commit in flight's answer goes first
            known = self._known_rows(run_id, step)
            samples = []
            for s in range(n):  # in sample order, as the trainer's digest lists them
                rid = request_id(run_id, step, prompt, s)
                sample, known[rid], _ = got[rid]
                samples.append(sample)
            event = _encode(_StoredGroupDone(run_id=run_id, step=step, prompt_index=prompt,
                                             samples=samples))
            if len(event) > MESSAGE_BUDGET:  # the trainer pages it in after the barrier
                event = encode(GroupDone(run_id=run_id, step=step, prompt_index=prompt))
            await self.nc.publish(names.group_subject(run_id), event)

    async def _hold_finished(self, rids: list[str]) -> None:
        """Read complete responses whose groups are not, and hold them for their group's
        event (a complete response never changes). Only a head start: what is not held when
        the group completes, because this failed, the text passed FINISHED_BYTES or another
        replica committed the rest, is read then."""
        if self._finished_bytes >= FINISHED_BYTES:
            return
        try:
            rows = await self.ledger.rows(rids)
        except (RedisError, LookupError) as exc:
            log.info("complete responses left to their group's read: %s", exc)
            return
        for rid, row in zip(rids, rows, strict=True):
            run_id, step, _, _ = names.parse_request_id(rid)
            held = self._finished.get((run_id, step))
            if held is None:
                if len(self._finished) >= ROW_STEPS:  # the oldest step's: its barrier is made
                    self._drop_finished(next(iter(self._finished)))
                held = self._finished[(run_id, step)] = {}
            size = len(row[3] or "") + len(row[4] or "")
            held[rid] = (_stored_sample(rid, row), stored_digest(row), size)
            self._finished_bytes += size

    def _take_finished(self, key: StepKey, rid: str) -> Held | None:
        got = self._finished.get(key, {}).pop(rid, None)
        if got is not None:
            self._finished_bytes -= got[2]
        return got

    def _drop_finished(self, key: StepKey) -> None:
        self._finished_bytes -= sum(size for _, _, size in self._finished.pop(key, {}).values())

    async def barrier(self, run_id: str, step: int) -> None:
        """Every response of the step is complete, once: freeze the digest and announce it.

        The dispatcher (a complete step still in rollout) and a dynamic-sampling close call
        this. The parts this replica has in flight are waited for first: the dispatcher reads
        the step complete as soon as Redis has run the last commit, and its barrier used to
        start while ingest was still reading the last part's groups, so both read most of
        the step. Made by one of those parts, it is not made again; else (another replica's
        commit completed it, or the part failed) it is made now."""
        key = (run_id, step)
        made = self._made[key]
        parts = [part for part in self._parts if not part.done()]
        if parts:
            await asyncio.wait(parts)
            if self._made[key] != made:
                return
        await self._barrier_once(run_id, step)

    async def _barrier_once(self, run_id: str, step: int) -> None:
        """A barrier this replica is already making is waited for, not made twice: until the
        state says training, the dispatcher's every pass finds the step complete."""
        key = (run_id, step)
        running = self._barriers.get(key)
        if running is None:
            running = self._barriers[key] = asyncio.ensure_future(self._barrier(run_id, step))
            running.add_done_callback(lambda _: self._barriers.pop(key, None))
        await asyncio.shield(running)

    def _known_rows(self, run_id: str, step: int) -> dict[str, RowDigest]:
        """The digest parts of the step's responses this replica has announced."""
        rows = self._rows.get((run_id, step))
        if rows is None:
            if len(self._rows) >= ROW_STEPS:  # the oldest step's: its barrier reads them
                del self._rows[next(iter(self._rows))]
            rows = self._rows[(run_id, step)] = {}
        return rows

    async def _barrier(self, run_id: str, step: int) -> None:
        # Hashed from the parts its groups' announcements read; the rest (groups another
        # replica announced, or none announced since this one started) are read now.
        digest = await self.ledger.done_digest(run_id, step, self._rows.pop((run_id, step), None))
        await self.redis.hset(Keys.step(run_id, step), mapping={
            "state": "training", "rollout_done_at": time.time(),
            "digest": msgspec.json.encode(digest).decode(),
        })
        if len(self._made) >= CACHE_SIZE:
            self._made.clear()
        self._made[(run_id, step)] += 1
        self._drop_finished((run_id, step))  # of groups dynamic sampling left out, if any
        log.info("barrier %s step %d: %d responses, %d tokens", run_id, step,
                 digest.responses, digest.tokens)
        await self.nc.publish(names.barrier_subject(run_id),
                              encode(Barrier(run_id=run_id, step=step, digest=digest)))
