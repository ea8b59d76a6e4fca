"""``rlboost certs``: what it writes, what each certificate is good for, and what it refuses.

A TLS handshake against each written certificate (in memory, no network) shows the server
certificate passes for every service name and ``--host``, and the peer certificate passes for
none of them: a spot machine holding it cannot stand in for the manager.
"""

from __future__ import annotations

import contextlib
import ssl
from pathlib import Path

import pytest
from cryptography import x509

from rlboost.certs import SERVICE_NAMES
from rlboost.cli import main as cli
from shared.tls import PEER_NAME, Tls


def handshake(certs: Path, stem: str, name: str, check_name: bool = True) -> None:
    """A client trusting only the CA, asking for ``name``, meets a server showing ``stem``."""
    tls = Tls(certs / "ca.pem", certs / f"{stem}.pem", certs / f"{stem}-key.pem")
    server, client = tls.server(), tls.client() if check_name else tls.peer_client()
    assert server is not None and client is not None
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    s = server.wrap_bio(to_server, to_client, server_side=True)
    c = client.wrap_bio(to_client, to_server, server_hostname=name)
    for _ in range(10):
        for side in (c, s):
            with contextlib.suppress(ssl.SSLWantReadError):
                side.do_handshake()
        if c.version() is not None and s.version() is not None:
            return
    raise AssertionError("handshake did not finish")


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    assert cli(["certs", str(tmp_path / "c"), "--host", "rl.example.com",
                "--host", "203.0.113.7"]) == 0
    return tmp_path / "c"


def test_the_server_certificate_names_every_service_and_each_host(certs: Path) -> None:
    for name in (*SERVICE_NAMES, "rl.example.com", "203.0.113.7"):
        handshake(certs, "server", name)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(certs, "server", "elsewhere.example.com")


def test_the_peer_certificate_passes_for_no_service(certs: Path) -> None:
    handshake(certs, "peer", "10.1.2.3", check_name=False)  # how peers are dialled
    for name in ("manager", "weights", "nats", "127.0.0.1"):
        with pytest.raises(ssl.SSLCertVerificationError):
            handshake(certs, "peer", name)
    cert = x509.load_pem_x509_certificate((certs / "peer.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [PEER_NAME]


def test_a_certificate_from_another_ca_is_refused(certs: Path, tmp_path: Path) -> None:
    assert cli(["certs", str(tmp_path / "other")]) == 0
    for stem in ("server", "server-key"):
        (certs / f"{stem}.pem").write_bytes((tmp_path / "other" / f"{stem}.pem").read_bytes())
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(certs, "server", "manager")


def test_keys_are_private_and_nothing_is_overwritten_unasked(
        certs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for stem in ("ca", "server", "peer"):
        assert (certs / f"{stem}-key.pem").stat().st_mode & 0o777 == 0o600
        assert (certs / f"{stem}.pem").stat().st_mode & 0o777 == 0o644
    assert certs.stat().st_mode & 0o777 == 0o700
    ca = (certs / "ca.pem").read_bytes()
    assert cli(["certs", str(certs)]) == 1
    assert "exists" in capsys.readouterr().err
    assert (certs / "ca.pem").read_bytes() == ca
    (certs / "ca-key.pem").chmod(0o644)
    assert cli(["certs", str(certs), "--force"]) == 0
    assert (certs / "ca.pem").read_bytes() != ca
    assert (certs / "ca-key.pem").stat().st_mode & 0o777 == 0o600


def test_a_bad_host_is_refused(tmp_path: Path) -> None:
    assert cli(["certs", str(tmp_path / "c"), "--host", "two words"]) == 1
    assert not (tmp_path / "c").exists()
