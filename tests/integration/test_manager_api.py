"""The manager's REST surface and its resilience to bad input, on a real manager process."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest
import redis

from rlboost.launcher import Child
from rlboost.stack import Stack
from shared import names
from shared.bus import request
from shared.names import Keys
from shared.ports import free_port
from shared.protocol import Ack, Heartbeat, HeartbeatReply, Held, Release, encode
from shared.spec import RunSpec

TOKEN = "s3cret-token"


@pytest.fixture
def manager(brokers: Stack, tmp_path: Path) -> Iterator[httpx.Client]:
    port = free_port()
    child = Child("manager", [sys.executable, "-m", "manager_svc"], {
        **brokers.env(), "RLBOOST_MANAGER_URL": f"http://127.0.0.1:{port}",
        "RLBOOST_DATA_DIR": str(tmp_path / "data"), "RLBOOST_API_TOKEN": TOKEN,
    }, tmp_path / "manager.log")
    child.start()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}",
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as client:
        for _ in range(200):
            try:
                if client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            asyncio.run(asyncio.sleep(0.05))
        else:
            pytest.fail(f"manager did not start:\n{child.tail()}")
        yield client
    child.signal(15)
    assert child.proc is not None
    child.proc.wait(timeout=10)


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    text = client.get("/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)"
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("body", [
    {"no_such_field": 1},
    {"steps": -1},
    {"steps": "3"},
    {"samples_per_prompt": 0},
    {"learning_rate": "fast"},
    {"seeding": {"mode": "sometimes"}},
    {"seeding": {"mode": "fixed", "extra": 1}},
    {"algorithm": "ppo"},
    {"loss_agg": "mean"},
    {"kl_estimator": "k4"},
    {"updates_per_step": 0},
    # Combinations the fields alone allow: each detail names the knob at fault.
    {"algorithm": "dapo", "overlong_buffer": 8},  # not below max_new_tokens (8)
    {"minibatches": 17},  # more mini-batches than prompts_per_step (16)
    {"clip_ratio_low": 1.5},
    {"kl_coef": -0.1},
    {"dynamic_sampling": "yes"},
    {"max_gen_batches": 0},  # dynamic sampling's bound on generation
    {"kl_coef": 0.1, "kl_estimator": "k1"},  # zero expected gradient as a loss term
    {"algorithm": "rloo", "samples_per_prompt": 1},  # a group estimator, groups of one
    {"off_policy": "importance"},
    {"off_policy": "tis", "off_policy_cap": 0.5},  # a cap below 1 would weigh every token down
    {"off_policy_cap": 2.0},  # a cap with no correction to apply it to
    {"staleness": 9},
    {"dynamic_sampling": True, "staleness": 1},  # it closes the trained step only
])
def test_bad_run_specs_are_422_with_detail(manager: httpx.Client, body: dict[str, object]) -> None:
    resp = manager.post("/v1/runs", json=body)
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert detail
    knob = list(body)[-1]  # of a combination, the knob at fault comes last
    if knob in ("algorithm", "minibatches", "clip_ratio_low", "kl_coef", "overlong_buffer",
                "dynamic_sampling", "max_gen_batches", "kl_estimator",
                "samples_per_prompt", "off_policy_cap"):
        assert knob in str(detail), detail


def test_each_algorithm_is_accepted_with_its_defaults(manager: httpx.Client) -> None:
    for algorithm in ("grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp",
                      "reinforce_pp_baseline", "gspo"):
        spec = RunSpec(algorithm=algorithm)  # type: ignore[arg-type]
        assert spec.algorithm_config().algorithm == algorithm
    resp = manager.post("/v1/runs", json={"algorithm": "dapo", "steps": 1, "kl_coef": 0.01,
                                          "updates_per_step": 2, "dynamic_sampling": True})
    assert resp.status_code == 201, resp.text
    manager.post(f"/v1/runs/{resp.json()['id']}/cancel")


@pytest.mark.parametrize("body, names", [
    ({"model": "tiny-chat", "dataset": {"path": "d.jsonl"}, "reward": "maths"}, "reward"),
    ({"model": "tiny-chat", "dataset": {"path": "d.jsonl"}, "reward": "python:mod"}, "reward"),
    ({"model": "tiny-chat", "dataset": {"path": "d.jsonl", "text_key": "q"}}, "text_key"),
    ({"reward": "math"}, "reward needs a dataset"),
    ({"dataset": {"path": "d.jsonl"}}, "model 'tiny'"),
    ({"model": "tiny-chat", "dataset": {"path": "d.jsonl"}, "env": "shell"},
     "env 'shell': unknown; use one of calculator, python or python:<module>:<factory>"),
    ({"model": "tiny-chat", "dataset": {"path": "d.jsonl"}, "env": "python:mod"}, "env"),
    ({"model": "tiny-chat", "dataset": {"path": "d.jsonl"}, "env": "python:a:b:c"}, "env"),
    ({"env": "calculator"}, "env needs a dataset"),
    ({"max_turns": 4}, "max_turns 4 needs an env"),
    ({"model": "tiny-chat", "dataset": {"path": "d.jsonl"}, "env": "calculator",
      "max_turns": 99}, "max_turns"),
    ({"model": "tiny-chat", "dataset": {"path": "d.jsonl"}, "env": "calculator",
      "max_tool_s": -1}, "max_tool_s"),
    ({"model": "tiny-chat", "lora": {"rank": 0}}, "'lora', 'rank'"),
    ({"model": "tiny-chat", "lora": {"rank": 4096}}, "'lora', 'rank'"),
    ({"model": "tiny-chat", "lora": {"alpha": 0}}, "'lora', 'alpha'"),
    ({"model": "tiny-chat", "lora": {"dropout": 1.0}}, "'lora', 'dropout'"),
    ({"model": "tiny-chat", "lora": {"dropout": 0.05}}, "lora.dropout must be 0"),
    ({"model": "tiny-chat", "lora": {"target_modules": []}}, "'lora', 'target_modules'"),
    ({"model": "tiny-chat", "lora": {"target_modules": ["q_proj; rm"]}}, "target_modules"),
    ({"model": "tiny-chat", "lora": {"rank": 8, "scale": 2}}, "scale"),
    ({"model": "emu", "lora": {}}, "lora needs a real model"),
])
def test_bad_data_fields_are_422_naming_them(manager: httpx.Client, body: dict[str, object],
                                             names: str) -> None:
    resp = manager.post("/v1/runs", json=body)
    assert resp.status_code == 422, resp.text
    assert names in str(resp.json()["detail"])


@pytest.mark.parametrize("body, names", [
    ({"dataset": {"path": "/etc/passwd"}}, "dataset.path '/etc/passwd' is outside the dataset "
     "roots"),
    ({"eval": {"path": "/etc/shadow"}}, "eval.path '/etc/shadow' is outside"),
    ({"dataset": {"path": "@DATA@/../../x.jsonl"}}, "is outside the dataset roots"),
    ({"reward": "python:os:system"}, "'os' is a standard-library module"),
    ({"reward": "python:subprocess.run:x"}, "standard-library"),
    ({"env": "python:os:system"}, "env 'python:os:system': 'os' is a standard-library module"),
])
def test_data_and_code_the_trainer_must_not_touch_are_422(
        manager: httpx.Client, tmp_path: Path, body: dict[str, object], names: str) -> None:
    data = tmp_path / "data"
    base: dict[str, object] = {"model": "tiny-chat", "dataset": {"path": str(data / "d.jsonl")}}
    spec = json.loads(json.dumps({**base, **body}).replace("@DATA@", str(data)))
    resp = manager.post("/v1/runs", json=spec)
    assert resp.status_code == 422, resp.text
    assert names in str(resp.json()["detail"])
    # Under the data dir (a default root), a relative path (the trainer's to judge) and a
    # reward-path module are accepted.
    for fine in ({"dataset": {"path": str(data / "sub" / ".." / "d.jsonl")}},
                 {"dataset": {"path": "examples/data/word-problems-train.jsonl"}},
                 {"reward": "python:my_rewards:score"},
                 {"env": "python:my_envs:make", "max_turns": 3, "max_tool_s": 5.0},
                 {"env": "calculator", "max_turns": 4, "max_observation_tokens": 64}):
        ok = manager.post("/v1/runs", json={**base, **fine})
        assert ok.status_code == 201, ok.text
        stored = manager.get(f"/v1/runs/{ok.json()['id']}").json()
        for name, value in fine.items():
            if name != "dataset":
                assert stored["spec"][name] == value, stored
        manager.post(f"/v1/runs/{ok.json()['id']}/cancel")


def test_the_openapi_document_describes_the_run_spec(manager: httpx.Client) -> None:
    doc = manager.get("/openapi.json").json()
    body = doc["paths"]["/v1/runs"]["post"]["requestBody"]["content"]["application/json"]
    schema = doc["components"]["schemas"][body["schema"]["$ref"].rsplit("/", 1)[1]]
    assert set(schema["properties"]) == set(RunSpec.__struct_fields__)
    assert schema["additionalProperties"] is False
    assert schema["properties"]["steps"] == {"type": "integer", "minimum": 1,
                                             "maximum": 100_000, "default": 40}


def test_malformed_json_body_is_422(manager: httpx.Client) -> None:
    resp = manager.post("/v1/runs", content=b"{not json",
                        headers={"content-type": "application/json"})
    assert resp.status_code == 422
    assert resp.json()["detail"]


def test_run_lifecycle_and_unknown_ids(manager: httpx.Client) -> None:
    created = manager.post("/v1/runs", json={"steps": 2, "seed": 3})
    assert created.status_code == 201
    run = created.json()
    assert run["state"] in ("queued", "running") and run["steps"] == 2
    assert manager.get(f"/v1/runs/{run['id']}").json()["spec"]["seed"] == 3
    assert any(r["id"] == run["id"] for r in manager.get("/v1/runs").json())
    assert manager.get(f"/v1/runs/{run['id']}/steps").json() == []
    assert manager.get(f"/v1/runs/{run['id']}/steps/0/samples").status_code == 404
    cancelled = manager.post(f"/v1/runs/{run['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    for path in ("/v1/runs/nope", "/v1/runs/nope/steps", "/v1/runs/nope/steps/0/samples"):
        resp = manager.get(path)
        assert resp.status_code == 404 and "nope" in resp.json()["detail"]
    assert manager.post("/v1/runs/nope/cancel").status_code == 404
    assert manager.get("/v1/instances").json() == []


def test_resume_and_checkpoints_answer_every_case(manager: httpx.Client, brokers: Stack
                                                  ) -> None:
    r = redis.Redis.from_url(brokers.redis.url, decode_responses=True)
    run_id = manager.post("/v1/runs", json={"steps": 3}).json()["id"]
    assert manager.get(f"/v1/runs/{run_id}/checkpoints").json() == []
    deadline = time.monotonic() + 10
    while manager.get(f"/v1/runs/{run_id}").json()["state"] != "running":
        assert time.monotonic() < deadline, "the run was never activated"
        time.sleep(0.05)
    refused = manager.post(f"/v1/runs/{run_id}/resume")
    assert refused.status_code == 409 and "is running" in refused.json()["detail"]
    manager.post(f"/v1/runs/{run_id}/cancel")
    refused = manager.post(f"/v1/runs/{run_id}/resume")
    assert refused.status_code == 409 and "no checkpoint" in refused.json()["detail"]
    # As the manager leaves a run that failed after its first step (the trainer's report).
    r.hset(Keys.run(run_id), mapping={"state": "failed", "step": 1, "error": "boom",
                                      "checkpoints": "[1]"})
    resumed = manager.post(f"/v1/runs/{run_id}/resume")
    assert resumed.status_code == 200, resumed.text
    # Queued again; the dispatcher may activate it before the reply is read.
    assert resumed.json()["state"] in ("queued", "running") and resumed.json()["error"] is None
    assert resumed.json()["step"] == 1
    while manager.get(f"/v1/runs/{run_id}").json()["state"] != "running":
        assert time.monotonic() < deadline + 10, "the resumed run was never activated"
        time.sleep(0.05)
    assert manager.get(f"/v1/runs/{run_id}/checkpoints").json() == [
        {"version": 1, "step": 0, "reward_mean": None, "saved_at": None}]
    r.hset(Keys.run(run_id), mapping={"state": "failed", "step": 3})
    refused = manager.post(f"/v1/runs/{run_id}/resume")
    assert refused.status_code == 409 and "all 3 steps" in refused.json()["detail"]
    for resp in (manager.post("/v1/runs/nope/resume"), manager.get("/v1/runs/nope/checkpoints")):
        assert resp.status_code == 404 and "nope" in resp.json()["detail"]


def test_bearer_token_is_required(manager: httpx.Client) -> None:
    base = str(manager.base_url)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        resp = httpx.get(base + "/v1/runs", headers=headers)
        assert resp.status_code == 401 and resp.json()["detail"]
        assert httpx.post(base + "/v1/runs", json={}, headers=headers).status_code == 401
    assert httpx.get(base + "/healthz").status_code == 200


def test_malformed_bus_messages_are_counted_and_dropped(
    manager: httpx.Client, brokers: Stack
) -> None:
    subjects = [names.heartbeat_subject("i-1"), names.release_subject("i-1"), names.TRAINER_POLL,
                names.TRAINER_START,
                names.TRAINER_SAMPLES, names.TRAINER_FINISH, names.TRAINER_FAIL]
    garbage = [b"", b"not json", b'{"type": "Heartbeat"}', b"[1,2,3]", b"\xff\xfe"]

    async def send() -> list[bytes]:
        # As instance i-1 (its replies on its own inbox), which the trainer's subjects take too.
        nc = await nats.connect(brokers.nats.url, inbox_prefix=names.inbox_prefix("i-1"))
        replies = []
        for subject in subjects:
            for payload in garbage:
                msg = await nc.request(subject, payload, timeout=5)
                replies.append(msg.data)
        js = nc.jetstream()
        for payload in garbage:
            await js.publish(names.chunk_subject("run-x", "i"), payload)
        await js.publish(names.chunk_subject("run-x", "i"),
                         b'{"type":"TokenFrame","instance_id":"i","entries":[{"request_id":'
                         b'"no-colons","epoch":1,"weight_version":0,"offset":0,"token_ids":[1]}]}')
        await nc.close()
        return replies

    replies = asyncio.run(send())
    assert all(b'"ok":false' in r for r in replies)
    for subject, counted in zip(subjects, [names.HEARTBEAT_ANY, names.RELEASE_ANY,
                                           *subjects[2:]], strict=True):
        assert metric(manager, "rlboost_malformed_messages_total", subject=counted) == \
            len(garbage), subject
    for _ in range(50):
        chunk_drops = metric(manager, "rlboost_malformed_messages_total",
                             subject=names.CHUNK_WILDCARD)
        if chunk_drops == len(garbage) + 1:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert chunk_drops == len(garbage) + 1
    # Still serving, and a well-formed run still goes in.
    assert manager.get("/healthz").status_code == 200
    assert manager.post("/v1/runs", json={"steps": 1}).status_code == 201


def test_a_released_session_cannot_come_back_but_a_restart_can(
    manager: httpx.Client, brokers: Stack
) -> None:
    """A beat sent just before a release can be handled after it; it must not re-register the
    leaver. A fresh process under the same id (a restarted spot VM) must be let in."""
    def beat(session: str) -> Heartbeat:
        return Heartbeat(instance_id="spot-7", kind="spot", engine="emu", state="ready",
                         held=[Held(request_id="run-x:0:0:0", epoch=1)], session=session)

    async def exchange() -> tuple[HeartbeatReply, HeartbeatReply]:
        nc = await nats.connect(brokers.nats.url, inbox_prefix=names.inbox_prefix("spot-7"))
        await request(nc, names.heartbeat_subject("spot-7"), beat("old"), HeartbeatReply)
        await request(nc, names.release_subject("spot-7"),
                      Release(instance_id="spot-7", held=[], session="old"), Ack)
        late = await request(nc, names.heartbeat_subject("spot-7"), beat("old"), HeartbeatReply)
        ids_after_late = {i["id"] for i in manager.get("/v1/instances").json()}
        assert "spot-7" not in ids_after_late
        fresh = await request(nc, names.heartbeat_subject("spot-7"), beat("new"),
                              HeartbeatReply)
        await nc.close()
        return late, fresh

    late, fresh = asyncio.run(exchange())
    assert late.revoke == ["run-x:0:0:0"]  # whatever the leaver still thinks it holds
    assert "spot-7" in {i["id"] for i in manager.get("/v1/instances").json()}
    assert fresh.revoke == ["run-x:0:0:0"]  # no active run: nothing of run-x is renewed


def test_an_instance_cannot_speak_in_another_ones_name(
    manager: httpx.Client, brokers: Stack
) -> None:
    """The id in a heartbeat or release must be the one in its subject, and ids follow one
    pattern: an id that would collide in Redis (``<id>:held``) or break a subject is refused."""
    def beat(instance_id: str) -> Heartbeat:
        return Heartbeat(instance_id=instance_id, kind="spot", engine="emu", state="ready")

    async def exchange() -> list[bytes]:
        nc = await nats.connect(brokers.nats.url, inbox_prefix=names.inbox_prefix("spot-1"))
        replies = [
            (await nc.request(names.heartbeat_subject("spot-1"), encode(beat("spot-2")),
                              timeout=5)).data,
            (await nc.request(names.release_subject("spot-1"), encode(
                Release(instance_id="spot-2", held=[])), timeout=5)).data,
        ]
        for bad in ("spot-1:held", "a b", "x" * 65):
            replies.append((await nc.request(names.heartbeat_subject("spot-1"),
                                              encode(beat(bad)), timeout=5)).data)
        ok = await request(nc, names.heartbeat_subject("spot-1"), beat("spot-1"), HeartbeatReply)
        assert ok.revoke == []
        await nc.close()
        return replies

    replies = asyncio.run(exchange())
    assert all(b'"ok":false' in r for r in replies), replies
    assert {i["id"] for i in manager.get("/v1/instances").json()} == {"spot-1"}
    assert manager.get("/v1/instances").status_code == 200


def test_an_instance_is_answered_on_its_own_inbox_alone(
    manager: httpx.Client, brokers: Stack
) -> None:
    """The manager answers with its own permissions, so a heartbeat that names a reply subject
    other than its sender's inbox (a JetStream API subject, another instance's inbox, a bus
    subject) is dropped unanswered and counted; the stream outlives an attempt to delete it
    through the manager, and the sender is not registered."""
    reflect = [f"$JS.API.STREAM.DELETE.{names.CHUNK_STREAM}", names.inbox_prefix("spot-9") + ".x",
               "_INBOX.plain.x", "rlb.evt.probe"]
    beat = Heartbeat(instance_id="spot-3", kind="spot", engine="emu", state="ready")
    before = metric(manager, "rlboost_malformed_messages_total", subject=names.HEARTBEAT_ANY)

    async def exchange() -> tuple[list[bytes], HeartbeatReply, bool]:
        nc = await nats.connect(brokers.nats.url, inbox_prefix=names.inbox_prefix("spot-3"))
        seen: list[bytes] = []

        async def probe(msg: nats.aio.msg.Msg) -> None:
            seen.append(msg.data)
        for subject in reflect[1:]:
            await nc.subscribe(subject, cb=probe)
        for subject in reflect:  # one at a time: a beat while one waits would be shed
            await nc.publish(names.heartbeat_subject("spot-3"), encode(beat), reply=subject)
            await nc.flush()
            await asyncio.sleep(0.25)
        await asyncio.sleep(0.5)
        kept = (await nc.jetstream().stream_info(names.CHUNK_STREAM)).config.name is not None
        registered = "spot-3" in {i["id"] for i in manager.get("/v1/instances").json()}
        assert not registered
        answered = await request(nc, names.heartbeat_subject("spot-3"), beat, HeartbeatReply)
        await nc.close()
        return seen, answered, kept

    seen, answered, kept = asyncio.run(exchange())
    assert seen == [] and kept and answered.revoke == []
    assert "spot-3" in {i["id"] for i in manager.get("/v1/instances").json()}
    assert metric(manager, "rlboost_malformed_messages_total",
                  subject=names.HEARTBEAT_ANY) == before + len(reflect)


def test_bodies_are_bounded_and_read_only_after_auth(manager: httpx.Client) -> None:
    base = str(manager.base_url)
    big = b"x" * (2 << 20)  # over the 1 MiB default
    # No token: refused from the headers alone, the body unread.
    resp = httpx.post(base + "/v1/runs", content=big, headers={"Content-Type": "application/json"})
    assert resp.status_code == 401 and resp.json()["detail"]
    resp = manager.post("/v1/runs", content=big, headers={"Content-Type": "application/json"})
    assert resp.status_code == 413 and "bytes" in resp.json()["detail"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: cut off while streaming
        for _ in range(40):
            yield b" " * (64 << 10)

    resp = manager.post("/v1/runs", content=chunked(), headers={"Content-Type": "application/json"})
    assert resp.status_code == 413
    assert manager.post("/v1/runs", json={"steps": 1}).status_code == 201
