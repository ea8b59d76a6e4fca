"""TLS for NATS and HTTP: the one place RLBOOST_TLS_* files become ``ssl`` contexts.

Contract: :class:`Tls` holds the three files a service was given (``Common.tls``). With a CA,
every client connection this service makes (NATS, the manager's and the weight service's REST
APIs, the weights data plane) verifies the server against that CA and nothing else, by name;
with a certificate and key, the service's own listeners serve TLS. Nothing set: plain text,
which the REST services accept only on loopback (:func:`shared.http_guard.refuse_plain_bind`).

Peers of the weights fan-out (rollout instances serving verified chunks to each other) have no
stable names, so a connection to a peer checks that its certificate comes from the CA but not
its name (:meth:`Tls.peer_client`). What a peer serves is checked chunk by chunk against the
service's sha256 manifest anyway; TLS there keeps the read token and the weights private.
``rlboost certs DIR`` (:mod:`rlboost.certs`) writes a CA, the services' certificate and a
peer certificate whose only name is :data:`PEER_NAME`, so a peer cannot pass for the manager.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PEER_NAME = "rlboost-peer"  # the one name in a peer certificate: no service answers to it


@dataclass(frozen=True, slots=True)
class Tls:
    ca_file: Path | None = None  # set: clients verify servers against this CA
    cert_file: Path | None = None  # with key_file: this service's listeners serve TLS
    key_file: Path | None = None

    @classmethod
    def client_env(cls, env: Mapping[str, str] | None = None) -> Tls:
        """The CA alone, for a command-line client (``rlboost status``, ``export``) that reads
        its settings from the environment as it finds them (empty = unset)."""
        ca = (os.environ if env is None else env).get("RLBOOST_TLS_CA_FILE")
        return cls(ca_file=Path(ca) if ca else None)

    @property
    def on(self) -> bool:
        """Whether this process's clients speak TLS."""
        return self.ca_file is not None

    @property
    def serving(self) -> bool:
        return self.cert_file is not None and self.key_file is not None

    def client(self) -> ssl.SSLContext | None:
        """A context that trusts the CA only and checks the server's name; None without one."""
        if self.ca_file is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca_file))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx

    def peer_client(self) -> ssl.SSLContext | None:
        """As :meth:`client`, without the name check: peers are known by address only."""
        ctx = self.client()
        if ctx is not None:
            ctx.check_hostname = False
        return ctx

    def verify(self) -> ssl.SSLContext | bool:
        """httpx's ``verify``: the CA's context, or the system's trust store without one."""
        return self.client() or True

    def server(self) -> ssl.SSLContext | None:
        """The listeners' context (certificate and key); None where not serving."""
        if self.cert_file is None or self.key_file is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
        return ctx
