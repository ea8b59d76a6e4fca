"""The HTTP session every weight-service call goes through, with its retry policy.

Contract: :class:`Session` retries transport errors and 5xx with backoff, either a fixed number of
times or until ``patience_s`` pass without :meth:`Session.progress`; a 4xx is a non-retryable
:class:`WeightsError` at once (401 with a hint about the token). Only small JSON calls and uploads
use it; chunk downloads go through :mod:`shared.weights.fetch`.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any

import httpx

from shared.errors import WeightsError
from shared.weights.manifest import Manifest

log = logging.getLogger(__name__)

DATA_PORT_HEADER = "X-Rlboost-Data-Port"  # the service's sendfile data plane (weight_svc.peers)


def _detail(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("detail", resp.text))
    except (ValueError, AttributeError):
        return resp.text[:200]


class Session:
    """One HTTP connection pool plus the retry policy: transport errors and 5xx are retried with
    backoff, either a fixed number of times or until ``patience_s`` pass without progress."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        timeout_s: float,
        *,
        max_attempts: int | None = None,
        patience_s: float | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        """``verify``: httpx's, :meth:`shared.tls.Tls.verify` where a CA is configured."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s,
                                         verify=verify)
        self._base_url = base_url
        self._max_attempts = max_attempts
        self._patience_s = patience_s
        self._progress_at = time.monotonic()

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._client.aclose()

    def progress(self) -> None:
        self._progress_at = time.monotonic()

    def _exhausted(self, attempt: int) -> bool:
        if self._max_attempts is not None and attempt >= self._max_attempts:
            return True
        idle = time.monotonic() - self._progress_at
        return self._patience_s is not None and idle > self._patience_s

    async def send(
        self,
        method: str,
        path: str,
        *,
        expect: tuple[int, ...] = (200,),
        headers: dict[str, str] | None = None,
        body: Callable[[], AsyncIterator[bytes]] | None = None,
        body_json: object = None,
    ) -> httpx.Response:
        attempt = 0
        while True:
            attempt += 1
            try:
                content = body() if body is not None else None
                req = self._client.build_request(
                    method, path, headers=headers, content=content, json=body_json
                )
                resp = await self._client.send(req)
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code in expect:
                    return resp
                if resp.status_code < 500:
                    raise self._rejected(method, path, resp)
                problem = f"HTTP {resp.status_code}: {_detail(resp)}"
            if self._exhausted(attempt):
                raise WeightsError(
                    f"{method} {self._base_url}{path}: gave up after {attempt} attempts: {problem}"
                )
            delay = min(0.1 * 2 ** (attempt - 1), 2.0)
            log.info("weights %s %s failed (%s); retrying in %.1fs", method, path, problem, delay)
            await asyncio.sleep(delay)

    def _rejected(self, method: str, path: str, resp: httpx.Response) -> WeightsError:
        where = f"{method} {self._base_url}{path}"
        if resp.status_code == 401:
            hint = "check RLBOOST_WEIGHTS_TOKEN / RLBOOST_API_TOKEN"
            return WeightsError(f"{where}: unauthorized ({hint})", retryable=False)
        return WeightsError(f"{where}: HTTP {resp.status_code}: {_detail(resp)}", retryable=False)

    async def manifest(self, run_id: str, version: int) -> Manifest | None:
        return (await self.manifest_and_data_url(run_id, version))[0]

    async def manifest_and_data_url(
        self, run_id: str, version: int
    ) -> tuple[Manifest | None, str | None]:
        """The manifest (None if not published) and the data plane's base URL if advertised."""
        resp = await self.send("GET", f"/v1/weights/{run_id}/{version}/manifest", expect=(200, 404))
        if resp.status_code == 404:
            return None, None
        manifest: Manifest = resp.json()
        port = resp.headers.get(DATA_PORT_HEADER, "")
        data_url = None
        if port.isdigit() and 0 < int(port) < 65536:
            # The host and scheme this client reached the service by: the data port serves
            # TLS exactly when the REST port does.
            host, scheme = resp.url.host, resp.url.scheme
            data_url = (f"{scheme}://{host}:{port}" if ":" not in host
                        else f"{scheme}://[{host}]:{port}")
        return manifest, data_url

    async def json(self, method: str, path: str, body: object = None) -> dict[str, Any]:
        resp = await self.send(method, path, body_json=body)
        result: dict[str, Any] = resp.json()
        return result
