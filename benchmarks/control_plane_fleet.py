"""The emulated rollout fleet of ``make bench-control-plane``: instances that take the real
manager's assignments, heartbeat as rollout_svc does, and publish the emu oracle's tokens as
token frames; and one step of a run driven from the trainer's side of the protocol."""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from itertools import zip_longest
from typing import Any

import httpx
from nats.errors import Error as NatsError

from rollout_svc.engines import GenRequest
from rollout_svc.engines.emu import EmuEngine
from shared import names
from shared import protocol as wire
from shared.bus import R, decode_reply, request
from shared.errors import PeerTimeout, RlboostError
from shared.mac import entry_mac
from shared.process import wait_event

Meta = list[tuple[str, int, bool]]  # per entry: request id, offset after it, final
Frame = tuple[Meta, bytes]  # an encoded TokenFrame and what its entries carry
# Reasoning-length responses, as RL on reasoning tasks runs them (budgets of 8k-20k tokens;
# the emu model's mean is a quarter of the budget: ~2.0 M tokens a step here). A step is the
# unit measured, so its fixed costs (the first commit after the pause, the last part's group
# events, the barrier) weigh on every figure: at 512 a drained step took ~0.15 s (0.49-0.96 M
# tokens/s for the same code in three runs), and at 2,048, once the per-entry path was cut
# down, ~0.24 s, of which they were ~60 ms (0.68x the bound, against 0.87x at 8,192).
INGEST_SPEC: dict[str, Any] = {"model": "emu", "steps": 1, "prompts_per_step": 128,
                               "samples_per_prompt": 8, "max_new_tokens": 8192, "seed": 11}
PUBLISHERS = 32  # 32 instances x 32 responses
BEAT_S = 0.5  # heartbeat period: rollout_svc's default RLBOOST_HEARTBEAT_S


def prompts(n: int) -> list[list[int]]:
    return [[1, p % 10, 4 + p % 3, 3] for p in range(n)]


# --- part 1: manager ingest vs raw NATS ----------------------------------------------------------

class Publisher:
    """One emulated instance: takes the manager's assignments, heartbeats, publishes chunks."""

    def __init__(self, iid: str, run_id: str, capacity: int = PUBLISHERS) -> None:
        self.iid, self.run_id, self.session = iid, run_id, secrets.token_hex(8)
        self.capacity = capacity
        self.assigned_at = 0.0  # perf_counter of its first assignment
        self.held: dict[str, wire.Assignment] = {}
        self.published: dict[str, int] = {}
        self.finished: dict[str, int] = {}  # final chunk sent: reported until its lease is gone
        self.lost = 0  # responses the manager took back while still being published
        self.beats = 0  # heartbeats the manager answered
        self._replies: dict[str, asyncio.Future[bytes]] = {}
        self._listening = False  # subscribed to its own inbox (on its first request)
        self._asked = 0

    async def ask(self, nc: Any, subject: str, msg: Any, reply_type: type[R],
                  timeout_s: float) -> R:
        """A request answered on this instance's own inbox, where alone the manager answers an
        instance; the fleet shares one connection, where each rollout_svc has its own."""
        prefix = names.inbox_prefix(self.iid)
        if not self._listening:
            async def on_reply(reply: Any) -> None:
                waiting = self._replies.pop(reply.subject, None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(reply.data)
            await nc.subscribe(f"{prefix}.*", cb=on_reply)
            self._listening = True
        self._asked += 1
        inbox = f"{prefix}.{self._asked}"
        self._replies[inbox] = answer = asyncio.get_running_loop().create_future()
        try:
            await nc.publish(subject, wire.encode(msg), reply=inbox)
            data = await asyncio.wait_for(answer, timeout_s)
        except (TimeoutError, NatsError):  # as shared.bus.request: the next beat may get through
            raise PeerTimeout(subject, timeout_s) from None
        finally:
            self._replies.pop(inbox, None)
        return decode_reply(subject, data, reply_type)

    async def on_assign(self, msg: Any) -> None:
        command = wire.decode_command(msg.data)
        if isinstance(command, wire.Assign):
            self.assigned_at = self.assigned_at or time.perf_counter()
            for a in command.items:
                self.held[a.request_id], self.published[a.request_id] = a, 0

    def beat(self) -> wire.Heartbeat:
        live = [wire.Held(request_id=r, epoch=a.epoch, published=self.published[r])
                for r, a in self.held.items() if r not in self.finished]
        return wire.Heartbeat(
            instance_id=self.iid, kind="spot", engine="emu", state="ready", run_id=self.run_id,
            weight_version=0, capacity=self.capacity, session=self.session, held=live + [
                wire.Held(request_id=r, epoch=e) for r, e in self.finished.items()])

    async def heartbeats(self, nc: Any, stop: asyncio.Event) -> None:
        # Each at its own phase, as independent machines are: started together, the whole
        # fleet beat in one burst (128 beats, ~70 ms of the manager's time) just as a step's
        # first leases went out.
        await wait_event(stop, random.Random(self.iid).uniform(0.0, BEAT_S))
        while not stop.is_set():
            try:
                reply = await self.ask(nc, names.heartbeat_subject(self.iid), self.beat(),
                                       wire.HeartbeatReply, 5.0)
            except RlboostError:  # answered late (or the manager is paused): the next one renews
                reply = wire.HeartbeatReply()
            else:
                self.beats += 1
            for rid in reply.revoke:  # a finished response leaves; a live one was taken back
                self.lost += rid not in self.finished and rid in self.held
                self.finished.pop(rid, None)
                self.held.pop(rid, None)
            await wait_event(stop, BEAT_S)

    def messages(self, engine: EmuEngine, flush: int) -> list[Frame]:
        """Every frame of this instance from the oracle: one per flush, with the next
        ``flush`` tokens of every live response, as rollout_svc publishes them."""
        per: list[list[tuple[str, int, bool, wire.FrameEntry]]] = []
        for rid, a in self.held.items():
            req = GenRequest(rid, a.prompt_token_ids, [], a.max_new_tokens, a.temperature, a.seed,
                             a.step, a.prompt_index, a.sample_index, a.eos_token_id, 0)
            tokens, parts = engine.expected_tokens(req), []
            stop = engine.natural_length(req) <= a.max_new_tokens  # else cut by the budget
            for off in range(0, len(tokens), flush):
                part, final = tokens[off:off + flush], off + flush >= len(tokens)
                entry = wire.FrameEntry.of(
                    request_id=rid, epoch=a.epoch, weight_version=0, offset=off, token_ids=part,
                    final=final, finish_reason=("stop" if stop else "length") if final else None)
                entry.mac = entry_mac(a.lease_key, self.iid, entry)
                parts.append((rid, off + len(part), final, entry))
            per.append(parts)
        frames: list[Frame] = []
        for at_once in zip_longest(*per):
            items = [x for x in at_once if x is not None]
            frame = wire.TokenFrame(instance_id=self.iid, entries=[x[3] for x in items])
            frames.append(([x[:3] for x in items], wire.encode(frame)))
        return frames

    async def publish(self, js: Any, frames: list[Frame]) -> None:
        """As rollout_svc does: one frame per flush, acked before the next, so a response has
        at most one entry in flight."""
        subject = names.chunk_subject(self.run_id, self.iid)
        for meta, data in frames:
            await js.publish(subject, data, timeout=30.0)
            for rid, end, final in meta:
                self.published[rid] = end
                if final and rid in self.held:
                    self.finished[rid] = self.held[rid].epoch


class Step:
    """One step of a run, driven from the trainer's side of the protocol with ``n`` emulated
    instances registered first (so dispatch spreads it evenly)."""

    def __init__(self, nc: Any, http: httpx.AsyncClient, tag: str, n: int, per: int,
                 max_new: int) -> None:
        self.nc, self.http, self.tag, self.n, self.per = nc, http, tag, n, per
        self.spec = {**INGEST_SPEC, "prompts_per_step": n * per // 8, "max_new_tokens": max_new}
        self.loop = asyncio.get_running_loop()
        self.barrier: asyncio.Future[tuple[float, wire.Barrier]] = self.loop.create_future()
        self.stop = asyncio.Event()
        self.total = n * per

    async def start(self) -> list[Publisher]:
        """Register, start step 0; returns once every response is assigned."""
        self.run_id = (await self.http.post("/v1/runs", json=self.spec)).json()["id"]
        pubs = [Publisher(f"{self.tag}-{k}", self.run_id, self.per) for k in range(self.n)]

        async def on_barrier(msg: Any) -> None:
            if not self.barrier.done():
                self.barrier.set_result((time.perf_counter(), wire.decode(msg.data,
                                                                          wire.Barrier)))
        await self.nc.subscribe(names.barrier_subject(self.run_id), cb=on_barrier)
        for p in pubs:
            await self.nc.subscribe(names.assign_subject(p.iid), cb=p.on_assign)
            await p.ask(self.nc, names.heartbeat_subject(p.iid), p.beat(),
                        wire.HeartbeatReply, 10.0)
        await request(self.nc, names.TRAINER_POLL, wire.TrainerPoll(trainer_id="bench"),
                      wire.ActiveRun)
        start = wire.StepStart(run_id=self.run_id, step=0, weight_version=0,
                               prompt_token_ids=prompts(int(self.spec["prompts_per_step"])),
                               eos_token_id=2)
        self.started, self.started_wall = time.perf_counter(), time.time()
        assert (await request(self.nc, names.TRAINER_START, start, wire.Ack)).ok
        self.beats = [asyncio.create_task(p.heartbeats(self.nc, self.stop)) for p in pubs]
        while sum(len(p.held) for p in pubs) < self.total:
            await asyncio.sleep(0.01)
        return pubs

    async def finish(self, pubs: list[Publisher]) -> None:
        """Stop beating, cancel the run (no trainer will finish it), and leave, as a rollout
        instance leaves when it stops: left to expire, each pass's 32 instances stayed
        registered for the instance TTL, and every later pass's dispatch read them all."""
        self.stop.set()
        await asyncio.gather(*self.beats)
        await self.http.post(f"/v1/runs/{self.run_id}/cancel")
        for p in pubs:
            await p.ask(self.nc, names.release_subject(p.iid), wire.Release(
                instance_id=p.iid, held=[], session=p.session), wire.Ack, 10.0)
