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
from rlboost.stack import Stack, server_binary
from shared.ports import free_port, wait_port
from shared.weights import upload_version

ROOT = Path(__file__).resolve().parents[2]
TOKEN, WEIGHTS_TOKEN = "api-s3cret", "weights-s3cret"
READ_TOKEN = "weights-read-s3cret"
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
           "RLBOOST_WEIGHTS_READ_TOKEN": READ_TOKEN,
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


@pytest.mark.parametrize(("module", "url_var", "token_var"), [
    ("manager_svc", "RLBOOST_MANAGER_URL", "RLBOOST_API_TOKEN"),
    ("weight_svc", "RLBOOST_WEIGHTS_URL", "RLBOOST_WEIGHTS_TOKEN"),
])
def test_a_service_beyond_loopback_refuses_to_start_open(
    module: str, url_var: str, token_var: str, brokers: Stack, tmp_path: Path
) -> None:
    """Bound beyond this machine (a DNS name binds every interface) with no token, a service
    would take anyone's requests: it exits before listening, naming the setting, with no
    traceback. With the token but no TLS certificate it exits too (plain text stays on
    loopback); with the token and RLBOOST_ALLOW_PLAINTEXT (TLS ends at a proxy) it serves."""
    env = {**os.environ, **brokers.env(), url_var: f"http://rlboost.invalid:{free_port()}",
           "RLBOOST_DATA_DIR": str(tmp_path / "data")}
    env.pop(token_var, None)
    proc = subprocess.run([sys.executable, "-m", module], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert token_var in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", module], env={**env, token_var: "t0ken"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "RLBOOST_TLS_CERT_FILE" in proc.stderr and "RLBOOST_ALLOW_PLAINTEXT" in proc.stderr
    port = free_port()  # the same bind, with its token, plain text allowed: it serves
    env = {**brokers.env(), url_var: f"http://rlboost.invalid:{port}", token_var: "t0ken",
           "RLBOOST_DATA_DIR": str(tmp_path / "data"), "RLBOOST_PARENT_PID": str(os.getpid()),
           "RLBOOST_ALLOW_PLAINTEXT": "true"}
    child = start_http(module, module, env, f"http://127.0.0.1:{port}", tmp_path)
    child.signal(15)
    assert child.proc is not None and child.proc.wait(timeout=15) is not None


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
    # The weights tokens open no REST API either, and the API token opens no weights.
    for given in (READ_TOKEN, WEIGHTS_TOKEN):
        resp = httpx.get(f"{manager}/v1/runs", headers={"Authorization": f"Bearer {given}"})
        assert resp.status_code == 401
    resp = httpx.get(f"{weights}/v1/weights/run-x", headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 401


def test_the_read_token_reads_and_may_not_write(services: tuple[str, str],
                                                tmp_path: Path) -> None:
    """What a spot machine holds: list, manifest, download (REST and data plane), register as
    a peer; and 403 on upload, commit and pin, which only the trainer's write token may do."""
    _, weights = services
    src = tmp_path / "v0"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"w" * 1000)
    asyncio.run(upload_version(weights, WEIGHTS_TOKEN, "run-r", 0, src))
    read = {"Authorization": f"Bearer {READ_TOKEN}"}
    listing = httpx.get(f"{weights}/v1/weights/run-r", headers=read)
    assert listing.status_code == 200 and listing.json()["versions"] == [0]
    manifest = httpx.get(f"{weights}/v1/weights/run-r/0/manifest", headers=read)
    assert manifest.status_code == 200
    port = manifest.headers["X-Rlboost-Data-Port"]
    path = "/v1/weights/run-r/0/files/model.safetensors"
    body = httpx.get(weights + path, headers={**read, "Range": "bytes=0-9"})
    assert body.status_code == 206 and body.content == b"w" * 10
    fast = httpx.get(f"http://127.0.0.1:{port}{path}", headers=read)
    assert fast.status_code == 200 and fast.content == b"w" * 1000
    peer = httpx.post(f"{weights}/v1/weights/run-r/0/peers", headers=read,
                      json={"url": "http://10.0.0.9:8003"})
    assert peer.status_code == 200
    for method, route in (("PUT", "/v1/weights/run-r/1/files/model.safetensors"),
                          ("POST", "/v1/weights/run-r/1/commit"),
                          ("POST", "/v1/weights/run-r/0/pin"),
                          ("DELETE", "/v1/weights/run-r/0/pin")):
        resp = httpx.request(method, weights + route, headers=read, content=b"x" * 10)
        assert resp.status_code == 403, (method, route, resp.text)
        assert "write" in resp.json()["detail"]
    assert httpx.get(f"{weights}/v1/weights/run-r", headers=read).json()["pinned"] == []
    write = {"Authorization": f"Bearer {WEIGHTS_TOKEN}"}
    assert httpx.post(f"{weights}/v1/weights/run-r/0/pin", headers=write).status_code == 200


async def _nats_roundtrip(url: str, subject: str, jetstream: bool) -> bytes:
    nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2,
                            max_reconnect_attempts=0)
    try:
        sub = await nc.subscribe(subject)
        await nc.publish(subject, b"hello")
        msg = await sub.next_msg(timeout=2)
        if jetstream:
            info = await nc.jetstream().account_info()  # JetStream is on for the manager
            assert info.limits is not None
        return bytes(msg.data)
    finally:
        await nc.close()


def test_nats_refuses_missing_or_wrong_credentials(locked: Stack) -> None:
    roles = locked.roles
    assert roles is not None
    port = locked.nats.port
    # No login; a wrong password; a password of another role; a user the config lacks; and the
    # rollout login with no manager up to answer its callout.
    for userinfo in ("", "manager:wrong@", f"manager:{roles.trainer}@", f"nobody:{roles.manager}@",
                     "manager@", f"rollout:{roles.rollout}@"):
        with pytest.raises(Exception) as caught:
            asyncio.run(_nats_roundtrip(f"nats://{userinfo}127.0.0.1:{port}", "rlb.x", False))
        assert not isinstance(caught.value, AssertionError), userinfo


def test_nats_accepts_each_role_on_its_own_subjects(locked: Stack) -> None:
    # The URL form the compose files use: nats-py takes user:password from it.
    assert asyncio.run(_nats_roundtrip(locked.nats.url_for("manager"), "rlb.x", True)) == b"hello"
    # The trainer may publish its requests and read events, not its own requests' subject:
    # a round trip on an event subject needs publishing there, which it may not.
    with pytest.raises(Exception) as caught:
        asyncio.run(_nats_roundtrip(locked.nats.url_for("trainer"), "rlb.evt.x", False))
    assert not isinstance(caught.value, AssertionError)


def test_redis_refuses_missing_or_wrong_password(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([server_binary("redis-server"), "--appendonly", "yes", "--requirepass",
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
