"""No credential reaches a log: the whole stack, started with every credential set, trains a step.

Real brokers that require a login (the shipped NATS config's three roles, each service with its
own password in RLBOOST_NATS_URL, rollout instances logging in through the manager's auth
callout signed with RLBOOST_NATS_ISSUER_SEED; Redis ``requirepass``); RLBOOST_API_TOKEN guards
the REST API, RLBOOST_WEIGHTS_TOKEN and RLBOOST_WEIGHTS_READ_TOKEN the weight service (different
values, so each is looked for on its own). After one training step through REST, every log file
the services and the brokers wrote is read and none may contain any of the values, nor the
manager's chunk MAC secret (read from Redis after the run). Each service logs its
settings at start-up; the test checks that it did and that the line shows the credentials
masked: a service that stopped logging its settings would otherwise pass without being checked.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from rlboost.stack import Stack
from shared.names import Keys
from tests.support.cluster import start_cluster, wait_run

pytestmark = pytest.mark.slow

SPEC = {"model": "emu", "steps": 1, "prompts_per_step": 2, "samples_per_prompt": 2,
        "max_new_tokens": 16, "seed": 3}
SERVICES = ("manager", "weights", "trainer", "reserved-0", "spot-0")


def secret(kind: str) -> str:
    return f"{kind}-{secrets.token_hex(12)}"  # unlike anything else a log might contain


@pytest.fixture
def locked_brokers(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack.create(tmp_path / "brokers", locked=True, redis_password=secret("redis"))
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def test_no_password_or_token_in_any_log(locked_brokers: Stack, tmp_path: Path) -> None:
    roles, redis_pw = locked_brokers.roles, locked_brokers.redis.password
    assert roles is not None and redis_pw
    assert roles.manager in locked_brokers.env()["RLBOOST_NATS_URL"]
    api_token, weights_token, read_token = secret("api"), secret("weights"), secret("read")
    env = {"RLBOOST_API_TOKEN": api_token, "RLBOOST_WEIGHTS_TOKEN": weights_token,
           "RLBOOST_WEIGHTS_READ_TOKEN": read_token, "RLBOOST_EMU_TIME_SCALE": "0"}
    cluster = start_cluster(tmp_path, locked_brokers, env, spot=1, reserved=1, engine="emu")
    try:
        with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10,
                          headers={"Authorization": f"Bearer {api_token}"}) as client:
            run = client.post("/v1/runs", json=SPEC)
            assert run.status_code == 201, run.text
            final = wait_run(client, run.json()["id"], timeout_s=180, cluster=cluster)
            assert final["state"] == "succeeded", final
            steps = client.get(f"/v1/runs/{final['id']}/steps").json()
            assert len(steps) == 1 and steps[0]["responses"] == 4
            assert steps[0]["forged_chunks_rejected"] == 0
        store = redis.Redis.from_url(locked_brokers.redis.url, decode_responses=True)
        mac_secret = store.get(Keys.chunk_key())
        store.close()
        assert mac_secret
    finally:
        cluster.stop()

    # The brokers' own logs too: they must not echo the passwords they were started with.
    paths = [*(tmp_path / "logs").glob("*.log"), *(tmp_path / "brokers").glob("*.log")]
    logs = {path.stem: path.read_text(errors="replace") for path in paths}
    assert {*SERVICES, "nats", "redis"} <= set(logs), sorted(logs)
    for name, text in logs.items():
        for value in (roles.manager, roles.trainer, roles.rollout, roles.issuer_seed, mac_secret,
                      redis_pw, api_token, weights_token, read_token):
            assert value not in text, f"{name}.log contains a credential ({value[:5]}...)"
    users = {"manager": "manager", "weights": "trainer", "trainer": "trainer"}
    for name in SERVICES:
        # The start-up settings line: present, and showing each credential masked.
        user = users.get(name, "rollout")
        assert f"RLBOOST_NATS_URL': 'nats://{user}:***@" in logs[name], name
        assert "RLBOOST_REDIS_URL': 'redis://:***@" in logs[name], name
        assert "RLBOOST_WEIGHTS_TOKEN': '***'" in logs[name], name
        assert "RLBOOST_WEIGHTS_READ_TOKEN': '***'" in logs[name], name
    assert "RLBOOST_NATS_ISSUER_SEED': '***'" in logs["manager"]
    assert "RLBOOST_NATS_ROLLOUT_PASSWORD': '***'" in logs["manager"]
    # The rollout instances logged in through the callout, each under its own id.
    assert "instance reserved-0 logged in to NATS" in logs["manager"]
    assert "instance spot-0 logged in to NATS" in logs["manager"]
