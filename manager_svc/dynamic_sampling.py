"""Dynamic sampling (DAPO) on the manager's side: a step grows, then the trainer closes it.

Contract: the manager never sees rewards, so the trainer decides. A step of a run with
``dynamic_sampling`` is created holding one extra count in its ``remaining`` field, so
completing every response it has is not its barrier. The trainer then

* extends it (:meth:`DynamicSteps.on_extend`) with prompts beyond ``prompts_per_step``, drawn
  from the run seed, while it is short of informative groups: one atomic script adds the
  responses and counts (``lua/extend_step.lua``), applied once however often it is retried, and
  refused past ``max_gen_batches * prompts_per_step`` prompts;
* closes it (:meth:`DynamicSteps.on_close`) naming the groups it trains on: one atomic script
  (``lua/close_step.lua``) moves every other response to the step's dropped set, aborting those
  in flight (a new lease epoch fences their owners), counts their tokens (``tokens_discarded``,
  ``tokens_filtered``) and releases the hold; the barrier follows, its digest over exactly the
  kept groups. The owners of aborted responses are told to stop; a message lost with a manager
  killed after the script is made up for by their next heartbeat, whose renewal of the aborted
  lease fails. Late chunks of aborted responses are counted as discarded by ``commit.lua``.

A manager killed before either script leaves the step as it was, and the trainer's retry
applies it; killed after, the retry is acknowledged and changes nothing, and the dispatcher
raises the barrier of a closed step whose barrier was never announced (its ``remaining`` is 0).
"""

from __future__ import annotations

import logging
from collections import defaultdict

from nats.aio.client import Client as Nats

from manager_svc.accounting import Ledger, StepRefused
from manager_svc.ingest import ChunkIngest
from manager_svc.metrics import ManagerMetrics
from manager_svc.registry import assign_subjects
from manager_svc.runs import RunStore
from manager_svc.soft_state import SoftState
from shared.protocol import Ack, Revoke, StepClose, StepExtend, encode

log = logging.getLogger("manager")


class DynamicSteps:
    def __init__(self, nc: Nats, ledger: Ledger, runs: RunStore, ingest: ChunkIngest,
                 metrics: ManagerMetrics, soft: SoftState) -> None:
        self.nc = nc
        self.ledger = ledger
        self.runs = runs
        self.ingest = ingest
        self.metrics = metrics
        self.soft = soft

    async def _check(self, run_id: str, step: int) -> tuple[Ack | None, int, int, int]:
        """(refusal or None, samples per prompt, max_new_tokens, max prompts) of a step the
        trainer may change now."""
        run, spec = await self.runs.get(run_id), await self.runs.spec(run_id)
        if run is None or spec is None or run["state"] != "running" or run["step"] != step:
            return Ack(ok=False, detail=f"run {run_id} is not running step {step}"), 0, 0, 0
        if not spec.dynamic_sampling:
            return Ack(ok=False, detail="the run does not use dynamic_sampling"), 0, 0, 0
        return None, spec.samples_per_prompt, spec.max_new_tokens, spec.max_prompts

    async def on_extend(self, msg: StepExtend) -> Ack:
        refused, samples, max_new, max_prompts = await self._check(msg.run_id, msg.step)
        if refused is not None:
            return refused
        try:
            count = await self.ledger.extend_step(msg.run_id, msg.step, msg.first_index,
                                                  msg.prompt_token_ids, samples, max_new,
                                                  max_prompts)
        except StepRefused as exc:
            # Retryable: the trainer re-reads the step's prompt count and decides again.
            return Ack(ok=False, detail=str(exc), retryable=True)
        log.info("step %d of %s extended to %d prompts", msg.step, msg.run_id, count)
        self.soft.wake.set()  # new pending work for the dispatcher
        return Ack()

    async def on_close(self, msg: StepClose) -> Ack:
        refused, _, _, _ = await self._check(msg.run_id, msg.step)
        if refused is not None:
            return refused
        try:
            discarded, aborted = await self.ledger.close_step(
                msg.run_id, msg.step, msg.keep, msg.filtered, msg.capped)
        except StepRefused as exc:
            return Ack(ok=False, detail=str(exc), retryable=True)
        self.metrics.discarded.inc(discarded)
        by_owner: dict[str, list[str]] = defaultdict(list)
        for owner, rid in aborted:
            by_owner[owner].append(rid)
        subjects = await assign_subjects(self.ledger.r, list(by_owner))
        for subject, rids in zip(subjects, by_owner.values(), strict=True):
            self.metrics.revocations.labels("dynamic_sampling").inc(len(rids))
            await self.nc.publish(subject, encode(Revoke(request_ids=rids)))
        log.info("step %d of %s closed: %d groups kept, %d filtered, %d responses aborted "
                 "(%d tokens discarded)%s", msg.step, msg.run_id, len(msg.keep),
                 len(msg.filtered), len(aborted), discarded,
                 "; max_gen_batches reached" if msg.capped else "")
        await self.ingest.barrier(msg.run_id, msg.step)
        return Ack()
