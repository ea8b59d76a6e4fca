"""The weight service's limits, on `python -m weight_svc`: bodies, connections, ranges.

Ranges are parsed by one bounded parser on both ports, so every Range header (a 4,300-digit
one included, which once gave a plain-text 500) gets the same status and detail from the REST
API and the sendfile data plane. The data plane serves at most RLBOOST_WEIGHTS_MAX_CONNECTIONS
connections at once and answers a connection beyond them 503 at once (idle sockets no longer
pile up threads). Bodies are bounded on every route, and refused before being read when the
token is missing or the declared size is over the limit.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shared.weights import upload_version
from tests.integration.test_weight_svc import ServiceProcess

WRITE, READ = "w-limits", "r-limits"
FILE = "/v1/weights/run-l/0/files/model.safetensors"
SIZE = 5000


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[ServiceProcess, int]]:
    svc = ServiceProcess(tmp_path / "data", WRITE, RLBOOST_WEIGHTS_READ_TOKEN=READ,
                         RLBOOST_WEIGHTS_MAX_CONNECTIONS="4",
                         RLBOOST_WEIGHTS_MAX_FILE_BYTES="100000")
    svc.start()
    src = tmp_path / "v0"
    src.mkdir()
    (src / "model.safetensors").write_bytes(bytes(range(250)) * (SIZE // 250))
    asyncio.run(upload_version(svc.url, WRITE, "run-l", 0, src))
    manifest = httpx.get(f"{svc.url}/v1/weights/run-l/0/manifest",
                         headers={"Authorization": f"Bearer {READ}"})
    try:
        yield svc, int(manifest.headers["X-Rlboost-Data-Port"])
    finally:
        svc.kill()


def test_every_range_gets_the_same_answer_on_both_ports(
        service: tuple[ServiceProcess, int]) -> None:
    svc, port = service
    read = {"Authorization": f"Bearer {READ}"}
    ranges = ["bytes=0-9", "bytes=10-", "bytes=-7", f"bytes={SIZE}-", "bytes=9-3", "bytes=-",
              "bytes=0-1,5-6", "items=0-1", "bytes=" + "9" * 4300 + "-", "bytes=-" + "9" * 4300,
              "bytes=0-" + "9" * 25, "bytes=1-2"]
    with httpx.Client(timeout=10) as client:
        for header in ranges:
            rest = client.get(svc.url + FILE, headers={**read, "Range": header})
            fast = client.get(f"http://127.0.0.1:{port}{FILE}",
                              headers={**read, "Range": header})
            assert rest.status_code == fast.status_code < 500, (header[:20], rest.text[:200])
            assert rest.content == fast.content, header[:20]
            if rest.status_code == 416:
                assert rest.json()["detail"] == fast.json()["detail"]
        assert client.get(svc.url + FILE, headers={**read, "Range": "bytes=-7"}).content == \
            (bytes(range(250)) * (SIZE // 250))[-7:]


def test_the_data_plane_caps_connections_and_authenticates_first(
        service: tuple[ServiceProcess, int]) -> None:
    _, port = service
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]  # hold every slot
    try:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            extra.sendall(f"GET {FILE} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer
    finally:
        for s in idle:
            s.close()
    time.sleep(0.3)  # the slots come back as the idle connections close
    ok = httpx.get(f"http://127.0.0.1:{port}{FILE}", headers={"Authorization": f"Bearer {READ}"})
    assert ok.status_code == 200 and len(ok.content) == SIZE
    refused = httpx.get(f"http://127.0.0.1:{port}{FILE}")
    assert refused.status_code == 401 and refused.json()["detail"]


def test_bodies_are_bounded_and_unread_without_a_token(
        service: tuple[ServiceProcess, int]) -> None:
    svc, _ = service
    write = {"Authorization": f"Bearer {WRITE}"}
    upload = svc.url + "/v1/weights/run-l/1/files/big.bin"
    huge = b"x" * 200_000
    assert httpx.put(upload, content=huge).status_code == 401  # no token: refused unread
    over = httpx.put(upload, content=huge, headers=write)
    assert over.status_code == 413 and over.json()["detail"]

    def streamed() -> Iterator[bytes]:  # no Content-Length: cut off while it streams
        for _ in range(50):
            yield b"y" * 4096

    assert httpx.put(upload, content=streamed(), headers=write).status_code == 413
    peers = svc.url + "/v1/weights/run-l/0/peers"
    big_json = b'{"url": "' + b"a" * 100_000 + b'"}'
    resp = httpx.post(peers, content=big_json, headers={**write, "Content-Type":
                                                        "application/json"})
    assert resp.status_code == 413
    assert httpx.put(upload, content=b"z" * 1000, headers=write).status_code == 200
