"""Preemption notices from a local stand-in for the AWS and GCP metadata servers."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from rlboost.launcher import Child
from rollout_svc.notice import NoticePoller
from shared.stack import Stack, free_port


class Metadata(ThreadingHTTPServer):
    """AWS IMDSv2 (token + spot/instance-action) and GCP (instance/preempted), per their docs."""

    preempted = False
    token = "tok-123"
    token_requests = 0


class Handler(BaseHTTPRequestHandler):
    server: Metadata

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, code: int, body: str = "") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:
        if self.path == "/latest/api/token" and \
                self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            self.server.token_requests += 1
            self._send(200, self.server.token)
        else:
            self._send(400)

    def do_GET(self) -> None:
        if self.path == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") != self.server.token:
                self._send(401)
            elif self.server.preempted:
                self._send(200, '{"action": "terminate", "time": "2026-11-29T10:00:00Z"}')
            else:
                self._send(404)
        elif self.path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                self._send(403)
            else:
                self._send(200, "TRUE" if self.server.preempted else "FALSE")
        else:
            self._send(404)


@pytest.fixture
def metadata() -> Iterator[Metadata]:
    server = Metadata(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


@pytest.mark.parametrize("provider", ["aws", "gcp"])
async def test_poller_sees_the_notice(metadata: Metadata, provider: str) -> None:
    poller = NoticePoller(provider, f"http://127.0.0.1:{metadata.server_port}",  # type: ignore[arg-type]
                          interval_s=0.01)
    async with httpx.AsyncClient() as client:
        assert not await poller.check(client)
        assert not await poller.check(client)
        metadata.preempted = True
        assert await poller.check(client)
    if provider == "aws":
        assert metadata.token_requests == 1  # the session token is reused


async def test_unreachable_metadata_is_not_a_notice() -> None:
    poller = NoticePoller("gcp", f"http://127.0.0.1:{free_port()}", interval_s=0.01)
    async with httpx.AsyncClient() as client:
        assert not await poller.check(client)


def test_instance_leaves_on_notice(brokers: Stack, metadata: Metadata, tmp_path: Path) -> None:
    port = free_port()
    env = {**brokers.env(), "RLBOOST_MANAGER_URL": f"http://127.0.0.1:{port}",
           "RLBOOST_DATA_DIR": str(tmp_path / "data")}
    manager = Child("manager", [sys.executable, "-m", "manager_svc"], env, tmp_path / "m.log")
    manager.start()
    instance = Child("spot-n", [sys.executable, "-m", "rollout_svc"], {
        **env, "RLBOOST_ENGINE": "emu", "RLBOOST_INSTANCE_ID": "spot-n",
        "RLBOOST_PREEMPTION_NOTICE": "aws", "RLBOOST_NOTICE_POLL_S": "0.1",
        "RLBOOST_METADATA_URL": f"http://127.0.0.1:{metadata.server_port}",
        "RLBOOST_GRACE_S": "5"}, tmp_path / "i.log")
    instance.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            for _ in range(200):
                try:
                    if any(i["id"] == "spot-n" for i in client.get("/v1/instances").json()):
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            else:
                pytest.fail(f"instance never registered:\n{instance.tail()}")
            metadata.preempted = True
            assert instance.proc is not None
            assert instance.proc.wait(timeout=10) == 0
            assert "announced a preemption" in instance.tail(40)
            # It deregistered on its way out rather than waiting to be reaped.
            assert all(i["id"] != "spot-n" for i in client.get("/v1/instances").json())
    finally:
        for child in (instance, manager):
            child.signal(9)
