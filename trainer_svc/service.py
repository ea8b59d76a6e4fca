"""The trainer: the RL loop of one run, one step at a time, on the reserved side.

Contract (one step n, weight version n), as :meth:`TrainerService.train_step` reads top to
bottom:
  1. send the step's prompts (drawn from the run seed) to the manager;
  2. as each group (all samples of one prompt) completes, score it and accumulate its gradients;
  3. at the manager's barrier, check its digest against exactly what was trained on;
  4. take the optimizer step, checkpoint to the data dir, publish version n+1 to the weight
     service, report the step.
How groups and the barrier are waited for is :mod:`trainer_svc.step_feed`; each request to the
manager, with its timeout and retries, is :mod:`trainer_svc.manager_client`.
A trainer killed at any point and restarted resumes from its last checkpoint: a step whose
optimizer step was taken is reported again (the manager treats that as idempotent), a step
that was not is re-trained from the manager's committed samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from shared import names
from shared.algorithm import OffPolicy
from shared.bus import connect_nats
from shared.config import TrainerConfig
from shared.digest import sample_digest
from shared.errors import RlboostError
from shared.metrics import serve_metrics
from shared.process import cancel_and_wait
from shared.protocol import (
    STEP_STATS,
    Digest,
    PromptText,
    Sample,
    SampleReward,
    StepClose,
    StepExtend,
    StepFinish,
    StepStart,
)
from shared.settings import reveal
from shared.spec import RunSpec
from shared.turns import TurnsError, loss_mask
from shared.weights import upload_adapter_version, upload_version
from trainer_svc.agentic import Tools, open_tools
from trainer_svc.dynamic_sampling import Close, Extend, GroupFilter
from trainer_svc.errors import GroupLost, RunAborted
from trainer_svc.learn.policies import Policy, PublishesItself, WeightsAccess, make_policy
from trainer_svc.learn.step_trainer import Group
from trainer_svc.manager_client import ManagerClient
from trainer_svc.saved import keep_saved
from trainer_svc.step_feed import StepEvents, StepFeed
from trainer_svc.trackers import Trackers
from trainer_svc.workload import EvalResult, StepPrompt, Workload, open_workload

LORA_BASE_VERSION = 0  # a LoRA run's full version: the base its adapter versions name
log = logging.getLogger("trainer")


def training_group(samples: list[Sample], behaviour: bool = False) -> Group:
    """A scored group's samples as the policy trains them, in sample order, with their loss
    masks from their turns (:mod:`shared.turns`; None when no token is masked: a single-turn
    group trains exactly as before turns existed), and with ``behaviour`` (a run with an
    off-policy correction) their behaviour log-probs. Bad turns fail the run, naming the
    sample."""
    masks = []
    for s in samples:
        try:
            masks.append(loss_mask(s.turns, len(s.response_token_ids), s.loss_mask))
        except TurnsError as exc:
            raise TurnsError(f"sample {s.request_id}: {exc}") from exc
    return Group(prompt_index=samples[0].prompt_index,
                 prompts=[s.prompt_token_ids for s in samples],
                 responses=[s.response_token_ids for s in samples],
                 rewards=[float(s.reward or 0.0) for s in samples],
                 truncated=[s.finish_reason == "length" for s in samples],
                 loss_masks=masks if any(0 in m for m in masks) else None,
                 behaviour=[s.behaviour_logprobs for s in samples] if behaviour else None)


@dataclass
class ActiveTraining:
    run_id: str
    spec: RunSpec
    policy: Policy
    workload: Workload  # the step's prompts and how responses score
    version: int  # the checkpoint's weight version: the step it can train next
    trained: dict[int, list[Sample]] = field(default_factory=dict)  # this step's, by prompt
    texts: dict[int, list[str | None]] = field(default_factory=dict)  # responses, by prompt
    reward_errors: int = 0  # this step's failed reward calls
    prompts: list[StepPrompt] = field(default_factory=list)  # this step's
    trackers: Trackers = field(default_factory=lambda: Trackers({}))
    tools: Tools | None = None  # an agentic run's environment pool (trainer_svc.agentic)

    step: int = 0  # the step in progress
    scored: dict[int, list[Sample]] = field(default_factory=dict)  # dynamic sampling: by prompt
    ready: list[int] = field(default_factory=list)  # kept, scored, not yet trained, in order

    def begin_step(self, step: int, prompts: list[StepPrompt]) -> None:
        self.trained, self.texts, self.reward_errors, self.prompts = {}, {}, 0, prompts
        self.step, self.scored, self.ready = step, {}, []
        self.policy.reset()

    def release(self, n: int) -> list[list[Sample]]:
        """The first ``n`` ready groups, to train now."""
        out, self.ready = self.ready[:n], self.ready[n:]
        return [self.scored.pop(p) for p in out]

    def trained_samples(self) -> list[Sample]:
        return [s for group in self.trained.values() for s in group]


@dataclass
class StepClock:
    """A step's time split into work (its report's ``train_s``) and waiting for rollout."""

    started: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.busy_s += time.monotonic() - t0

    def idle_s(self) -> float:
        return max(0.0, time.monotonic() - self.started - self.busy_s)


class TrainerService:
    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.active: ActiveTraining | None = None
        self.events = StepEvents()
        self._stop = asyncio.Event()
        self.registry = CollectorRegistry()
        self.steps_done = Counter("rlboost_trainer_steps_total", "Optimizer steps taken",
                                  registry=self.registry)
        self.groups_done = Counter("rlboost_trainer_groups_total", "Groups trained on",
                                   registry=self.registry)
        self.reward = Gauge("rlboost_trainer_reward_mean", "Mean reward of the last step",
                            registry=self.registry)
        self.reward_errors = Counter("rlboost_trainer_reward_errors_total", "Reward calls that "
                                     "raised or timed out (scored 0)", registry=self.registry)
        self.manager: ManagerClient

    async def run(self) -> None:
        common = self.cfg.common
        port = serve_metrics(self.registry, common.metrics_addr, common.metrics_port)
        log.info("metrics on %s:%d", common.metrics_addr, port)
        nc = await connect_nats(common.nats_url, self.cfg.trainer_id, tls=common.tls.client())
        self.manager = ManagerClient(nc, self.cfg.trainer_id)
        await nc.subscribe(names.group_subject("*"), cb=self.events.on_group)
        await nc.subscribe(names.barrier_subject("*"), cb=self.events.on_barrier)
        await nc.subscribe(names.handoff_subject("*"), cb=self.events.on_barrier)
        log.info("trainer %s ready: %s", self.cfg.trainer_id, self.cfg.describe())
        try:
            while not self._stop.is_set():
                await self._until_stopped(self._tick())
        finally:
            await self._leave_run(finished=False)
            with contextlib.suppress(Exception):
                await nc.close()

    async def _until_stopped(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work``; if stop() comes first, cancel it at its next await and return.

        A step cut short is redone after a restart from the manager's committed samples and the
        last checkpoint, just as after a crash (tests/system/test_restart), so finishing it first
        would only delay the exit: a step on a real model outlasts any orchestrator's stop grace,
        and the SIGKILL that follows would cut it anyway. Work already handed to a thread (a group's
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
            work = await self.manager.active_run()
        except RlboostError as exc:
            log.info("manager not reachable yet: %s", exc)
            await asyncio.sleep(self.cfg.poll_s)
            return
        if work.run_id is None or work.spec is None:
            await self._leave_run(finished=True)
            await asyncio.sleep(self.cfg.poll_s)
            return
        try:
            if self.active is None or self.active.run_id != work.run_id:
                await self._leave_run(finished=True)
                self.active = await self._setup(work.run_id, work.spec)
            await self.train_step(self.active, work.step)
        except RunAborted as exc:
            log.warning("run %s: %s", work.run_id, exc)
            await self._leave_run(finished=False)
        except GroupLost:
            raise  # not the run's fault: this process ends and torchrun restarts the group
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
        await self._leave_run(finished=False)
        await self.manager.fail(run_id, f"{type(exc).__name__}: {exc}")

    async def _setup(self, run_id: str, spec: RunSpec) -> ActiveTraining:
        common = self.cfg.common
        # Data and reward first: a spec naming a missing file or function fails in seconds,
        # not after a model build.
        workload = await open_workload(spec, common.data_dir, self.cfg.reward_dirs,
                                       self.cfg.reward_timeout_s,
                                       dataset_roots=common.dataset_dirs,
                                       reward_env=self.cfg.reward_env_names)
        try:
            try:
                policy = await asyncio.to_thread(make_policy, spec, common.data_dir,
                                                 common.data_dir / "trainer" / run_id,
                                                 common.emu_time_scale, common.emu_publish_s,
                                                 common.emu_token_scale)
            except ValueError as exc:
                raise RunAborted(str(exc)) from exc
            await asyncio.to_thread(workload.use_model, policy.checkpoints.base_dir,
                                    policy.reward)
            tools = await open_tools(spec, workload, self.cfg, self.registry)
        except BaseException:
            await workload.close()
            raise
        version = await asyncio.to_thread(policy.restore)
        trackers, warnings = await asyncio.to_thread(
            Trackers.open, list(spec.trackers), common.data_dir / "trackers" / run_id, run_id,
            msgspec.to_builtins(spec))
        for warning in warnings:
            await self.manager.warn(run_id, warning)
        run = ActiveTraining(run_id, spec, policy, workload, version, trackers=trackers,
                             tools=tools)
        await self._publish(run, version)
        log.info("run %s: model %s at version %d", run_id, spec.model, version)
        return run

    # --- one step --------------------------------------------------------------------------

    async def train_step(self, run: ActiveTraining, step: int) -> None:
        """One RL step: the algorithm, top to bottom; every wait is in the helpers it calls."""
        if run.version > step:  # crashed after the optimizer step: its report is on disk
            await self._report_again(run, step)
            return
        if run.version < step:
            raise RunAborted(f"checkpoint v{run.version} is behind the run's step {step}")
        prompts = run.workload.prompts(step)
        # The step, and in an asynchronous run the next `staleness` (started again after a
        # restart changes nothing): they roll out while this one trains.
        for ahead in range(step, min(step + run.spec.staleness, run.spec.steps - 1) + 1):
            await self.manager.start_step(StepStart(
                run_id=run.run_id, step=ahead, weight_version=run.spec.min_version(ahead),
                prompt_token_ids=[p.token_ids for p in (
                    prompts if ahead == step else run.workload.prompts(ahead))],
                eos_token_id=run.workload.eos_token_id, vocab_size=run.policy.vocab_size))
        clock = StepClock()
        run.begin_step(step, prompts)
        evaluated = await self._evaluate(run, step, clock)
        feed = StepFeed(self.manager, self.events, run.run_id, step, self.cfg.poll_s,
                        dynamic=bool(run.spec.dynamic_sampling))
        kept = GroupFilter(run.spec.prompts_per_step, run.spec.max_prompts,
                           run.spec.prompts_per_step) if run.spec.dynamic_sampling else None
        async with self._answering(run, step, prompts):
            async for prompt_index, group in feed.groups():  # as they complete, then the rest
                with clock.busy():
                    if kept is None:
                        await self._train_group(run, await self._score_group(
                            run, prompt_index, group))
                    else:
                        await self._filter_group(run, step, kept, feed, prompt_index, group)
        with clock.busy():
            for group in run.release(len(run.ready)):  # kept, deferred while rollout shared GPUs
                await self._train_group(run, group)
        trained = self._check_barrier(run, feed.digest)
        with clock.busy():
            stats = await asyncio.to_thread(run.policy.step, step)  # the optimizer step
            report = self._step_report(run, step, trained, stats, evaluated)
            # Publishing starts with writing the version (safetensors, hashing: the policy's
            # save); the seeding controller takes this span out of the training it can
            # overlap, so leaving the write out of it made every window too short (in
            # bench-paper's emulation the adaptive window read 0 s with an 11.3 s publish).
            published = time.monotonic()
            await self._checkpoint(run, report)
            await self._publish(run, report.new_version)
            report.checkpoints = await self._keep(run, report.new_version)
            report.publish_s = time.monotonic() - published
        report.train_s, report.trainer_idle_s = clock.busy_s, clock.idle_s()
        run.policy.checkpoints.save_finish(report)  # again, with its timings
        await self._report(report)
        await self._track(run, step)

    # --- its parts -------------------------------------------------------------------------

    def _answering(self, run: ActiveTraining, step: int,
                   prompts: list[StepPrompt]) -> contextlib.AbstractAsyncContextManager[Any]:
        """An agentic run's tool loop for the step's rollout (trainer_svc.agentic)."""
        if run.tools is None:
            return contextlib.nullcontext()
        return run.tools.answering(self.manager, run.run_id, step, prompts, self.cfg.poll_s)

    async def _score_group(self, run: ActiveTraining, prompt_index: int,
                           group: list[Sample]) -> list[Sample]:
        """The group in sample order, each sample's reward filled in."""
        group = sorted(group, key=lambda s: s.sample_index)
        if prompt_index >= len(run.prompts):  # dynamic sampling's extra prompts, redrawn
            run.prompts = run.workload.prompts(run.step, prompt_index + 1)
        scored = await run.workload.score(run.prompts[prompt_index],
                                          [s.response_token_ids for s in group])
        for s, reward in zip(group, scored.rewards, strict=True):
            # An agentic response's environment's reward, where it gave one, is its score.
            s.reward = reward if s.env_reward is None else s.env_reward
        run.texts[prompt_index] = scored.texts
        run.reward_errors += scored.errors
        self.reward_errors.inc(scored.errors)
        return group

    async def _filter_group(self, run: ActiveTraining, step: int, kept: GroupFilter,
                            feed: StepFeed, prompt_index: int, group: list[Sample]) -> None:
        """Dynamic sampling: score the group, keep it only if it is informative and among the
        step's lowest ``prompts_per_step`` such (trainer_svc.dynamic_sampling), and extend or
        close the step when that decides it. Kept groups train once rollout leaves the GPUs."""
        group = await self._score_group(run, prompt_index, group)
        run.scored[prompt_index] = group
        if feed.digest is not None:  # past the barrier: the manager holds only kept groups
            run.ready.append(prompt_index)
        else:
            kept.sync(feed.prompts)
            kept.add(prompt_index, [float(s.reward or 0.0) for s in group])
            run.ready += kept.release()
            action = kept.action()
            if isinstance(action, Extend):
                stop = action.first + action.count
                run.prompts = run.workload.prompts(step, stop)
                await self.manager.extend_step(StepExtend(
                    run_id=run.run_id, step=step, first_index=action.first,
                    prompt_token_ids=[p.token_ids for p in run.prompts[action.first:stop]]))
                kept.sync(stop)
            elif isinstance(action, Close):
                await self.manager.close_step(StepClose(
                    run_id=run.run_id, step=step, keep=action.keep, filtered=action.filtered,
                    capped=action.capped))
                if action.capped:
                    await self.manager.warn(run.run_id, (
                        f"step {step}: {len(action.keep)} of {run.spec.prompts_per_step} groups "
                        f"informative after {kept.prompts} prompts (max_gen_batches "
                        f"{run.spec.max_gen_batches}); trained on those"))
        if feed.train_now:
            for ready in run.release(len(run.ready)):
                await self._train_group(run, ready)

    async def _train_group(self, run: ActiveTraining, group: list[Sample]) -> None:
        """Accumulate one scored group's gradients (advantages are relative within it)."""
        prompt_index = group[0].prompt_index
        low = run.spec.min_version(run.step)
        for s in group:  # invariant 2, bounded: every token from a version in [step - k, step]
            made = [v for _, v in s.token_versions] or [s.weight_version]
            if not all(low <= v <= run.step for v in made):
                raise RunAborted(f"sample {s.request_id} has tokens of versions {made}, "
                                 f"outside [{low}, {run.step}]: not trained")
        corrects = run.spec.algorithm_config().off_policy is not OffPolicy.NONE
        await asyncio.to_thread(run.policy.add_group, training_group(group, corrects))
        run.trained[prompt_index] = group
        self.groups_done.inc()

    @staticmethod
    def _check_barrier(run: ActiveTraining, digest: Digest | None) -> list[Sample]:
        """Invariant 3: the barrier's digest is that of exactly the samples trained on."""
        trained = run.trained_samples()
        if sample_digest(trained) != digest:
            raise RuntimeError("barrier digest differs from the samples trained on")
        return trained

    async def _evaluate(self, run: ActiveTraining, step: int,
                        clock: StepClock) -> EvalResult | None:
        """Held-out prompts on version ``step``, when due; overlaps the step's rollout."""
        if not run.workload.eval_due(step):
            return None
        with clock.busy():
            result = await run.workload.evaluate(step, run.policy.checkpoints.hf_dir(step))
        self.reward_errors.inc(result.errors)
        return result

    @staticmethod
    def _step_report(run: ActiveTraining, step: int, trained: list[Sample],
                     stats: dict[str, Any], evaluated: EvalResult | None) -> StepFinish:
        rewards = [SampleReward(prompt_index=s.prompt_index, sample_index=s.sample_index,
                                reward=float(s.reward or 0.0),
                                response_text=run.texts[s.prompt_index][s.sample_index])
                   for s in trained]
        texts = [PromptText(prompt_index=i, prompt=run.prompts[i].prompt,
                            prompt_text=run.prompts[i].prompt_text, answer=run.prompts[i].answer)
                 for i in sorted(run.trained)]
        return StepFinish(
            run_id=run.run_id, step=step, new_version=step + 1, digest=sample_digest(trained),
            rewards=rewards, loss=float(stats.get("loss", 0.0)), train_s=0.0, prompts=texts,
            stats={k: float(v) for k, v in stats.items() if k in STEP_STATS},
            reward_errors=run.reward_errors + (evaluated.errors if evaluated else 0),
            eval_reward_mean=evaluated.reward_mean if evaluated else None,
            eval_responses=evaluated.responses if evaluated else 0,
        )

    async def _checkpoint(self, run: ActiveTraining, report: StepFinish) -> None:
        # The report goes to disk before the checkpoint: a checkpoint always has its report.
        run.policy.checkpoints.save_finish(report)
        await asyncio.to_thread(run.policy.save, report.new_version)
        run.version = report.new_version

    async def _publish(self, run: ActiveTraining, version: int) -> None:
        url, token = self.cfg.common.weights_url, reveal(self.cfg.common.weights_token)
        hf_dir = run.policy.checkpoints.hf_dir(version)
        if run.spec.lora is not None and version > LORA_BASE_VERSION:
            # The base went out whole as version 0; every later version is its adapter alone
            # (docs/weights.md "LoRA versions"), a few percent of the model's bytes. Every
            # trainer writes the adapter's files here, the sharded one from rank 0 (this
            # process), so no other rank takes part.
            await upload_adapter_version(url, token, run.run_id, version, hf_dir,
                                         LORA_BASE_VERSION, tls=self.cfg.common.tls)
            return
        if isinstance(run.policy, PublishesItself):  # sharded: every rank sends its own files
            access = WeightsAccess(str(url), token, self.cfg.common.tls)
            await run.policy.publish(access, run.run_id, version)
            return
        await upload_version(url, token, run.run_id, version, hf_dir, tls=self.cfg.common.tls)

    async def _keep(self, run: ActiveTraining, version: int) -> list[int]:
        """Pin the versions the spec keeps for the user (trainer_svc.saved)."""
        return await keep_saved(self.cfg.common.weights_url,
                                reveal(self.cfg.common.weights_token), run.run_id, run.spec,
                                version, self.cfg.common.tls)

    async def _report_again(self, run: ActiveTraining, step: int) -> None:
        saved = run.policy.checkpoints.load_finish(step)
        if saved is None:
            raise RunAborted(f"checkpoint is at v{run.version} but step {step} has no report")
        await self._publish(run, run.version)
        saved.checkpoints = await self._keep(run, run.version)  # it may have stopped mid-way
        await self._report(saved)
        await self._track(run, step)

    async def _track(self, run: ActiveTraining, step: int) -> None:
        """Log the step's record, as the manager finished it, to the run's trackers."""
        if not run.trackers.sinks:
            return
        try:
            record = await self.manager.step_record(run.run_id, step)
        except RlboostError as exc:  # the step is reported; only its tracker entry is lost
            log.warning("step %d: no record for the trackers (%s)", step, exc)
            return
        if record is None:
            return  # the manager no longer has it (the run was cancelled meanwhile)
        for warning in await asyncio.to_thread(run.trackers.log, step, record):
            await self.manager.warn(run.run_id, warning)

    async def _leave_run(self, finished: bool) -> None:
        """Forget the active run; its trackers are flushed and closed."""
        if self.active is not None:
            await asyncio.to_thread(self.active.trackers.close, finished)
            await self.active.workload.close()
            if self.active.tools is not None:
                await self.active.tools.close()
        self.active = None

    async def _report(self, report: StepFinish) -> None:
        await self.manager.finish(report)
        rewards = [r.reward for r in report.rewards]
        mean = sum(rewards) / max(1, len(rewards))
        self.steps_done.inc()
        self.reward.set(mean)
        log.info("step %d done: reward %.3f, loss %.4f", report.step, mean, report.loss)
