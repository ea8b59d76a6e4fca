"""The trainer's requests to the manager, each with its timeout and what a refusal means.

Contract: every method is one request/reply on the bus (``shared.names.TRAINER_*``) or a short,
bounded series of them; none waits longer than its timeouts allow. A refusal the manager marks
retryable (its Redis restarting) is a retryable :class:`~shared.errors.PeerError`, so the
trainer redoes the step; any other refusal is :class:`~trainer_svc.errors.RunAborted`. Every
request is idempotent on the manager's side, which is what makes retrying them safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from nats.aio.client import Client as Nats

from shared import names
from shared.bus import request
from shared.errors import PeerError, PeerTimeout, RlboostError
from shared.protocol import (
    Ack,
    ActiveRun,
    RunFailed,
    RunWarning,
    Sample,
    StepClose,
    StepExtend,
    StepFinish,
    StepRecord,
    StepRecordQuery,
    StepSamples,
    StepSamplesQuery,
    StepStart,
    ToolCall,
    ToolCalls,
    ToolClaim,
    ToolResult,
    TrainerPoll,
)
from trainer_svc.errors import RunAborted

log = logging.getLogger("trainer")
SAMPLES_PAGE = 512  # samples asked for per page; the manager may send fewer (message budget)
FINISH_TRIES = 10  # a step report is sent this many times before the manager counts as lost
FINISH_RETRY_S = 0.5
# A status poll's reply is small and a page is at most one NATS message (1 MB): a reply lost to
# a cut link or a restarted manager is waited for this long before the step is retried, so it
# must stay under the lease TTL + grace a healed link is allowed to stall the run for.
STATUS_TIMEOUT_S = 3.0
PAGE_TIMEOUT_S = 5.0


class ManagerClient:
    def __init__(self, nc: Nats, trainer_id: str) -> None:
        self.nc = nc
        self.trainer_id = trainer_id

    async def active_run(self) -> ActiveRun:
        """The run to train now and the step it is at (``run_id`` None: nothing to do)."""
        return await request(self.nc, names.TRAINER_POLL,
                             TrainerPoll(trainer_id=self.trainer_id), ActiveRun, 3.0)

    async def start_step(self, msg: StepStart) -> None:
        """Hand the step's prompts to the manager; starting a started step is a no-op there."""
        await self._change(names.TRAINER_START, msg)

    async def extend_step(self, msg: StepExtend) -> None:
        """Dynamic sampling: add prompts to the step (applied once, however often sent)."""
        await self._change(names.TRAINER_EXTEND, msg)

    async def close_step(self, msg: StepClose) -> None:
        """Dynamic sampling: train the step on ``msg.keep``; the barrier follows."""
        await self._change(names.TRAINER_CLOSE, msg)

    async def _change(self, subject: str, msg: StepExtend | StepClose | StepStart) -> None:
        ack = await request(self.nc, subject, msg, Ack, 5.0)
        if not ack.ok:
            if ack.retryable:  # the step is redone from the manager's state
                raise PeerError(subject, ack.detail, True)
            raise RunAborted(ack.detail)

    async def claim_tools(self, claim: ToolClaim) -> list[ToolCall]:
        """Agentic runs: some of the step's awaited environment calls, each now held by this
        trainer for ``claim.claim_s`` (then handed out again if unanswered)."""
        return (await request(self.nc, names.TRAINER_TOOLS, claim, ToolCalls,
                              STATUS_TIMEOUT_S)).calls

    async def answer(self, result: ToolResult) -> Ack:
        """Agentic runs: commit one environment answer; ``detail`` is its status (``duplicate``:
        the turn was answered before, nothing changed)."""
        return await request(self.nc, names.TRAINER_ANSWER, result, Ack, STATUS_TIMEOUT_S)

    async def step_state(self, run_id: str, step: int) -> StepSamples:
        """Where the step is (samples done, may training start, the barrier's digest), without
        any samples: a status poll."""
        return await request(self.nc, names.TRAINER_SAMPLES,
                             StepSamplesQuery(run_id=run_id, step=step), StepSamples,
                             STATUS_TIMEOUT_S)

    async def samples(self, run_id: str, step: int, total: int) -> list[Sample]:
        """The step's ``total`` samples after its barrier, page by page (no message may exceed
        NATS's payload limit); once the barrier is reached the set no longer changes."""
        samples: list[Sample] = []
        while len(samples) < total:
            page = await request(self.nc, names.TRAINER_SAMPLES, StepSamplesQuery(
                run_id=run_id, step=step, offset=len(samples), limit=SAMPLES_PAGE),
                StepSamples, PAGE_TIMEOUT_S)
            if not page.samples:
                raise RuntimeError(f"samples of step {step} ended at {len(samples)} of {total}")
            samples += page.samples
        return samples

    async def finish(self, report: StepFinish) -> None:
        """Report the step, retrying while the manager cannot take it yet (it restarts, its
        Redis restarts); a report it already recorded is acknowledged again."""
        for _ in range(FINISH_TRIES):
            try:
                ack = await request(self.nc, names.TRAINER_FINISH, report, Ack, 5.0)
            except RlboostError as exc:
                if not exc.retryable:
                    raise
                log.warning("step report not acknowledged (%s); retrying", exc)
                await asyncio.sleep(FINISH_RETRY_S)
                continue
            if not ack.ok:
                if ack.retryable:
                    await asyncio.sleep(FINISH_RETRY_S)
                    continue
                raise RunAborted(ack.detail)
            return
        raise PeerTimeout(names.TRAINER_FINISH, 5.0)

    async def step_record(self, run_id: str, step: int) -> dict[str, Any] | None:
        """A finished step's record as the manager serves it (None: not recorded)."""
        reply = await request(self.nc, names.TRAINER_RECORD,
                              StepRecordQuery(run_id=run_id, step=step), StepRecord, 5.0)
        return reply.record

    async def warn(self, run_id: str, warning: str) -> None:
        """Show a warning on the run (GET /v1/runs/{id}); best effort."""
        with contextlib.suppress(RlboostError):
            await request(self.nc, names.TRAINER_WARN,
                          RunWarning(run_id=run_id, warning=warning), Ack, 3.0)

    async def fail(self, run_id: str, error: str) -> None:
        """Tell the manager the run failed here; best effort (the trainer goes on polling)."""
        with contextlib.suppress(RlboostError):
            await request(self.nc, names.TRAINER_FAIL, RunFailed(run_id=run_id, error=error),
                          Ack, 3.0)
