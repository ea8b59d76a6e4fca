"""The trainer: the RL loop of one run, one step at a time, on the reserved side.

Contract (one step n, weight version n):
  1. send the step's prompts (drawn from the run seed) to the manager;
  2. as each group (all samples of one prompt) completes, score it and accumulate its gradients;
  3. wait for the manager's barrier, check its digest against exactly what was trained on;
  4. take the optimizer step, checkpoint to the data dir, publish version n+1 to the weight
     service, report the step.
A trainer killed at any point and restarted resumes from its last checkpoint: a step whose
optimizer step was taken is reported again (the manager treats that as idempotent), a step
that was not is re-trained from the manager's committed samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as Nats
from nats.aio.msg import Msg as NatsMsg
from prometheus_client import CollectorRegistry, Counter, Gauge

from shared import names
from shared.bus import connect_nats, request
from shared.config import TrainerConfig
from shared.errors import PeerError, PeerTimeout, ProtocolError, RlboostError
from shared.metrics import serve_metrics
from shared.process import cancel_and_wait
from shared.protocol import (
    Ack,
    ActiveRun,
    GroupDone,
    RunFailed,
    RunSpec,
    Sample,
    SampleReward,
    StepFinish,
    StepSamples,
    StepSamplesQuery,
    StepStart,
    TrainerPoll,
    decode,
    sample_digest,
)
from shared.settings import reveal
from shared.weights import upload_version
from trainer_svc import task
from trainer_svc.policies import Policy, make_policy

log = logging.getLogger("trainer")


class RunAborted(RlboostError):
    """The run was cancelled or failed elsewhere; drop it and poll again."""


@dataclass
class ActiveTraining:
    run_id: str
    spec: RunSpec
    policy: Policy
    version: int
    trained: dict[int, list[Sample]] = field(default_factory=dict)


class TrainerService:
    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.active: ActiveTraining | None = None
        self._events: asyncio.Queue[GroupDone] = asyncio.Queue()
        self._barrier = asyncio.Event()  # a barrier was announced: ask for the samples now
        self._stop = asyncio.Event()
        self.registry = CollectorRegistry()
        self.steps_done = Counter("rlboost_trainer_steps_total", "Optimizer steps taken",
                                  registry=self.registry)
        self.groups_done = Counter("rlboost_trainer_groups_total", "Groups trained on",
                                   registry=self.registry)
        self.reward = Gauge("rlboost_trainer_reward_mean", "Mean reward of the last step",
                            registry=self.registry)
        self.nc: Nats

    async def run(self) -> None:
        common = self.cfg.common
        port = serve_metrics(self.registry, common.metrics_addr, common.metrics_port)
        log.info("metrics on %s:%d", common.metrics_addr, port)
        self.nc = await connect_nats(common.nats_url, self.cfg.trainer_id)
        await self.nc.subscribe(names.group_subject("*"), cb=self._on_group)
        await self.nc.subscribe(names.barrier_subject("*"), cb=self._on_barrier)
        await self.nc.subscribe(names.handoff_subject("*"), cb=self._on_barrier)
        log.info("trainer %s ready: %s", self.cfg.trainer_id, self.cfg.describe())
        try:
            while not self._stop.is_set():
                await self._until_stopped(self._tick())
        finally:
            with contextlib.suppress(Exception):
                await self.nc.close()

    async def _until_stopped(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work``; if stop() comes first, cancel it at its next await and return.

        A step cut short is redone after a restart from the manager's committed samples and the
        last checkpoint, just as after a crash (tests/test_restart), so finishing it first would
        only delay the exit: a step on a real model outlasts any orchestrator's stop grace, and
        the SIGKILL that follows would cut it anyway. Work already handed to a thread (a group's
        backward pass, a checkpoint write) completes before the process exits."""
        task = asyncio.create_task(work)
        stopping = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        cut = not task.done()
        if cut:
            log.info("stopping mid-step; a restarted trainer redoes the step")
            await cancel_and_wait(task)
        if not (cut and task.cancelled()):
            task.result()  # an unexpected error (or cancel) still ends the service, as before

    def stop(self) -> None:
        self._stop.set()

    async def _tick(self) -> None:
        try:
            work = await request(self.nc, names.TRAINER_POLL,
                                 TrainerPoll(trainer_id=self.cfg.trainer_id), ActiveRun, 3.0)
        except RlboostError as exc:
            log.info("manager not reachable yet: %s", exc)
            await asyncio.sleep(self.cfg.poll_s)
            return
        if work.run_id is None or work.spec is None:
            self.active = None
            await asyncio.sleep(self.cfg.poll_s)
            return
        try:
            if self.active is None or self.active.run_id != work.run_id:
                self.active = await self._setup(work.run_id, work.spec)
            await self._train_step(self.active, work.step)
        except RunAborted as exc:
            log.warning("run %s: %s", work.run_id, exc)
            self.active = None
        except RlboostError as exc:
            if not exc.retryable:
                await self._fail(work.run_id, exc)
                return
            # The bus or the state store is restarting: the step is redone from the manager's
            # committed samples, which nothing here can lose.
            log.warning("run %s: %s; retrying the step", work.run_id, exc)
            await asyncio.sleep(self.cfg.poll_s)
        except Exception as exc:
            await self._fail(work.run_id, exc)

    async def _fail(self, run_id: str, exc: Exception) -> None:
        log.error("run %s failed: %r", run_id, exc, exc_info=exc)
        self.active = None
        with contextlib.suppress(RlboostError):
            await request(self.nc, names.TRAINER_FAIL,
                          RunFailed(run_id=run_id, error=f"{type(exc).__name__}: {exc}"), Ack, 3.0)

    async def _on_group(self, msg: NatsMsg) -> None:
        try:
            await self._events.put(decode(msg.data, GroupDone))
        except ProtocolError as exc:
            log.warning("dropped %s", exc)

    async def _on_barrier(self, _: NatsMsg) -> None:
        """A barrier or a seeding hand-off: ask the manager for the step's state right away."""
        self._barrier.set()
        # Wake the step loop, which waits on the group queue.
        await self._events.put(GroupDone(run_id="", step=-1, prompt_index=-1, samples=[]))

    async def _all_samples(self, run_id: str, step: int, total: int) -> list[Sample]:
        """The step's samples after its barrier, page by page (no message may exceed NATS's
        payload limit); once the barrier is reached the set no longer changes."""
        samples: list[Sample] = []
        while len(samples) < total:
            page = await request(self.nc, names.TRAINER_SAMPLES, StepSamplesQuery(
                run_id=run_id, step=step, offset=len(samples), limit=512), StepSamples, 10.0)
            if not page.samples:
                raise RuntimeError(f"samples of step {step} ended at {len(samples)} of {total}")
            samples += page.samples
        return samples

    # --- run set-up ------------------------------------------------------------------------

    async def _setup(self, run_id: str, spec: RunSpec) -> ActiveTraining:
        common = self.cfg.common
        try:
            policy = await asyncio.to_thread(make_policy, spec, common.data_dir,
                                             common.data_dir / "trainer" / run_id,
                                             common.emu_time_scale)
        except ValueError as exc:
            raise RunAborted(str(exc)) from exc
        version = await asyncio.to_thread(policy.restore)
        run = ActiveTraining(run_id, spec, policy, version)
        await self._publish(run, version)
        log.info("run %s: model %s at version %d", run_id, spec.model, version)
        return run

    async def _publish(self, run: ActiveTraining, version: int) -> None:
        await upload_version(self.cfg.common.weights_url, reveal(self.cfg.common.weights_token),
                             run.run_id, version, run.policy.checkpoints.hf_dir(version))

    # --- one step --------------------------------------------------------------------------

    async def _train_step(self, run: ActiveTraining, step: int) -> None:
        if run.version > step:
            # Crashed after the optimizer step: the report is on disk; send it again.
            saved = run.policy.checkpoints.load_finish(step)
            if saved is None:
                raise RunAborted(f"checkpoint is at v{run.version} but step {step} has no report")
            await self._publish(run, run.version)
            await self._finish(saved)
            return
        if run.version < step:
            raise RunAborted(f"checkpoint v{run.version} is behind the run's step {step}")
        prompts = task.make_prompts(run.spec.seed, step, run.spec.prompts_per_step)
        ack = await request(self.nc, names.TRAINER_START, StepStart(
            run_id=run.run_id, step=step, weight_version=step, prompt_token_ids=prompts,
            eos_token_id=run.policy.eos_id), Ack, 5.0)
        if not ack.ok:
            if ack.retryable:
                raise PeerError(names.TRAINER_START, ack.detail, True)
            raise RunAborted(ack.detail)
        started = time.monotonic()
        busy = 0.0
        run.trained = {}
        run.policy.reset()
        last_poll = 0.0
        # Groups that completed while the reserved side was still generating (seeding window):
        # training starts only once it has stopped, since both share the reserved GPUs.
        waiting: list[GroupDone] = []
        train_now = False
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel (see
            # shared.process.wait_event) and a stopping trainer would go on polling.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.poll_s / 4):
                    event = await self._events.get()
                # A group too large for one message comes without samples: it is trained
                # from the paged samples at the barrier.
                if event.run_id == run.run_id and event.step == step and event.samples:
                    waiting.append(event)
            if train_now:
                for done in waiting:
                    busy += await self._train_group(run, done.prompt_index, done.samples)
                waiting.clear()
            if time.monotonic() - last_poll < self.cfg.poll_s and not self._barrier.is_set():
                continue
            last_poll = time.monotonic()
            self._barrier.clear()
            state = await request(self.nc, names.TRAINER_SAMPLES,
                                  StepSamplesQuery(run_id=run.run_id, step=step), StepSamples, 10.0)
            train_now = state.train_now
            if not state.complete:
                continue
            by_group: dict[int, list[Sample]] = {}
            for s in await self._all_samples(run.run_id, step, state.done):
                by_group.setdefault(s.prompt_index, []).append(s)
            for prompt_index, group in sorted(by_group.items()):
                if prompt_index not in run.trained:
                    busy += await self._train_group(run, prompt_index, group)
            trained = [s for g in run.trained.values() for s in g]
            if sample_digest(trained) != state.digest:
                raise RuntimeError("barrier digest differs from the samples trained on")
            break
        t0 = time.monotonic()
        stats = await asyncio.to_thread(run.policy.step, step)
        rewards = [SampleReward(prompt_index=s.prompt_index, sample_index=s.sample_index,
                                reward=float(s.reward or 0.0)) for s in trained]
        report = StepFinish(
            run_id=run.run_id, step=step, new_version=step + 1, digest=sample_digest(trained),
            rewards=rewards, loss=float(stats.get("loss", 0.0)), train_s=0.0,
        )
        # The report goes to disk before the checkpoint: a checkpoint always has its report.
        run.policy.checkpoints.save_finish(report)
        await asyncio.to_thread(run.policy.save, step + 1)
        run.version = step + 1
        await self._publish(run, step + 1)
        busy += time.monotonic() - t0
        report.train_s = busy
        report.trainer_idle_s = max(0.0, time.monotonic() - started - busy)
        run.policy.checkpoints.save_finish(report)
        await self._finish(report)

    async def _train_group(self, run: ActiveTraining, prompt_index: int,
                           group: list[Sample]) -> float:
        if prompt_index in run.trained:
            return 0.0
        t0 = time.monotonic()
        group = sorted(group, key=lambda s: s.sample_index)
        for s in group:
            s.reward = run.policy.reward(s.prompt_token_ids, s.response_token_ids)
        await asyncio.to_thread(run.policy.add_group, [s.prompt_token_ids for s in group],
                                [s.response_token_ids for s in group],
                                [float(s.reward or 0.0) for s in group])
        run.trained[prompt_index] = group
        self.groups_done.inc()
        return time.monotonic() - t0

    async def _finish(self, report: StepFinish) -> None:
        for _ in range(10):
            try:
                ack = await request(self.nc, names.TRAINER_FINISH, report, Ack, 5.0)
            except RlboostError as exc:
                if not exc.retryable:
                    raise
                log.warning("step report not acknowledged (%s); retrying", exc)
                await asyncio.sleep(0.5)
                continue
            if not ack.ok:
                if ack.retryable:
                    await asyncio.sleep(0.5)
                    continue
                raise RunAborted(ack.detail)
            rewards = [r.reward for r in report.rewards]
            self.steps_done.inc()
            self.reward.set(sum(rewards) / max(1, len(rewards)))
            log.info("step %d done: reward %.3f, loss %.4f", report.step,
                     sum(rewards) / max(1, len(rewards)), report.loss)
            return
        raise PeerTimeout(names.TRAINER_FINISH, 5.0)

