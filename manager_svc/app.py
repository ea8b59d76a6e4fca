"""The manager's REST API (the design's interface; clients and harnesses rely on it verbatim).

Contract: JSON in and out; every error is a 4xx with a ``detail`` message. Validation errors are
422, unknown ids 404, a missing or wrong bearer token 401 (only when RLBOOST_API_TOKEN is set),
a body over RLBOOST_MAX_BODY_BYTES 413; the token and the size are checked before any body is
read (:mod:`shared.http_guard`). ``/metrics`` and the docs are open or behind the token as
RLBOOST_EXPOSE says. A broker outage is a 503 with a ``detail``; nothing reaches a user as a
traceback. The OpenAPI document declares the bearer scheme and every error status. The routes
read through the service's parts (the run store, the instance registry); none holds state.
"""

from __future__ import annotations

import email.message
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.resources import files
from typing import Annotated, Any

import msgspec
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from manager_svc.events import PAGE_MAX
from manager_svc.live import run_stream
from manager_svc.runs import QueueFull, RunConflict
from manager_svc.service import ManagerService
from shared.errors import ProtocolError
from shared.http_guard import INFO_PATHS, Access, Guard, document, info_open
from shared.protocol import RunSpec, decode
from shared.settings import reveal

log = logging.getLogger("manager.api")
# The run spec's JSON schema, from the struct itself, for the OpenAPI document.
_SPEC_REFS, _SPEC_SCHEMAS = msgspec.json.schema_components(
    [RunSpec], ref_template="#/components/schemas/{name}")
RUNS_PAGE_MAX = 1000  # runs per page of GET /v1/runs
_SPEC_BODY = {"requestBody": {"required": False, "content": {
    "application/json": {"schema": _SPEC_REFS[0]}}}}


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


def create_app(service: ManagerService, manage_lifecycle: bool = True,
               bind_host: str = "127.0.0.1") -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await service.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await service.stop()

    app = FastAPI(title="rlboost manager", version="0.1.0", lifespan=lifespan)
    token = reveal(service.cfg.common.api_token)
    limit = service.cfg.max_body_bytes
    info = None if info_open(service.cfg.common.expose, bind_host) else "api"

    def rule(method: str, path: str) -> Access:
        if path.startswith("/v1/"):
            return Access("api", limit)
        return Access(info if path in INFO_PATHS else None, limit)

    app.add_middleware(Guard, rule=rule, tokens={"api": [token] if token else []})

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type")}
                  for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(RedisError)
    async def broker_down(_: Request, exc: RedisError) -> JSONResponse:
        log.warning("redis unavailable: %s", exc)
        return JSONResponse({"detail": "state store unavailable, retry shortly"}, status_code=503)

    async def run_or_404(run_id: str) -> dict[str, Any]:
        run = await service.runs.get(run_id)
        if run is None:
            raise HTTPException(404, f"no run {run_id!r}")
        return run

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        await service.redis.ping()
        # "auth": whether the API wants a token; the dashboard asks for one before calling it.
        return {"ok": True, "nats": service.nc.is_connected, "auth": token is not None}

    @app.get("/metrics")
    async def metrics() -> Response:
        alive: dict[str, int] = {"reserved": 0, "spot": 0}
        for inst in await service.registry.instances():
            alive[inst["kind"]] = alive.get(inst["kind"], 0) + 1
        for kind, count in alive.items():
            service.metrics.instances.labels(kind).set(count)
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/runs", status_code=201,
              openapi_extra=_SPEC_BODY)
    async def create_run(spec: Annotated[RunSpec, Depends(run_spec_body)]) -> dict[str, Any]:
        responses, cap = spec.prompts_per_step * spec.samples_per_prompt, \
            service.cfg.max_step_responses
        if responses > cap:  # a step's responses all live in Redis until it completes
            raise HTTPException(422, f"prompts_per_step x samples_per_prompt = {responses} "
                                f"responses per step, over RLBOOST_MAX_STEP_RESPONSES ({cap})")
        try:
            run = await service.runs.create(spec)
        except QueueFull as exc:
            raise HTTPException(429, str(exc)) from exc
        service.soft.wake.set()
        return run

    @app.get("/v1/runs")
    async def list_runs(response: Response,
                        limit: Annotated[int, Query(ge=1, le=RUNS_PAGE_MAX)] = 100,
                        cursor: Annotated[float | None, Query(
                            description="the X-Next-Cursor header of the previous page")] = None,
                        ) -> list[dict[str, Any]]:
        """Runs, newest first, ``limit`` per page; a next page's cursor comes in the
        ``X-Next-Cursor`` header (absent on the last page)."""
        runs, after = await service.runs.list_runs(limit, cursor)
        if after is not None:
            response.headers["X-Next-Cursor"] = repr(after)
        return runs

    @app.get("/v1/runs/{run_id}")
    async def get_run(run_id: str) -> dict[str, Any]:
        run = await run_or_404(run_id)
        run["progress"] = await service.runs.step_progress(run_id, run["step"])
        run["warnings"] = await service.runs.warnings(run_id)
        return run

    @app.post("/v1/runs/{run_id}/cancel")
    async def cancel_run(run_id: str) -> dict[str, Any]:
        run = await service.runs.cancel(run_id)
        if run is None:
            raise HTTPException(404, f"no run {run_id!r}")
        log.info("run %s is %s at step %d", run_id, run["state"], run["step"])
        return run

    @app.post("/v1/runs/{run_id}/resume")
    async def resume_run(run_id: str) -> dict[str, Any]:
        """Queue a failed or cancelled run again; it goes on from the checkpoint of its last
        finished step (409 if it is in another state or finished no step)."""
        try:
            run = await service.runs.resume(run_id)
        except RunConflict as exc:
            raise HTTPException(409, str(exc)) from exc
        if run is None:
            raise HTTPException(404, f"no run {run_id!r}")
        log.info("run %s resumed at step %d", run_id, run["step"])
        service.soft.wake.set()
        return run

    @app.get("/v1/runs/{run_id}/checkpoints")
    async def run_checkpoints(run_id: str) -> list[dict[str, Any]]:
        """The weight versions kept for the user (the spec's save_every and keep_last), oldest
        first: ``version``, ``step`` (the last step trained into it), ``reward_mean`` of that
        step and ``saved_at``. ``rlboost export`` pulls one from the weight service."""
        found = await service.runs.checkpoints(run_id)
        if found is None:
            raise HTTPException(404, f"no run {run_id!r}")
        return found

    @app.get("/v1/runs/{run_id}/steps")
    async def run_steps(run_id: str) -> list[dict[str, Any]]:
        await run_or_404(run_id)
        return await service.runs.step_records(run_id)

    @app.get("/v1/runs/{run_id}/events")
    async def run_events(run_id: str, after: Annotated[str | None, Query(
            pattern=r"^\d+-\d+$", description="the id of the last event already seen")] = None,
            limit: Annotated[int, Query(ge=1, le=PAGE_MAX)] = PAGE_MAX,
            ) -> list[dict[str, Any]]:
        """The run's instance events (join, version, leave, death), oldest first, a page at a
        time: pass the last id seen as ``after`` for the next."""
        await run_or_404(run_id)
        return await service.events.read(run_id, after, limit)

    @app.get("/v1/runs/{run_id}/stream", response_class=StreamingResponse)
    async def run_live(request: Request, run_id: str,
                       steps_from: Annotated[int, Query(ge=0)] = 0,
                       events_after: Annotated[str | None, Query(pattern=r"^\d+-\d+$")] = None,
                       ) -> StreamingResponse:
        """Server-sent events: the run, new step records and instance events as they happen
        (manager_svc.live), resuming after ``steps_from`` records and ``events_after``."""
        await run_or_404(run_id)
        feed = run_stream(service.runs, service.events, run_id, steps_from, events_after,
                          request.is_disconnected, lambda: service.soft.stopping)
        return StreamingResponse(feed, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/v1/runs/{run_id}/steps/{step}/samples")
    async def step_samples(run_id: str, step: int) -> list[dict[str, Any]]:
        await run_or_404(run_id)
        samples = await service.runs.samples(run_id, step)
        if samples is None:
            raise HTTPException(404, f"step {step} of {run_id} has not finished")
        return samples

    @app.get("/v1/instances")
    async def instances() -> list[dict[str, Any]]:
        return await service.registry.instances()

    # The dashboard: static files only (they hold no data); every figure on it comes from the
    # API above with the bearer token the page asks for.
    app.mount("/ui", StaticFiles(directory=str(files("manager_svc").joinpath("ui")), html=True),
              name="ui")

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui/")

    describe = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's document, with the run spec's schemas beside its own, the bearer scheme
        and every error status."""
        if app.openapi_schema is None:
            doc = describe()
            doc.setdefault("components", {}).setdefault("schemas", {}).update(_SPEC_SCHEMAS)
            document(doc, rule, _errors, {"api": "RLBOOST_API_TOKEN"})
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _errors(method: str, path: str) -> set[int]:
    """The statuses a route answers besides success and the guard's (OpenAPI)."""
    codes = {503} if path != "/metrics" and not path.startswith("/docs") else set()
    if "{run_id}" in path:
        codes |= {404, 422}
    if method == "POST" and path == "/v1/runs":
        codes |= {422, 429}
    if method == "GET" and path == "/v1/runs":
        codes |= {422}
    if path.endswith("/resume"):
        codes |= {409}
    return codes
