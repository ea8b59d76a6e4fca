"""Agentic runs under faults: every committed turn's call counted once, samples as fault-free.

Real processes on real brokers, emu engine (its turns: rollout_svc/engines/emu.py), through
REST. The run's environment is a user module from a temp dir (RLBOOST_REWARD_PATH) whose tool
appends each ``call_id`` it runs to a file, takes a latency keyed by the call, and answers or
ends the episode as a pure function of the call id. A fault-free run, then runs under the fault
campaign's process, broker, link and engine faults (tests/support/chaos.py). Each must equal
the fault-free one sample for sample, turns included (invariants 1-5 with turns), and:

- every sample's turns cover it: model turns ending in EOS (a model turn ends there), each
  observation turn ending in the emu turn mark, its call ids ``<request>:0``, ``:1``, ... in
  order, each once;
- every call the tool ran belongs to a turn the samples show ended (a call for a turn that
  never ended was never asked), every committed observation's call ran, and a call ran more
  than once only in a faulted run, and only if a fault came while it could be unanswered
  (at-least-once: the call in flight when a fault hit). The faulted run also loses its
  trainer, tool loop and all, mid-call (SIGKILL, then started again);
- the steps' records count every answer committed once (``tool_calls_committed``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from rlboost.launcher import Cluster
from rlboost.stack import Stack
from shared.ports import wait_port
from shared.turns import EMU_TURN_MARK, Turn, check_turns
from tests.support.chaos import Injector, hit
from tests.support.cluster import start_cluster, wait_run
from tests.support.links import Links
from tests.system.test_faults import FAST, PROGRESS_TIMEOUT_S, STALL_BOUND_S
from trainer_svc.embedded import task
from trainer_svc.tool_loop import CLAIM_MARGIN_S

pytestmark = pytest.mark.slow

ENV_MODULE = '''
import hashlib, os, time

class Env:
    """Logs each call; answers or ends the episode as a pure function of the call id."""

    def __init__(self, prompt, answer, seed):
        self.log = os.environ["RLBOOST_TEST_CALL_LOG"]

    def step(self, action, call_id):
        with open(self.log, "a") as f:
            f.write("%s %f\\n" % (call_id, time.time()))
        # Keyed by step, prompt, sample and turn, not the run: every run answers alike.
        h = int(hashlib.sha256(call_id.split(":", 1)[1].encode()).hexdigest(), 16)
        time.sleep((h % 40) / 1000)  # tool latency, 0-39 ms
        if h % 4 == 0:
            return {"observation": None, "reward": (h % 7) / 7, "done": True}
        return {"observation": "result %d of %s" % (h % 1000, action[:20]), "reward": None,
                "done": False}
'''
SPEC: dict[str, Any] = {
    "model": "emu", "steps": 3, "prompts_per_step": 4, "samples_per_prompt": 4,
    "max_new_tokens": 96, "seed": 17, "env": "python:callenv:Env", "max_turns": 3,
    "max_tool_s": 1.0, "seeding": {"mode": "fixed", "window_s": 0.5}}
# How long a claimed call may stay unanswered before it is handed out again
# (trainer_svc/tool_loop.py: twice max_tool_s and a margin).
CLAIM_S = 2 * SPEC["max_tool_s"] + CLAIM_MARGIN_S
KILL_AFTER_CALLS = 30  # the trainer is killed once this many calls ran in the faulted run
# Faults on live processes across the faulted runs: 12 in the suite; `make chaos FAULTS=N`
# gives agentic runs a fifth of its campaign's.
FAULTS = max(12, int(os.environ.get("RLBOOST_CHAOS_FAULTS", "0")) // 5)
FAULTED_RUNS_MAX = max(4, FAULTS // 8)


@pytest.fixture
def calls(tmp_path: Path) -> Path:
    return tmp_path / "calls.log"


@pytest.fixture
def cluster(brokers: Stack, links: Links, tmp_path: Path, calls: Path) -> Iterator[Cluster]:
    envs = tmp_path / "envs"
    envs.mkdir()
    (envs / "callenv.py").write_text(ENV_MODULE)
    env = {**FAST, **links.base_env(), "RLBOOST_PROGRESS_TIMEOUT_S": str(PROGRESS_TIMEOUT_S),
           "RLBOOST_REWARD_PATH": str(envs), "RLBOOST_REWARD_ENV": "RLBOOST_TEST_CALL_LOG",
           "RLBOOST_TEST_CALL_LOG": str(calls)}
    c = start_cluster(tmp_path, brokers, spot=3, reserved=1, engine="emu", env=env,
                      per_child=links)
    try:
        yield c
    finally:
        c.stop()


def samples_of(client: httpx.Client, run_id: str) -> dict[int, list[dict[str, Any]]]:
    final = wait_run(client, run_id, 240)
    assert final["state"] == "succeeded", final
    return {n: sorted(client.get(f"/v1/runs/{run_id}/steps/{n}/samples").json(),
                      key=lambda s: (s["prompt_index"], s["sample_index"]))
            for n in range(SPEC["steps"])}


def ended_calls(sample: dict[str, Any]) -> list[str]:
    """The calls of the turns the sample shows ended: one after each model turn that ended in
    EOS (the last one's answered by the end of the episode, or it hit max_turns)."""
    turns = [msgspec.convert(t, Turn) for t in sample["turns"]]
    ids = sample["response_token_ids"]
    check_turns(turns, len(ids))
    model = [t for t in turns if t.role == "model"] or [Turn(role="model", start=0,
                                                              end=len(ids))]
    rid = sample["request_id"]
    return [f"{rid}:{k}" for k, t in enumerate(model) if ids[t.end - 1] == task.EOS_ID]


def check_turn_shape(sample: dict[str, Any]) -> None:
    ids, rid = sample["response_token_ids"], sample["request_id"]
    observed = [msgspec.convert(t, Turn) for t in sample["turns"]
                if t["role"] == "observation"]
    assert [t.call_id for t in observed] == [f"{rid}:{k}" for k in range(len(observed))]
    for t in observed:
        assert ids[t.start - 1] == task.EOS_ID  # the model turn before it ended
        assert ids[t.end - 1] == EMU_TURN_MARK and EMU_TURN_MARK not in ids[t.start:t.end - 1]
    assert len(observed) < SPEC["max_turns"]


def ran_calls(log: Path) -> dict[str, list[float]]:
    """Each call the tool ran -> when each run of it began."""
    out: dict[str, list[float]] = {}
    for line in log.read_text().splitlines():
        call, at = line.split()
        out.setdefault(call, []).append(float(at))
    return out


def kill_trainer_mid_call(cluster: Cluster, log: Path, killed: list[float]) -> None:
    """SIGKILL the trainer once KILL_AFTER_CALLS calls ran (its tool loop is then answering
    more), and start it again: the calls it held are handed out again when their claims
    lapse, to the new one."""
    end = time.monotonic() + 120
    while time.monotonic() < end:
        if log.is_file() and len(log.read_text().splitlines()) >= KILL_AFTER_CALLS:
            trainer = next(c for c in cluster.children if c.name == "trainer")
            if hit(trainer, signal.SIGKILL):
                killed.append(time.time())
            trainer.start()
            return
        time.sleep(0.02)


def test_agentic_runs_under_faults_equal_the_fault_free_run(
        cluster: Cluster, brokers: Stack, links: Links, calls: Path) -> None:
    url = cluster.env["RLBOOST_MANAGER_URL"]
    with httpx.Client(base_url=url, timeout=10) as client:
        clean_id = client.post("/v1/runs", json=SPEC).json()["id"]
        clean = samples_of(client, clean_id)
        clean_calls = Counter({call: len(at) for call, at in ran_calls(calls).items()})
        ended = {c for step in clean.values() for s in step for c in ended_calls(s)}
        assert set(clean_calls) == ended  # every ended turn's call ran, and no other
        assert max(clean_calls.values()) == 1  # without faults, each ran once
        observed = sum(len([t for t in s["turns"] if t["role"] == "observation"])
                       for step in clean.values() for s in step)
        assert observed > 0 and any(len(ended_calls(s)) > 1 for st in clean.values()
                                    for s in st), "no response went past one turn"
        records = client.get(f"/v1/runs/{clean_id}/steps").json()
        assert sum(r["tool_calls_committed"] for r in records) == len(ended)
        for step in clean.values():
            for s in step:
                check_turn_shape(s)

        calls.write_text("")
        injector = Injector(cluster, brokers, links, seed=11, interval_s=0.6,
                            stall_bound_s=STALL_BOUND_S)
        killed: list[float] = []
        killer = threading.Thread(target=kill_trainer_mid_call, args=(cluster, calls, killed))
        killer.start()
        injector.start()
        faulted: list[str] = []
        try:
            while injector.total() < FAULTS and len(faulted) < FAULTED_RUNS_MAX:
                with injector.paused():
                    faulted.append(client.post("/v1/runs", json=SPEC).json()["id"])
                injector.run_id = faulted[-1]
                wait_run(client, faulted[-1], 240)
                injector.run_id = ""
        finally:
            injector.stop()
            killer.join()
        assert not injector.errors, injector.errors
        assert killed, "the trainer was not killed while it answered calls"
        wait_port(int(url.rsplit(":", 1)[1]), 30)  # a manager restarted by the last fault
        runs = ran_calls(calls)
        ran = Counter({call: len(at) for call, at in runs.items()})
        for run_id in faulted:
            got = samples_of(client, run_id)
            for n, step in got.items():
                for s, c in zip(step, clean[n], strict=True):
                    turns = [{**t, "call_id": t["call_id"].replace(clean_id, run_id)}
                             for t in c["turns"]]
                    assert (s["response_token_ids"], s["turns"], s["reward"]) == (
                        c["response_token_ids"], turns, c["reward"])
                    check_turn_shape(s)
            for c in {c.replace(clean_id, run_id) for c in ended}:
                assert ran[c] >= 1, c  # every committed turn's call ran
            records = client.get(f"/v1/runs/{run_id}/steps").json()
            assert sum(r["tool_calls_committed"] for r in records) == len(ended)
        mine = {c.replace(clean_id, r) for r in faulted for c in ended}
        assert set(ran) <= mine, set(ran) - mine  # no call but those of ended turns
        # Only a call in flight when a fault hit runs again: its first run began before a
        # fault that came while it could still be unanswered (within its claim).
        faults = sorted([f.at for f in injector.faults] + killed)
        repeated = {call: at for call, at in runs.items() if len(at) > 1}
        for call, at in repeated.items():
            assert any(at[0] <= t <= at[0] + CLAIM_S + 1 for t in faults), (call, at)
        print(f"agentic: {len(faulted)} faulted runs, {injector.total()} faults "
              f"{dict(Counter(f.kind for f in injector.faults))} and the trainer killed "
              f"once, {len(ended)} calls a run, {len(repeated)} run again after a fault")
        assert injector.total() > 0
