"""The trainer's side of the manager: steps start, samples, the barrier digest, step reports.

Contract: every handler is idempotent (a trainer retries after a lost reply or a restart of
either side): starting a step twice creates it once, a report for a recorded step is
acknowledged again, and a report whose digest differs from the barrier's fails the run. A
step's start chooses its seeding window (:mod:`manager_svc.seeding`) from the last step's
measurements, which the step's report adds to.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import msgspec
import redis.asyncio as aioredis

from manager_svc.accounting import Ledger
from manager_svc.metrics import ManagerMetrics
from manager_svc.placement import spot_count
from manager_svc.registry import Registry
from manager_svc.run_history import LIVE_COUNTERS
from manager_svc.runs import RunStore
from manager_svc.seeding import DEFAULT_WINDOW_S, SeedingState, next_window, observe
from manager_svc.soft_state import SoftState
from shared.names import Keys
from shared.protocol import (
    MESSAGE_BUDGET,
    STEP_STATS,
    Ack,
    ActiveRun,
    Digest,
    RunFailed,
    RunWarning,
    Sample,
    StepFinish,
    StepRecord,
    StepRecordQuery,
    StepSamples,
    StepSamplesQuery,
    StepStart,
    TrainerPoll,
    encode,
)

log = logging.getLogger("manager")
# Samples per reply at most; fewer when they would not fit in one message.
SAMPLES_PAGE_MAX = 512
# A dynamic-sampling step's own record fields (lua/close_step.lua writes them; tokens_discarded
# is a live counter, read with the others).
DYNAMIC_FIELDS = ("groups_kept", "groups_filtered", "groups_discarded",
                  "tokens_filtered", "responses_aborted", "dynamic_sampling_capped")


class TrainerApi:
    def __init__(self, redis: aioredis.Redis, ledger: Ledger, runs: RunStore,
                 registry: Registry, metrics: ManagerMetrics, soft: SoftState) -> None:
        self.redis = redis
        self.ledger = ledger
        self.runs = runs
        self.registry = registry
        self.metrics = metrics
        self.soft = soft
        # Step creations in progress (soft state: a restarted manager's retry redoes one).
        self._creating: dict[tuple[str, int], asyncio.Future[bool]] = {}

    async def on_poll(self, poll: TrainerPoll) -> ActiveRun:
        run_id = await self.runs.active()
        if not run_id:
            return ActiveRun()
        run, spec = await self.runs.get(run_id), await self.runs.spec(run_id)
        if run is None or spec is None:
            return ActiveRun()  # activated, then gone between the two reads: nothing to do
        return ActiveRun(run_id=run_id, spec=spec, step=run["step"], state=run["state"])

    async def on_step_start(self, msg: StepStart) -> Ack:
        run, spec = await self.runs.get(msg.run_id), await self.runs.spec(msg.run_id)
        if run is None or spec is None or run["state"] != "running":
            return Ack(ok=False, detail=f"run {msg.run_id} is not running")
        # Synchronous: the run's step, at its own version. With staleness k the steps up to
        # k ahead may start too, each at the oldest version its tokens may come from.
        if not run["step"] <= msg.step <= run["step"] + spec.staleness or \
                msg.step >= run["steps"] or msg.weight_version != spec.min_version(msg.step):
            return Ack(ok=False, detail=f"run is at step {run['step']} (staleness "
                                        f"{spec.staleness}), not {msg.step} at "
                                        f"v{msg.weight_version}")
        if len(msg.prompt_token_ids) != spec.prompts_per_step:
            return Ack(ok=False, detail="prompt count differs from prompts_per_step")
        seeding = await self._seeding(msg.run_id)
        # A step started ahead of training has no seeding window: the reserved side is
        # training the step before it, and spot instances (or, with none, the reserved side
        # once free) generate it.
        mode = spec.seeding.mode if msg.step == run["step"] else "off"
        spot_alive = spot_count(await self.registry.instances())
        if mode == "adaptive":
            window = next_window(seeding, spot_alive)
        else:
            window = spec.seeding.window_s if mode == "fixed" else 0.0
        seeding.window_s, seeding.spot_count = window, spot_alive
        key = (msg.run_id, msg.step)
        if key not in self._creating:  # a retry while the first call still writes joins it
            self._creating[key] = asyncio.ensure_future(self.ledger.create_step(
                msg.run_id, msg.step, msg.weight_version, msg.prompt_token_ids,
                spec.samples_per_prompt, spec.max_new_tokens,
                extra={"eos": msg.eos_token_id, "vocab": msg.vocab_size, "mode": mode,
                       "window_s": window, "dynamic": int(bool(spec.dynamic_sampling)),
                       "spot_count": spot_alive,  # what the window was chosen for
                       # > 1: a final stop ends a model turn, not the response (turns.py)
                       "max_turns": spec.max_turns,
                       # Seeding off and spot capacity present: the reserved side only trains.
                       "reserved_free": int(mode == "off" and spot_alive > 0),
                       # > 0: leased to versions [version, step] (dispatcher)
                       **({"staleness": spec.staleness} if spec.staleness else {})},
                seeding=seeding.dump() if msg.step == run["step"] else None))
        creating = self._creating[key]
        try:
            created = await asyncio.shield(creating)
        finally:
            if creating.done() and self._creating.get(key) is creating:
                del self._creating[key]
        if created:
            log.info("step %d of %s started (seeding %s, window %.2fs, %d spot)", msg.step,
                     msg.run_id, mode, window, spot_alive)
        self.soft.wake.set()
        return Ack()

    async def _seeding(self, run_id: str) -> SeedingState:
        raw = await self.redis.hgetall(Keys.seeding(run_id))
        if raw:
            return SeedingState.load(raw)
        spec = await self.runs.spec(run_id)
        initial = spec.seeding.window_s if spec else 0.0
        return SeedingState(window_s=initial or DEFAULT_WINDOW_S)

    async def _barrier_digest(self, run_id: str, step: int) -> Digest | None:
        raw = await self.redis.hget(Keys.step(run_id, step), "digest")
        return msgspec.json.decode(raw, type=Digest) if raw else None

    async def on_samples(self, query: StepSamplesQuery) -> StepSamples:
        digest = await self._barrier_digest(query.run_id, query.step)
        rids = sorted(await self.redis.smembers(Keys.done(query.run_id, query.step)))
        limit = max(0, min(query.limit, SAMPLES_PAGE_MAX))
        page = rids[max(0, query.offset):max(0, query.offset) + limit]
        info = await self.redis.hgetall(Keys.step(query.run_id, query.step))
        # A dynamic step's complete groups, until its barrier: a trainer that missed their
        # announcements (it restarted) pages them in, as no barrier comes before it decides.
        groups_done = sorted(int(k[2:]) for k, v in info.items()
                             if k.startswith("g:") and v == "0") \
            if info.get("dynamic") == "1" and digest is None else []
        # In request-id order, like the page: a trimmed reply must end where the next begins.
        samples = sorted(await self.ledger.samples(page) if page else [],
                         key=lambda x: x.request_id)
        size, fits = 0, 0
        for sample in samples:  # at least one, however long, so paging always advances
            size += len(encode(sample))
            if fits and size > MESSAGE_BUDGET:
                break
            fits += 1
        return StepSamples(run_id=query.run_id, step=query.step, complete=digest is not None,
                           train_now=digest is not None or info.get("reserved_free") == "1",
                           samples=samples[:fits], done=len(rids), digest=digest,
                           prompts=int(info.get("prompts", 0)), groups_done=groups_done)

    async def on_finish(self, fin: StepFinish) -> Ack:
        run = await self.runs.get(fin.run_id)
        if run is None:
            return Ack(ok=False, detail=f"unknown run {fin.run_id}")
        if run["step"] > fin.step:  # a retried finish after a lost reply: the rest again
            if run["step"] == fin.step + 1:
                await self.runs.after_finish(fin.run_id, fin.step, run["steps"])
                await self.redis.hset(Keys.step(fin.run_id, fin.step), "state", "finished")
            return Ack(detail="already recorded")
        if run["state"] != "running" or run["step"] != fin.step:
            return Ack(ok=False, detail=f"run is {run['state']} at step {run['step']}")
        digest = await self._barrier_digest(fin.run_id, fin.step)
        if digest is None or digest != fin.digest:
            # The trainer trained on something other than the barrier's data: invariant 3.
            # No longer active before it is failed: a resume of it may follow at once, and
            # must find it only in the queue, never still active (it would run twice).
            await self.runs.clear_active(fin.run_id)
            await self.runs.set_state(fin.run_id, "failed", "barrier digest mismatch")
            return Ack(ok=False, detail="digest does not match the barrier's")
        samples = await self.ledger.done_samples(fin.run_id, fin.step)
        rewards = {(r.prompt_index, r.sample_index): r.reward for r in fin.rewards}
        _add_text(samples, fin)
        for s in samples:
            s.reward = rewards.get((s.prompt_index, s.sample_index))
        info = await self.redis.hgetall(Keys.step(fin.run_id, fin.step))
        now = time.time()
        started = float(info["started_at"])
        await self._observe_seeding(fin, info, now)
        values = [r for r in rewards.values()]
        record = {
            "step": fin.step, "weight_version": int(info["version"]),
            "new_weight_version": fin.new_version, "responses": digest.responses,
            "tokens": digest.tokens,
            "reward_mean": sum(values) / len(values) if values else 0.0,
            "step_s": now - started, "started_at": started, "finished_at": now,
            "rollout_s": float(info.get("rollout_done_at", now)) - started,
            "train_s": fin.train_s, "trainer_idle_s": fin.trainer_idle_s,
            "publish_s": fin.publish_s,
            # After the barrier the rollout side waits for the optimizer step and new weights.
            "rollout_idle_s": max(0.0, now - float(info.get("rollout_done_at", now))),
            "seeding_window_s": float(info.get("window_s", 0.0)),
            "seeding_mode": info.get("mode", "off"),
            "tokens_reserved": int(info.get("tokens_reserved", 0)),
            "tokens_spot": int(info.get("tokens_spot", 0)), "loss": fin.loss,
            "instances": len(await self.registry.instances()),
            **{k: int(info.get(k, 0)) for k in LIVE_COUNTERS},
            # The trainer's statistics: only known names, never over a field of the above.
            **{k: v for k, v in fin.stats.items() if k in STEP_STATS and math.isfinite(v)},
            "reward_errors": fin.reward_errors,
        }
        if info.get("dynamic") == "1":  # what dynamic sampling generated, kept and threw away
            record.update({k: int(info.get(k, 0)) for k in DYNAMIC_FIELDS},
                          prompts_generated=int(info.get("prompts", 0)))
        if fin.eval_reward_mean is not None:
            record["eval_reward_mean"] = fin.eval_reward_mean
            record["eval_responses"] = fin.eval_responses
        if fin.reward_errors:
            self.metrics.reward_errors.inc(fin.reward_errors)
        await self.runs.finish_step(fin.run_id, fin.step, record,
                                    msgspec.json.encode(samples).decode(), run["steps"],
                                    fin.checkpoints)
        await self.redis.hset(Keys.step(fin.run_id, fin.step), "state", "finished")
        self.metrics.steps.inc()
        self.metrics.step_seconds.observe(record["step_s"])
        log.info("step %d of %s finished: reward %.3f, %.2fs", fin.step, fin.run_id,
                 record["reward_mean"], record["step_s"])
        self.soft.wake.set()
        return Ack()

    async def _observe_seeding(self, fin: StepFinish, info: dict[str, str], now: float) -> None:
        started = float(info["started_at"])
        done = float(info.get("rollout_done_at", now))
        spot_first = float(info.get("spot_first_at", done))
        everyone = await self.registry.instances()
        spot = [i for i in everyone if i["kind"] == "spot"]
        # The span the reserved side generated over: its window, ended early by the barrier;
        # or, never handed off (no spot instance was there to take its work), until its last
        # token. Taking the window for it then read a warm-up step without spot (every
        # token reserved, 1 s window) as 122,377 tok/s, about 9x the truth; and the whole
        # rollout read one whose spot instances came late and took the rest as 96 tok/s,
        # about 60x too low (bench-sim-check, (b)).
        handed_off = info.get("reserved_free") == "1"
        last = float(info.get("reserved_last_at", done))
        window = min(float(info.get("window_s", 0.0)) if handed_off else last - started,
                     done - started)
        state = await self._seeding(fin.run_id)
        observe(state, {
            "tokens": fin.digest.tokens, "tokens_reserved": int(info.get("tokens_reserved", 0)),
            "tokens_spot": int(info.get("tokens_spot", 0)), "window_s": window,
            "train_s": fin.train_s, "spot_ready_s": spot_first - started,
            "spot_busy_s": done - spot_first, "spot_count": len(spot),
            "reserved_count": sum(1 for i in everyone if i["kind"] == "reserved"),
            "publish_s": fin.publish_s,
            "spot_joined": [float(i["joined_at"]) - started for i in spot],
        })
        await self.redis.hset(Keys.seeding(fin.run_id), mapping=state.dump())
        log.info("seeding after step %d of %s: reserved %.0f tok/s, spot %.0f tok/s each, "
                 "spot ready %.2fs, training %.2e s/token, feedback scale %.3f", fin.step,
                 fin.run_id, state.reserved_rate, state.spot_rate_each, state.spot_ready_s,
                 state.train_s_per_token, state.scale)

    async def on_record(self, query: StepRecordQuery) -> StepRecord:
        """A finished step's record, for the trainer's experiment trackers."""
        records = await self.runs.step_records(query.run_id, query.step, query.step)
        found = records[0] if records and records[0].get("step") == query.step else None
        return StepRecord(run_id=query.run_id, step=query.step, record=found)

    async def on_warning(self, msg: RunWarning) -> Ack:
        await self.runs.warn(msg.run_id, msg.warning)
        return Ack()

    async def on_run_failed(self, msg: RunFailed) -> Ack:
        await self.runs.clear_active(msg.run_id)  # before it is failed: see on_finish
        await self.runs.set_state(msg.run_id, "failed", msg.error[:2000])
        return Ack()


def _add_text(samples: list[Sample], fin: StepFinish) -> None:
    """The report's prompt and response texts onto the samples the samples endpoint serves."""
    prompts = {p.prompt_index: p for p in fin.prompts}
    texts = {(r.prompt_index, r.sample_index): r.response_text for r in fin.rewards}
    for s in samples:
        p = prompts.get(s.prompt_index)
        if p is not None:
            s.prompt, s.prompt_text, s.answer = p.prompt, p.prompt_text, p.answer
        s.response_text = texts.get((s.prompt_index, s.sample_index))
