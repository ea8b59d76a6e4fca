"""What a run has done so far: its step records, its instance events, a live feed of both, and
exactly what the trainer trained on at a step (its samples).

Contract: every route answers 404 for an unknown run before reading anything else of it; the
samples of a step that has not finished are a 404 too. Records and samples are served the same
from Redis or from the run's archive (:class:`~manager_svc.runs.RunStore`).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import StreamingResponse

from manager_svc.events import PAGE_MAX
from manager_svc.live import run_stream
from manager_svc.routes.dependencies import Service, run_or_404

router = APIRouter()


@router.get("/v1/runs/{run_id}/steps")
async def run_steps(run_id: str, service: Service) -> list[dict[str, Any]]:
    await run_or_404(service, run_id)
    return await service.runs.step_records(run_id)


@router.get("/v1/runs/{run_id}/events")
async def run_events(run_id: str, service: Service, after: Annotated[str | None, Query(
        pattern=r"^\d+-\d+$", description="the id of the last event already seen")] = None,
        limit: Annotated[int, Query(ge=1, le=PAGE_MAX)] = PAGE_MAX,
        ) -> list[dict[str, Any]]:
    """The run's instance events (join, version, leave, death), oldest first, a page at a
    time: pass the last id seen as ``after`` for the next."""
    await run_or_404(service, run_id)
    return await service.events.read(run_id, after, limit)


@router.get("/v1/runs/{run_id}/stream", response_class=StreamingResponse)
async def run_live(request: Request, run_id: str, service: Service,
                   steps_from: Annotated[int, Query(ge=0)] = 0,
                   events_after: Annotated[str | None, Query(pattern=r"^\d+-\d+$")] = None,
                   ) -> StreamingResponse:
    """Server-sent events: the run, new step records and instance events as they happen
    (manager_svc.live), resuming after ``steps_from`` records and ``events_after``."""
    await run_or_404(service, run_id)
    feed = run_stream(service.runs, service.events, run_id, steps_from, events_after,
                      request.is_disconnected, lambda: service.soft.stopping)
    return StreamingResponse(feed, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.get("/v1/runs/{run_id}/steps/{step}/samples")
async def step_samples(run_id: str, step: int, service: Service) -> list[dict[str, Any]]:
    await run_or_404(service, run_id)
    samples = await service.runs.samples(run_id, step)
    if samples is None:
        raise HTTPException(404, f"step {step} of {run_id} has not finished")
    return samples
