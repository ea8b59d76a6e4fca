"""Every surface refuses a missing or wrong credential: manager REST, weight service, NATS, Redis.

Real processes and servers throughout: the manager and the weight service as ``python -m``
processes with their tokens set, ``nats-server`` started from the compose files' own
``compose/nats.conf`` (so the test proves the shipped config, not a copy of it), and
``redis-server`` with ``--requirepass`` as the compose files start it. Each refusal is paired
with the matching acceptance, so a surface that refused everything would fail too.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest
import redis
import redis.exceptions

from rlboost.launcher import Child
from shared.stack import Stack, _binary, free_port, wait_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN, WEIGHTS_TOKEN = "api-s3cret", "weights-s3cret"
USER, PASSWORD = "rl", "nats-s3cret"
BAD_HEADERS = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
               {"Authorization": "Bearer"}]


def start_http(name: str, module: str, env: dict[str, str], url: str, root: Path) -> Child:
    child = Child(name, [sys.executable, "-m", module], env, root / f"{name}.log")
    child.start()
    for _ in range(300):
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return child
        except httpx.TransportError:
            pass
        if not child.alive():
            break
        time.sleep(0.05)
    pytest.fail(f"{name} did not come up:\n{child.tail()}")


@pytest.fixture
def services(brokers: Stack, tmp_path: Path) -> Iterator[tuple[str, str]]:
    manager, weights = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    env = {**brokers.env(), "RLBOOST_MANAGER_URL": manager, "RLBOOST_WEIGHTS_URL": weights,
           "RLBOOST_API_TOKEN": TOKEN, "RLBOOST_WEIGHTS_TOKEN": WEIGHTS_TOKEN,
           "RLBOOST_DATA_DIR": str(tmp_path / "data"), "RLBOOST_PARENT_PID": str(os.getpid())}
    children = [start_http("manager", "manager_svc", env, manager, tmp_path),
                start_http("weights", "weight_svc", env, weights, tmp_path)]
    try:
        yield manager, weights
    finally:
        for child in children:
            child.signal(15)
        for child in children:
            if child.proc is not None:
                child.proc.wait(timeout=15)


def test_rest_surfaces_refuse_missing_or_wrong_tokens(services: tuple[str, str]) -> None:
    manager, weights = services
    for headers in BAD_HEADERS:
        for method, path in (("GET", "/v1/runs"), ("POST", "/v1/runs"), ("GET", "/v1/instances")):
            resp = httpx.request(method, manager + path, headers=headers, json={}, timeout=5)
            assert resp.status_code == 401, (headers, path, resp.text)
            assert resp.json()["detail"]
        for method, path in (("GET", "/v1/weights/run-x"), ("GET", "/v1/weights/run-x/0/manifest"),
                             ("PUT", "/v1/weights/run-x/0/files/model.safetensors")):
            resp = httpx.request(method, weights + path, headers=headers, content=b"x", timeout=5)
            assert resp.status_code == 401, (headers, path, resp.text)
    # The API token is not the weights token: a leaked spot credential opens no REST API.
    resp = httpx.get(f"{manager}/v1/runs", headers={"Authorization": f"Bearer {WEIGHTS_TOKEN}"})
    assert resp.status_code == 401
    ok = httpx.get(f"{manager}/v1/runs", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200
    ok = httpx.get(f"{weights}/v1/weights/run-x",
                   headers={"Authorization": f"Bearer {WEIGHTS_TOKEN}"})
    assert ok.status_code != 401


@pytest.fixture
def nats_port(tmp_path: Path) -> Iterator[int]:
    """nats-server from the shipped compose/nats.conf, credentials from the environment."""
    port = free_port()
    argv = [_binary("nats-server"), "-c", str(ROOT / "compose" / "nats.conf"), "-sd",
            str(tmp_path / "js"), "-a", "127.0.0.1", "-p", str(port), "-m", str(free_port())]
    log = (tmp_path / "nats.log").open("wb")
    proc = subprocess.Popen(argv, env={**os.environ, "NATS_USER": USER, "NATS_PASSWORD": PASSWORD},
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


async def _nats_roundtrip(url: str) -> bytes:
    nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2,
                            max_reconnect_attempts=0)
    try:
        sub = await nc.subscribe("auth.check")
        await nc.publish("auth.check", b"hello")
        msg = await sub.next_msg(timeout=2)
        info = await nc.jetstream().account_info()  # JetStream is on for this user
        assert info.limits is not None
        return bytes(msg.data)
    finally:
        await nc.close()


@pytest.mark.parametrize("userinfo", ["", f"{USER}:wrong@", f"nobody:{PASSWORD}@", f"{USER}@"])
def test_nats_refuses_missing_or_wrong_credentials(nats_port: int, userinfo: str) -> None:
    with pytest.raises(Exception) as caught:
        asyncio.run(_nats_roundtrip(f"nats://{userinfo}127.0.0.1:{nats_port}"))
    assert not isinstance(caught.value, AssertionError)


def test_nats_accepts_the_credentials_in_the_url(nats_port: int) -> None:
    # The URL form the compose files use: nats-py takes user:password from it.
    url = f"nats://{USER}:{PASSWORD}@127.0.0.1:{nats_port}"
    assert asyncio.run(_nats_roundtrip(url)) == b"hello"


def test_redis_refuses_missing_or_wrong_password(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([_binary("redis-server"), "--appendonly", "yes", "--requirepass",
                             "redis-s3cret", "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path), "--save", ""],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_port(port)
        for url in (f"redis://127.0.0.1:{port}/0", f"redis://:wrong@127.0.0.1:{port}/0",
                    f"redis://default:wrong@127.0.0.1:{port}/0"):
            client = redis.Redis.from_url(url, socket_timeout=2)
            with pytest.raises(redis.exceptions.AuthenticationError):
                client.set("k", "v")
            client.close()
        client = redis.Redis.from_url(f"redis://:redis-s3cret@127.0.0.1:{port}/0",
                                      socket_timeout=2)
        assert client.set("k", "v") and client.get("k") == b"v"
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
