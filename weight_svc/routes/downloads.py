"""Downloads through the API: a version's file, whole or one ``Range: bytes=a-b`` (206).

Contract: the body streams from the file, opened once (a collection cannot cut a download
off), a MiB read at a time off the event loop (with the service's link, a
:class:`~shared.weights.range_server.Link` block at a time, each after its turn on it); served
bytes are counted. Served by this code rather than Starlette's FileResponse (which supports
ranges in this version) so that a bad range is a 416 with a JSON ``detail`` like every other
error; ranges are parsed by the data plane's own parser
(:func:`shared.weights.range_server.parse_range`), so both ports answer alike.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import BinaryIO

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from shared.weights.range_server import Link, RangeError, parse_range
from weight_svc.routes.dependencies import PREFIX, Service
from weight_svc.service import Metrics

_READ_BLOCK = 1 << 20

router = APIRouter(prefix=PREFIX)


@router.get("/{run_id}/{version}/files/{name}")
async def get_file(run_id: str, version: int, name: str, request: Request, service: Service
                   ) -> Response:
    path = await asyncio.to_thread(service.store.file_path, run_id, version, name)
    f = await asyncio.to_thread(path.open, "rb")  # held open: a collection cannot cut us off
    size = os.fstat(f.fileno()).st_size
    headers = {"Accept-Ranges": "bytes"}
    status, start, end = 200, 0, size
    if (header := request.headers.get("range")) is not None:
        try:
            start, end = parse_range(header, size)
        except RangeError as exc:
            f.close()
            service.metrics.errors.labels("416").inc()
            return JSONResponse({"detail": exc.detail}, status_code=416,
                                headers={"Content-Range": f"bytes */{size}"})
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    headers["Content-Length"] = str(end - start)
    body = _stream(f, start, end, service.metrics, service.link)
    return StreamingResponse(body, status, headers, "application/octet-stream")


async def _stream(f: BinaryIO, start: int, end: int, metrics: Metrics, link: Link | None
                  ) -> AsyncIterator[bytes]:
    try:
        offset = start
        size = _READ_BLOCK if link is None else Link.BLOCK
        while offset < end:
            block = await asyncio.to_thread(
                os.pread, f.fileno(), min(size, end - offset), offset
            )
            if not block:
                break  # the file shrank; the client's length check catches it
            if link is not None:  # the data plane's link: both ports share one egress
                await asyncio.to_thread(link.take, len(block))
            offset += len(block)
            metrics.bytes_served.inc(len(block))
            yield block
    finally:
        f.close()
