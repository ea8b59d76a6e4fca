"""Runs: submit, list, read, cancel, resume, and the checkpoints a run keeps.

Contract: ``POST /v1/runs`` takes a :class:`~shared.spec.RunSpec`, decoded and validated
by the protocol's own codec (:func:`run_spec_body`), errors shaped like FastAPI's 422s; a step
larger than RLBOOST_MAX_STEP_RESPONSES is a 422, as is an absolute dataset or eval path outside
RLBOOST_DATASET_ROOTS or a python: reward or env from the standard library; a full queue is a
429. An unknown run is a 404, a resume of a run in the wrong state a 409. :data:`SPEC_SCHEMAS`
are the run spec's JSON schemas for the app's OpenAPI document.
"""

from __future__ import annotations

import email.message
import logging
import re
from pathlib import Path
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response

from manager_svc.routes.dependencies import Service, no_run, run_or_404
from manager_svc.runs import QueueFull, RunConflict
from shared.errors import ProtocolError
from shared.protocol import decode
from shared.sources import outside_roots, roots_text, stdlib_reward_module
from shared.spec import RunSpec

log = logging.getLogger("manager.api")
# The run spec's JSON schema, from the struct itself, for the OpenAPI document.
_SPEC_REFS, SPEC_SCHEMAS = msgspec.json.schema_components(
    [RunSpec], ref_template="#/components/schemas/{name}")
RUNS_PAGE_MAX = 1000  # runs per page of GET /v1/runs
_SPEC_BODY = {"requestBody": {"required": False, "content": {
    "application/json": {"schema": _SPEC_REFS[0]}}}}

router = APIRouter()


async def run_spec_body(request: Request) -> RunSpec:
    """The body of ``POST /v1/runs`` as a :class:`RunSpec`: decoded and validated in one pass
    by the protocol's codec; no body (or ``null``) means every default. As with any FastAPI
    body, a body that is not declared JSON is refused."""
    body = await request.body()
    if not body.strip() or body.strip() == b"null":
        return RunSpec()
    kind = email.message.Message()
    kind["content-type"] = request.headers.get("content-type", "")
    subtype = kind.get_content_subtype()
    if kind.get_content_maintype() != "application" or not (
            subtype == "json" or subtype.endswith("+json")):
        raise HTTPException(422, [{"loc": ["body"], "msg": "the body must be JSON "
                                   "(Content-Type: application/json)", "type": "content_type"}])
    try:
        return decode(body, RunSpec)
    except ProtocolError as exc:
        # Shaped like FastAPI's own validation errors: msgspec names the field as "$.a.b".
        msg, _, where = exc.problem.partition(" - at `$")
        loc = ["body", *re.findall(r"[^.\[\]`]+", where)]
        raise HTTPException(422, [{"loc": loc, "msg": msg, "type": "value_error"}]) from exc


@router.post("/v1/runs", status_code=201,
             openapi_extra=_SPEC_BODY)
async def create_run(spec: Annotated[RunSpec, Depends(run_spec_body)],
                     service: Service) -> dict[str, Any]:
    responses, cap = spec.prompts_per_step * spec.samples_per_prompt, \
        service.cfg.max_step_responses
    if responses > cap:  # a step's responses all live in Redis until it completes
        raise HTTPException(422, f"prompts_per_step x samples_per_prompt = {responses} "
                            f"responses per step, over RLBOOST_MAX_STEP_RESPONSES ({cap})")
    refused = _refused_source(spec, service.cfg.common.dataset_dirs)
    if refused:
        raise HTTPException(422, refused)
    try:
        run = await service.runs.create(spec)
    except QueueFull as exc:
        raise HTTPException(429, str(exc)) from exc
    service.soft.wake.set()
    return run


def _refused_source(spec: RunSpec, roots: list[Path]) -> str | None:
    """Why the spec names data or code the trainer must not read or run, where the manager can
    tell without the trainer's file system (shared.sources); None if it cannot tell."""
    for field, part in (("dataset", spec.dataset), ("eval", spec.eval)):
        if part is not None and outside_roots(part.path, roots, resolve=False):
            return (f"{field}.path {part.path!r} is outside the dataset roots "
                    f"({roots_text(roots)}; RLBOOST_DATASET_ROOTS)")
    for field, name in (("reward", spec.reward), ("env", spec.env)):
        module = stdlib_reward_module(name)
        if module is not None:
            return (f"{field} {name!r}: {module!r} is a standard-library module; python: "
                    f"{field}s are imported from the trainer's RLBOOST_REWARD_PATH only")
    return None


@router.get("/v1/runs")
async def list_runs(response: Response, service: Service,
                    limit: Annotated[int, Query(ge=1, le=RUNS_PAGE_MAX)] = 100,
                    cursor: Annotated[float | None, Query(
                        allow_inf_nan=False,  # a cursor is a creation time: nan sorts nowhere
                        description="the X-Next-Cursor header of the previous page")] = None,
                    ) -> list[dict[str, Any]]:
    """Runs, newest first, ``limit`` per page; a next page's cursor comes in the
    ``X-Next-Cursor`` header (absent on the last page)."""
    runs, after = await service.runs.list_runs(limit, cursor)
    if after is not None:
        response.headers["X-Next-Cursor"] = repr(after)
    return runs


@router.get("/v1/runs/{run_id}")
async def get_run(run_id: str, service: Service) -> dict[str, Any]:
    run = await run_or_404(service, run_id)
    run["progress"] = await service.runs.step_progress(run_id, run["step"])
    run["warnings"] = await service.runs.warnings(run_id)
    return run


@router.post("/v1/runs/{run_id}/cancel")
async def cancel_run(run_id: str, service: Service) -> dict[str, Any]:
    run = await service.runs.cancel(run_id)
    if run is None:
        raise no_run(run_id)
    log.info("run %s is %s at step %d", run_id, run["state"], run["step"])
    return run


@router.post("/v1/runs/{run_id}/resume")
async def resume_run(run_id: str, service: Service) -> dict[str, Any]:
    """Queue a failed or cancelled run again; it goes on from the checkpoint of its last
    finished step (409 if it is in another state or finished no step)."""
    try:
        run = await service.runs.resume(run_id)
    except RunConflict as exc:
        raise HTTPException(409, str(exc)) from exc
    if run is None:
        raise no_run(run_id)
    log.info("run %s resumed at step %d", run_id, run["step"])
    service.soft.wake.set()
    return run


@router.get("/v1/runs/{run_id}/checkpoints")
async def run_checkpoints(run_id: str, service: Service) -> list[dict[str, Any]]:
    """The weight versions kept for the user (the spec's save_every and keep_last), oldest
    first: ``version``, ``step`` (the last step trained into it), ``reward_mean`` of that
    step and ``saved_at``. ``rlboost export`` pulls one from the weight service."""
    found = await service.runs.checkpoints(run_id)
    if found is None:
        raise no_run(run_id)
    return found
