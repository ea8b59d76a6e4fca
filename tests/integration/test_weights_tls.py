"""The weight service and peer fan-out over TLS: real ``python -m weight_svc`` serving HTTPS
with a certificate ``rlboost certs`` made, real PeerServers with the peer certificate.

A version goes up and comes down verified, through the REST port and the TLS data port; a
joiner takes chunks from a peer over TLS; a client without the CA is refused by the REST port,
the data port and a peer alike; a worker with a CA but no certificate announces itself to no
one, since pullers send their token to no plain-text peer.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rlboost.certs import make_certs
from shared.errors import WeightsError
from shared.ports import free_port
from shared.tls import Tls
from shared.weights import PeerServer, list_peers, pull_version, upload_version
from tests.integration.test_weight_svc import REPO, service_env
from tests.integration.test_weights_client import assert_same_files, make_model

TOKEN = "tls-tok"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs") / "c").directory


def tls_of(certs: Path, stem: str | None = None) -> Tls:
    if stem is None:
        return Tls(certs / "ca.pem")
    return Tls(certs / "ca.pem", certs / f"{stem}.pem", certs / f"{stem}-key.pem")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, certs: Path) -> Iterator[str]:
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    env = service_env(tmp_path_factory.mktemp("svc"), port, TOKEN, RLBOOST_WEIGHTS_URL=url,
                      RLBOOST_TLS_CA_FILE=str(certs / "ca.pem"),
                      RLBOOST_TLS_CERT_FILE=str(certs / "server.pem"),
                      RLBOOST_TLS_KEY_FILE=str(certs / "server-key.pem"))
    proc = subprocess.Popen([sys.executable, "-m", "weight_svc"], cwd=REPO, env=env)
    ca = tls_of(certs).client()
    assert ca is not None
    try:
        for _ in range(300):
            assert proc.poll() is None, "weight_svc exited"
            try:
                if httpx.get(f"{url}/healthz", timeout=0.5, verify=ca).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def data_port(url: str, ca: ssl.SSLContext, run_id: str) -> int:
    r = httpx.get(f"{url}/v1/weights/{run_id}/1/manifest", verify=ca,
                  headers={"Authorization": f"Bearer {TOKEN}"})
    return int(r.headers["x-rlboost-data-port"])


async def test_a_version_goes_up_and_down_over_tls(service: str, certs: Path,
                                                   tmp_path: Path) -> None:
    tls = tls_of(certs)
    model = make_model(tmp_path / "model", 600_000)
    await upload_version(service, TOKEN, "up", 1, model, tls=tls)
    out = await pull_version(service, TOKEN, "up", 1, tmp_path / "a", tls=tls)
    assert_same_files(model, out)
    ca = tls.client()
    assert ca is not None
    port = data_port(service, ca, "up")
    # The data port is TLS too: a plain request gets no HTTP answer, one with the CA gets 206.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as plain:
        plain.sendall(b"GET /v1/weights/up/1/files/config.json HTTP/1.1\r\nHost: x\r\n\r\n")
        assert not plain.recv(100).startswith(b"HTTP/")
    r = httpx.get(f"https://127.0.0.1:{port}/v1/weights/up/1/files/config.json", verify=ca,
                  headers={"Authorization": f"Bearer {TOKEN}", "Range": "bytes=0-3"})
    assert r.status_code == 206 and r.content == (model / "config.json").read_bytes()[:4]


async def test_a_client_without_the_ca_is_refused(service: str, certs: Path,
                                                  tmp_path: Path) -> None:
    await upload_version(service, TOKEN, "noca", 1, make_model(tmp_path / "m", 1000),
                         tls=tls_of(certs))
    with pytest.raises(WeightsError, match="CERTIFICATE_VERIFY_FAILED"):
        await pull_version(service, TOKEN, "noca", 1, tmp_path / "a", timeout_s=1)
    ca = tls_of(certs).client()
    assert ca is not None
    port = data_port(service, ca, "noca")
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://127.0.0.1:{port}/v1/weights/noca/1/files/config.json")


async def test_a_joiner_takes_chunks_from_a_peer_over_tls(service: str, certs: Path,
                                                          tmp_path: Path) -> None:
    tls = tls_of(certs)
    model = make_model(tmp_path / "model", 2_000_000)
    await upload_version(service, TOKEN, "fan", 1, model, tls=tls)
    peer = PeerServer(tmp_path / "a", TOKEN, tls=tls_of(certs, "peer"))
    peer.start()
    try:
        assert peer.url.startswith("https://")
        await pull_version(service, TOKEN, "fan", 1, tmp_path / "a", serve=peer, tls=tls)
        for _ in range(100):  # the peer registers in the background
            if await list_peers(service, TOKEN, "fan", 1, tls=tls) == [peer.url]:
                break
            await asyncio.sleep(0.05)
        out = await pull_version(service, TOKEN, "fan", 1, tmp_path / "b", peers=True, tls=tls)
        assert_same_files(model, out)
        assert peer.bytes_served > 1_000_000  # most of it came from the peer, over TLS
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{peer.url}/v1/peer/fan/1/have")
    finally:
        peer.close()


def test_a_worker_without_a_certificate_announces_nothing(certs: Path, tmp_path: Path) -> None:
    service = "https://10.0.0.1:8001"  # another machine: peers would dial our address
    bare = PeerServer(tmp_path / "a", TOKEN, host="0.0.0.0", tls=tls_of(certs))
    plain = PeerServer(tmp_path / "b", TOKEN, host="0.0.0.0")
    try:
        assert bare.url_for(service) is None
        assert plain.url_for(service) is not None  # the same worker without TLS would
    finally:
        bare.server.server_close()
        plain.server.server_close()
