"""The stack with TLS on, from certificates the shipped command makes.

``rlboost certs`` writes a CA and certificates; NATS runs compose/nats-tls.conf (TLS first,
the shipped roles and callout), the manager and the weight service serve HTTPS, rollout
instances serve their peers HTTPS, and every client verifies against the CA. A torch run goes
through every link (trainer -> weights upload, rollout <- weights data port and peers, chunks
over NATS) and succeeds with the invariants held. A client without the CA gets nowhere: NATS
and both REST services fail its certificate check, and a client that speaks plain text to
NATS is never let in (a service that would serve plain text beyond loopback refuses to start:
tests/integration/test_auth.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest

from rlboost.cli import main as cli
from rlboost.launcher import Cluster
from rlboost.stack import Stack
from shared.bus import split_credentials
from shared.ports import free_port
from shared.tls import Tls
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run

pytestmark = pytest.mark.slow

SPEC = {"steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2, "seed": 5,
        "max_new_tokens": 8}


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    directory = tmp_path / "certs"
    assert cli(["certs", str(directory)]) == 0
    return directory


@pytest.fixture
def stack(tmp_path: Path, certs: Path) -> Iterator[Stack]:
    s = Stack.create(tmp_path / "brokers", locked=True, tls=certs)
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def cluster(stack: Stack, tmp_path: Path) -> Iterator[Cluster]:
    env = {"RLBOOST_MANAGER_URL": f"https://127.0.0.1:{free_port()}",
           "RLBOOST_WEIGHTS_URL": f"https://127.0.0.1:{free_port()}"}
    c = start_cluster(tmp_path, stack, env=env, spot=1, reserved=1)
    try:
        yield c
    finally:
        c.stop()


async def nats_refusals(stack: Stack) -> dict[str, str]:
    """How NATS answers a client with the system's CAs, and one in plain text."""
    url, password = split_credentials(stack.nats.url_for("trainer"))
    assert url.startswith("tls://")
    found: dict[str, str] = {}
    for what, options in (("no CA", {"tls_handshake_first": True}),
                          ("plain text", {"servers": [url.replace("tls://", "nats://")]})):
        try:
            nc = await nats.connect(**{"servers": [url], **options}, user="trainer",
                                    password=password, allow_reconnect=False,
                                    max_reconnect_attempts=0, connect_timeout=2)
            await nc.close()
            found[what] = "connected"
        except Exception as exc:
            found[what] = f"{type(exc).__name__}: {exc}"
    # The same login with the CA gets in: the refusals above are TLS, not the password.
    nc = await nats.connect(url, user="trainer", password=password, allow_reconnect=False,
                            tls=Tls(Path(stack.env()["RLBOOST_TLS_CA_FILE"])).client(),
                            tls_handshake_first=True, connect_timeout=2)
    found["with the CA"] = "connected" if nc.is_connected else "not connected"
    await nc.close()
    return found


def test_a_run_over_tls_succeeds_and_a_client_without_the_ca_is_refused(
        cluster: Cluster, stack: Stack, certs: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    manager, weights = cluster.env["RLBOOST_MANAGER_URL"], cluster.env["RLBOOST_WEIGHTS_URL"]
    ca = Tls(certs / "ca.pem").client()
    assert ca is not None
    with httpx.Client(base_url=manager, timeout=10, verify=ca) as client:
        run = client.post("/v1/runs", json=SPEC).json()
        final = wait_run(client, run["id"], 300, cluster)
        assert final["state"] == "succeeded", final
        check_run(client, run["id"], SPEC)
    # The CLI talks to the manager with RLBOOST_TLS_CA_FILE as the services do.
    monkeypatch.setenv("RLBOOST_MANAGER_URL", manager)
    monkeypatch.setenv("RLBOOST_TLS_CA_FILE", str(certs / "ca.pem"))
    assert cli(["runs"]) == 0 and run["id"] in capsys.readouterr().out
    for url in (manager, weights):
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/healthz", timeout=5)
        with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP to a TLS port
            httpx.get(f"{url.replace('https', 'http')}/healthz", timeout=5)
    refused = asyncio.run(nats_refusals(stack))
    assert "CERTIFICATE_VERIFY_FAILED" in refused["no CA"], refused
    assert refused["plain text"] != "connected", refused
    assert refused["with the CA"] == "connected", refused

