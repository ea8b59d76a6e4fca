"""``rlboost certs DIR``: a private CA and the certificates a deployment serves TLS with.

Contract: :func:`make_certs` writes into ``DIR``

    ca.pem              the CA: every service and client gets it (RLBOOST_TLS_CA_FILE)
    ca-key.pem          the CA's key: keep it off every machine that runs a service
    server.pem/-key.pem the manager, the weight service and NATS (client and cluster ports):
                        RLBOOST_TLS_CERT_FILE / RLBOOST_TLS_KEY_FILE of the reserved side
    peer.pem/-key.pem   a rollout instance's peer chunk server; named only
                        :data:`shared.tls.PEER_NAME`, so a spot machine holding it cannot
                        pass for a service

The server certificate names localhost, 127.0.0.1, ::1 and the compose services' hostnames
(:data:`SERVICE_NAMES`) plus each ``--host`` (a DNS name or an IP address): every name a client
dials a service by must be among them. Keys are EC P-256, written 0600 (the directory 0700).
Existing files are never overwritten unless ``force``: a second run that would replace a CA
clients already trust refuses, naming the file.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.tls import PEER_NAME

# What clients dial inside the compose networks (compose/*.yml), and on this machine.
SERVICE_NAMES = ("localhost", "127.0.0.1", "::1", "nats", "nats-2", "nats-3", "manager",
                 "manager-2", "weights")
CA_DAYS = 3650
LEAF_DAYS = 825  # the longest validity clients (Apple's, browsers) accept for a server cert
FILES = ("ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "peer.pem", "peer-key.pem")


Pair = tuple[x509.Certificate, ec.EllipticCurvePrivateKey]


class CertsError(Exception):
    pass


@dataclass(frozen=True)
class Issued:
    directory: Path
    names: tuple[str, ...]  # the server certificate's subject alternative names


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "rlboost"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _general(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _builder(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey,
             days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False))


def _ca() -> Pair:
    key = ec.generate_private_key(ec.SECP256R1())
    usage = x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                          content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, encipher_only=False,
                          decipher_only=False)
    cert = (_builder(_name("rlboost CA"), _name("rlboost CA"), key, CA_DAYS)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(usage, critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def _leaf(common: str, names: Sequence[str], ca: x509.Certificate,
          ca_key: ec.EllipticCurvePrivateKey) -> Pair:
    key = ec.generate_private_key(ec.SECP256R1())
    usage = x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                          content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, encipher_only=False,
                          decipher_only=False)
    # Client auth too: NATS cluster routes present this certificate to each other.
    purposes = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                      ExtendedKeyUsageOID.CLIENT_AUTH])
    authority = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    cert = (_builder(_name(common), ca.subject, key, LEAF_DAYS)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(purposes, critical=False)
            .add_extension(authority, critical=False)
            .add_extension(x509.SubjectAlternativeName([_general(n) for n in names]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)  # an existing file (--force) keeps its old mode through O_CREAT


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_certs(directory: Path, hosts: Sequence[str] = (), force: bool = False) -> Issued:
    """Write the CA, server and peer certificates into ``directory`` (see the module doc)."""
    for host in hosts:
        if not host or any(c.isspace() for c in host) or len(host) > 253:
            raise CertsError(f"--host {host!r}: not a DNS name or an IP address")
    existing = [name for name in FILES if (directory / name).exists()]
    if existing and not force:
        raise CertsError(f"{directory / existing[0]} exists: keep it (clients trust that CA), "
                         "or replace every file with --force")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    names = tuple(dict.fromkeys([*SERVICE_NAMES, *hosts]))
    ca, ca_key = _ca()
    server, server_key = _leaf("rlboost services", names, ca, ca_key)
    peer, peer_key = _leaf(PEER_NAME, [PEER_NAME], ca, ca_key)
    for stem, cert, key in (("ca", ca, ca_key), ("server", server, server_key),
                            ("peer", peer, peer_key)):
        _write(directory / f"{stem}-key.pem", _key_pem(key), 0o600)
        _write(directory / f"{stem}.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return Issued(directory, names)
