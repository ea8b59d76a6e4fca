"""The weight service's side of peer fan-out: who can serve which version, and the data plane.

Contract:
- :class:`PeerRegistry` remembers, per (run, version), the URLs of rollout instances that serve
  chunks of it (``shared.weights.peer``). An entry lives ``PEER_TTL_S`` seconds unless the peer
  registers again (peers refresh every ``shared.weights.peer.REFRESH_S``). It is soft state, held
  only in memory on purpose: after a service restart the list is empty for at most one refresh
  period, which costs egress, never correctness (every chunk is verified against the service's
  manifest whoever serves it). URLs are validated (``http(s)://host:port``, nothing else) and the
  number of peers per version and of versions tracked is bounded.
- :class:`DataPlane` serves file downloads with ``sendfile`` on a second port of the same host
  (``RLBOOST_WEIGHTS_DATA_PORT``, 0 = any free port), advertised by the ``X-Rlboost-Data-Port``
  header of manifest replies. Same paths, same token, same egress counter as the REST API, which
  keeps serving downloads too (slowly) for clients that do not know the data plane. It takes
  the read or the write token, and serves at most RLBOOST_WEIGHTS_MAX_CONNECTIONS at once.
"""

from __future__ import annotations

import ipaddress
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from shared.weights.peer import peer_url_problem
from shared.weights.range_server import Link, RangeError, RangeServer
from weight_svc.store import Store, StoreError

PEER_TTL_S = 60.0
MAX_PEERS_PER_VERSION = 256
MAX_TRACKED_VERSIONS = 1024
DATA_PORT_HEADER = "X-Rlboost-Data-Port"


def bind_host(url: str) -> str:
    """The URL's host when it is an IP address (a loopback URL must not expose the store to the
    network), all interfaces when it is a DNS name (which names this machine from outside)."""
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return "0.0.0.0"


def check_peer_url(url: object) -> str:
    if (problem := peer_url_problem(url)) is not None:
        raise StoreError(422, problem)
    assert isinstance(url, str)  # peer_url_problem saw to it
    return url


class PeerRegistry:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._peers: dict[tuple[str, int], dict[str, float]] = {}  # -> url: expiry

    def register(self, run_id: str, version: int, url: str) -> float:
        """Add or refresh ``url``; returns the seconds it stays listed."""
        self._expire()
        key = (run_id, version)
        if key not in self._peers and len(self._peers) >= MAX_TRACKED_VERSIONS:
            raise StoreError(429, "too many versions with peers; try again later")
        peers = self._peers.setdefault(key, {})
        if url not in peers and len(peers) >= MAX_PEERS_PER_VERSION:
            raise StoreError(429, f"{run_id}/{version} already has {len(peers)} peers")
        peers[url] = self._clock() + PEER_TTL_S
        return PEER_TTL_S

    def peers(self, run_id: str, version: int) -> list[str]:
        """Live peers, longest-registered first (they are the likeliest to hold every chunk)."""
        self._expire()
        return list(self._peers.get((run_id, version), {}))

    def forget(self, run_id: str, versions: list[int]) -> None:
        for v in versions:  # collected versions: nobody may fetch them any more
            self._peers.pop((run_id, v), None)

    def _expire(self) -> None:
        now = self._clock()
        for key in list(self._peers):
            live = {u: t for u, t in self._peers[key].items() if t > now}
            if live:
                self._peers[key] = live
            else:
                del self._peers[key]


class DataPlane:
    """The sendfile download server over the store; start() binds, close() stops."""

    def __init__(
        self,
        store: Store,
        host: str,
        port: int,
        tokens: list[str],
        on_served: Callable[[int], None],
        max_connections: int,
        tls: ssl.SSLContext | None = None,
        link: Link | None = None,
    ) -> None:
        self.store = store
        self.server = RangeServer(host, port, "/v1/weights", self._resolve, tokens, on_served,
                                  max_connections=max_connections, tls=tls, link=link)

    @property
    def port(self) -> int:
        return self.server.port

    def _resolve(self, run_id: str, version: int, name: str) -> Path:
        try:
            return self.store.file_path(run_id, version, name)
        except StoreError as exc:
            raise RangeError(exc.status, exc.detail) from None

    def start(self) -> None:
        self.server.start()

    def close(self) -> None:
        self.server.close()
