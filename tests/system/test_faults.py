"""Fault injection with real processes: the invariants hold under any fault, token for token.

Rollout instances run the ``emu`` engine, whose tokens are a pure function of (seed, step,
prompt, sample, position, weight version), so the exact response a fault-free run produces is
known twice over: from a fault-free run on the same cluster, and from the engine's oracle.
The faulted run must equal both, with every sample exactly once and from the step's version,
while rollout instances are SIGKILLed, SIGTERMed (preemption notice), SIGSTOPped (zombies),
join mid-step, and the manager, NATS and Redis are killed and restarted. A fault counts only
if it hit a live process while a run was under way; joins, faults that found their process
already gone and faults after a run ended are reported apart, never counted.
"""

from __future__ import annotations

import contextlib
import random
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from rlboost.launcher import Child, Cluster
from rollout_svc.engines import GenRequest
from rollout_svc.engines.emu import EmuEngine
from shared.protocol import RunSpec
from shared.stack import Server, Stack, wait_port
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run, step_records
from trainer_svc.policies import PRESETS, EmuPolicy

pytestmark = pytest.mark.slow

FAST = {
    "RLBOOST_EMU_TIME_SCALE": "1.0",
    "RLBOOST_LEASE_TTL_S": "1.5",
    "RLBOOST_INSTANCE_TTL_S": "1.5",
    "RLBOOST_HEARTBEAT_S": "0.25",
    "RLBOOST_CHUNK_TOKENS": "4",
    "RLBOOST_GRACE_S": "5",
}
REWARD = EmuPolicy(PRESETS["emu"], Path("/nonexistent"), 0.0).reward


def oracle(spec: dict[str, Any], sample: dict[str, Any], step: int) -> list[int]:
    """The response a fault-free emu instance generates for this sample."""
    run = msgspec.convert(spec, RunSpec)
    return EmuEngine(time_scale=0.0).expected_tokens(GenRequest(
        request_id="", prompt_token_ids=sample["prompt_token_ids"], committed_token_ids=[],
        max_new_tokens=run.max_new_tokens, temperature=1.0, seed=run.seed, step=step,
        prompt_index=sample["prompt_index"], sample_index=sample["sample_index"],
        eos_token_id=2, weight_version=step))


@pytest.fixture
def cluster(brokers: Stack, tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path, brokers, spot=3, reserved=1, engine="emu", env=FAST)
    try:
        yield c
    finally:
        c.stop()


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    at: float  # wall clock (time.time()), as the manager stamps a run's updated_at
    run_id: str  # the run under way when it was injected


def hit(child: Child, sig: int) -> bool:
    """Send ``sig`` to ``child`` if it is alive; whether it was (a signal to a process that
    already exited is no fault). A SIGKILL counts once the process is seen dead of it."""
    if child.proc is None or child.proc.poll() is not None:
        return False
    try:
        child.proc.send_signal(sig)
    except ProcessLookupError:
        return False
    if sig == signal.SIGKILL:
        return child.proc.wait(timeout=10) == -signal.SIGKILL
    return True


class Injector:
    """Injects one random fault every ``interval_s`` while a run is under way (``run_id``
    set), until stopped. A fault is recorded only if it hit a live process; instances started
    to replace the killed (and the ``join`` kind) are joins, counted apart, as are faults
    that found no live process to hit."""

    def __init__(self, cluster: Cluster, brokers: Stack, seed: int, interval_s: float) -> None:
        self.cluster = cluster
        self.brokers = brokers
        self.rng = random.Random(seed)
        self.interval_s = interval_s
        self.faults: list[Fault] = []
        self.joins = 0
        self.missed: Counter[str] = Counter()  # injections that hit no live process
        self.errors: list[str] = []
        self.run_id = ""  # the run under way; "" between runs: nothing is injected then
        self._stop = threading.Event()
        self._gate = threading.Lock()  # held while a fault is injected
        self._next_id = 0
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def rollouts(self) -> list[Child]:
        return [c for c in self.cluster.children
                if c.name.startswith(("spot", "reserved", "join")) and c.alive()]

    def _spare(self) -> None:
        self._next_id += 1
        self.cluster.add_instance("spot", f"join-{self._next_id}")
        self.joins += 1

    def busy_rollouts(self) -> list[Child]:
        """Alive instances that hold work now (a fault on an idle one proves little)."""
        try:
            info = httpx.get(self.cluster.env["RLBOOST_MANAGER_URL"] + "/v1/instances",
                             timeout=2).json()
            busy = {i["id"] for i in info if i["held"] > 0}
        except (httpx.HTTPError, ValueError, TypeError, KeyError):
            busy = set()  # the manager is restarting: any instance will do
        alive = self.rollouts()
        return [c for c in alive if c.name in busy] or alive

    def kill_rollout(self) -> bool:
        victims = self.busy_rollouts()
        done = len(self.rollouts()) > 1 and hit(self.rng.choice(victims), signal.SIGKILL)
        self._spare()
        return done

    def preempt_rollout(self) -> bool:
        victims = self.busy_rollouts()
        done = len(self.rollouts()) > 1 and hit(self.rng.choice(victims), signal.SIGTERM)
        self._spare()
        return done

    def join(self) -> bool:
        if len(self.rollouts()) >= 6:
            self.rollouts()[0].signal(signal.SIGTERM)
        self._spare()
        return False  # a join, not a fault: counted in joins

    def zombie(self) -> bool:
        victims = self.rollouts()
        if len(victims) <= 1:
            return False
        victim = self.rng.choice(victims)
        if not hit(victim, signal.SIGSTOP):
            return False
        time.sleep(2.0)  # past its 1.5 s lease: its responses move on without it
        victim.signal(signal.SIGCONT)
        return True

    def restart_manager(self) -> bool:
        manager = next(c for c in self.cluster.children if c.name == "manager")
        done = hit(manager, signal.SIGKILL)
        manager.start()
        wait_port(int(self.cluster.env["RLBOOST_MANAGER_URL"].rsplit(":", 1)[1]), 30)
        return done

    @staticmethod
    def restart_server(server: Server) -> bool:
        alive = server.proc is not None and server.proc.poll() is None
        server.restart()
        return alive

    def restart_nats(self) -> bool:
        return self.restart_server(self.brokers.nats)

    def restart_redis(self) -> bool:
        return self.restart_server(self.brokers.redis)

    def _loop(self) -> None:
        kinds: list[tuple[str, Callable[[], bool], float]] = [
            ("rollout_sigkill", self.kill_rollout, 0.28),
            ("rollout_sigterm", self.preempt_rollout, 0.24),
            ("join", self.join, 0.18),
            ("zombie", self.zombie, 0.06),
            ("manager_sigkill", self.restart_manager, 0.08),
            ("nats_restart", self.restart_nats, 0.08),
            ("redis_restart", self.restart_redis, 0.08),
        ]
        while not self._stop.wait(self.rng.uniform(0.5, 1.5) * self.interval_s):
            name, fault, _ = self.rng.choices(kinds, weights=[k[2] for k in kinds])[0]
            with self._gate:
                run_id = self.run_id
                if self._stop.is_set() or not run_id:
                    continue  # between runs: nothing to hurt
                try:
                    at = time.time()
                    if fault():
                        self.faults.append(Fault(name, at, run_id))
                    elif name != "join":
                        self.missed[name] += 1
                except Exception as exc:  # a fault that could not be injected is a test defect
                    self.errors.append(f"{name}: {exc!r}")

    def counted(self, ended: dict[str, float]) -> Counter[str]:
        """Faults by kind that hit a run before it ended (``ended``: run id -> the time its
        final state was recorded); one injected just after its run ended does not count."""
        return Counter(f.kind for f in self.faults if f.at <= ended.get(f.run_id, 0.0))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No fault is in flight or starts inside: the test can submit a run knowing that its
        answer is the manager's (a POST cut off by a fault could still have queued a run)."""
        with self._gate:
            yield

    def total(self) -> int:
        return len(self.faults)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=30)


# The faulted run must see FAULTS_MIN faults at least (and FAULTS_MAX at most, then it is left to
# finish). How long a run lasts depends on the machine, so when one ends before the budget is
# spent, another is submitted, up to MAX_FAULTED_RUNS: each must equal the fault-free run.
SPEC = {"model": "emu", "steps": 16, "prompts_per_step": 8, "samples_per_prompt": 4,
        # A short fixed window: seeding hand-offs migrate responses, and spot instances still do
        # most of the work, so preemptions hit busy instances.
        "seeding": {"mode": "fixed", "window_s": 0.5},
        "max_new_tokens": 96, "seed": 21}
FAULTS_MIN, FAULTS_MAX, MAX_FAULTED_RUNS = 50, 60, 4


def submit(client: httpx.Client, injector: Injector, port: int, known: set[str]) -> str:
    """POST a run while no fault is in flight (retrying what a just-restarted broker refuses).
    A POST whose answer was lost may still have queued its run: that run is taken, not a
    second one queued behind it (``known``: the runs submitted so far)."""
    with injector.paused():
        wait_port(port, 30)
        for _ in range(100):
            try:
                resp = client.post("/v1/runs", json=SPEC)
                if resp.status_code == 201:
                    return str(resp.json()["id"])
            except httpx.TransportError:
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                    new = [r["id"] for r in client.get("/v1/runs").json() if r["id"] not in known]
                    if new:
                        return str(new[0])
            time.sleep(0.3)
    raise AssertionError("could not submit a run")


def run_under_faults(client: httpx.Client, injector: Injector, run_id: str) -> None:
    """Faults while the run is under way, until it ends; the injector stops once FAULTS_MAX
    faults are in."""
    injector.run_id = run_id
    end = time.monotonic() + 240
    while time.monotonic() < end:
        try:
            resp = client.get(f"/v1/runs/{run_id}")
            # 503 while Redis restarts, no answer while the manager does
            state = resp.json()["state"] if resp.status_code == 200 else "unknown"
        except (httpx.TransportError, ValueError):
            state = "unknown"
        if state in ("succeeded", "failed", "cancelled"):
            break
        if injector.total() >= FAULTS_MAX:
            injector.stop()
        time.sleep(0.3)
    injector.run_id = ""


def test_faulted_run_equals_fault_free_run(cluster: Cluster, brokers: Stack) -> None:
    url = cluster.env["RLBOOST_MANAGER_URL"]
    port = int(url.rsplit(":", 1)[1])
    with httpx.Client(base_url=url, timeout=10) as client:
        clean_id = client.post("/v1/runs", json=SPEC).json()["id"]
        assert wait_run(client, clean_id, 240, cluster)["state"] == "succeeded"
        clean = check_run(client, clean_id, SPEC, REWARD)

        injector = Injector(cluster, brokers, seed=7, interval_s=0.9)
        injector.start()
        faulted_ids: list[str] = []
        try:
            while injector.total() < FAULTS_MIN + 3 and len(faulted_ids) < MAX_FAULTED_RUNS:
                faulted_ids.append(submit(client, injector, port, {clean_id, *faulted_ids}))
                run_under_faults(client, injector, faulted_ids[-1])
        finally:
            injector.stop()
        assert not injector.errors, injector.errors
        wait_port(port, 30)
        # Every run there is, should a submission have queued one more than it knew of: each
        # ran under the same faults and must equal the fault-free run all the same.
        listed = [r["id"] for r in client.get("/v1/runs").json() if r["id"] != clean_id]
        assert set(faulted_ids) <= set(listed), (faulted_ids, listed)
        totals: Counter[str] = Counter()
        ended: dict[str, float] = {}
        for faulted_id in listed:
            final = wait_run(client, faulted_id, 120, cluster)
            assert final["state"] == "succeeded", final
            ended[faulted_id] = final["updated_at"]
            faulted = check_run(client, faulted_id, SPEC, REWARD)
            for step, samples in faulted.items():
                reference = {(s["prompt_index"], s["sample_index"]): s for s in clean[step]}
                for s in samples:
                    tokens = s["response_token_ids"]
                    assert tokens == reference[(s["prompt_index"], s["sample_index"])][
                        "response_token_ids"]
                    assert tokens == oracle(SPEC, s, step)
            for record in step_records(client, faulted_id):
                totals.update({k: record[k] for k in (
                    "migrations", "preemptions", "stale_chunks_rejected", "tokens_regenerated",
                    "duplicate_chunks_dropped")})
        print(f"faulted run counters: {dict(totals)}")
        assert totals["preemptions"] > 0 and totals["migrations"] > 0
        # Only faults that hit a live process while a run was under way count.
        counted = injector.counted(ended)
        late = injector.total() - counted.total()
        print(f"faults over {len(listed)} runs: {counted.total()} on live processes during "
              f"runs, by kind {dict(sorted(counted.items()))}; apart: {injector.joins} joins, "
              f"{late} after their run ended, no live process for {dict(injector.missed)}")
        assert counted.total() >= FAULTS_MIN, counted
        assert len(counted) >= 5, counted  # of the 6 kinds, the rarest may miss a run


def victim_revocations(metrics_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    found = re.search(r"^rlboost_rollout_revoked_total (\S+)", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_zombie_instance_is_fenced(cluster: Cluster) -> None:
    """A paused instance whose lease expired wakes up: the chunks it sends are rejected by the
    commit script and counted, or it drops its work on its first heartbeat; its responses
    finish elsewhere exactly once, with the tokens a fault-free run produces."""
    spec = {**SPEC, "steps": 2, "max_new_tokens": 400, "seeding": {"mode": "off"}}
    url = cluster.env["RLBOOST_MANAGER_URL"]
    with httpx.Client(base_url=url, timeout=10) as client:
        run_id = client.post("/v1/runs", json=spec).json()["id"]
        victim = None
        end = time.monotonic() + 60
        while victim is None and time.monotonic() < end:
            busy = [i for i in client.get("/v1/instances").json()
                    if i["held"] > 0 and i["id"].startswith("spot")]
            if busy:
                victim = next(c for c in cluster.children if c.name == busy[0]["id"])
                metrics_port = busy[0]["metrics_port"]
            time.sleep(0.05)
        assert victim is not None, "no instance ever held work"
        time.sleep(0.3)  # let it commit a few chunks first
        victim.signal(signal.SIGSTOP)
        time.sleep(4.0)  # well past lease and instance TTL: it is presumed dead
        victim.signal(signal.SIGCONT)
        final = wait_run(client, run_id, 120, cluster)
        assert final["state"] == "succeeded", final
        by_step = check_run(client, run_id, spec, REWARD)
        records = step_records(client, run_id)
        # Whether the zombie's first act on waking is a publish (refused by the commit script)
        # or a heartbeat (whose reply makes it drop its work) is a race neither side controls;
        # either way it was fenced, and which one happened is printed.
        rejected = records[0]["stale_chunks_rejected"]
        dropped = victim_revocations(metrics_port)
        print(f"zombie: {rejected} stale chunks rejected by the commit script, "
              f"{dropped:.0f} responses it dropped itself")
        assert rejected > 0 or dropped > 0
        assert records[0]["preemptions"] >= 1
        for step, samples in by_step.items():
            for s in samples:
                assert s["response_token_ids"] == oracle(spec, s, step)
