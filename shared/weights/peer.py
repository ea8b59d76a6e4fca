"""Peer fan-out, serving side: a rollout instance hands its verified chunks to other instances.

Contract: a :class:`PeerServer` serves, from this instance's weights directory,
    GET /v1/peer/<run>/<version>/files/<name>   one chunk-aligned ``Range`` -> 206 (sendfile)
    GET /v1/peer/<run>/<version>/have           {"complete": bool, "chunks": [index, ...],
                                                 "fetching": [index, ...]}
and nothing else. It serves only bytes it has verified: a complete pulled version (its final
directory, published by :func:`shared.weights.pull.pull_version` after every chunk matched), or,
while a pull is running, exactly the chunks that pull recorded as verified (chunk-level
availability, so joiners that start together feed each other); ``fetching`` lists the chunks that
pull has in flight from the service, so other joiners wait for them instead of fetching the same
bytes from the service at the same time. Any other range is 404. It requires the weights
read token when one is set (checked before anything else; at most
``range_server.MAX_CONNECTIONS`` connections at once), binds RLBOOST_PEER_ADDR (default
127.0.0.1) on
RLBOOST_PEER_PORT (default any free port; both read by :class:`shared.config.PeerConfig`), and
announces itself to the weight service
(``POST /v1/weights/<run>/<version>/peers``) for every version it serves, refreshing every
``REFRESH_S`` (the service forgets a peer after 60 s) until the version is gone from disk.

With TLS (RLBOOST_TLS_CERT_FILE: the peer certificate of ``rlboost certs``) it serves HTTPS and
announces ``https://``; with a CA but no certificate it announces nothing, since pullers that
use TLS send their token to no plain-text peer (:mod:`shared.tls`).

The address it announces: RLBOOST_PEER_URL when set (``http(s)://host:port``, e.g. the machine's
address where a container's port is published); else, bound to a wildcard (0.0.0.0), the local
address this host reaches the weight service from, which its neighbours can reach too; else the
bound address. A loopback address is announced only to a weight service on loopback: to any
other, peers on other machines (or in other containers) could not connect to it, so fan-out is
off for that instance and its joiners simply fetch from the service.

Peers are never trusted: the puller verifies every chunk against the service's manifest.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from shared.config import PeerConfig
from shared.errors import ConfigError
from shared.tls import Tls
from shared.weights.manifest import MANIFEST_NAME, Chunk, Manifest, chunks_of
from shared.weights.partial import local_manifest
from shared.weights.range_server import RangeError, RangeServer

log = logging.getLogger(__name__)

REFRESH_S = 20.0
PEER_PREFIX = "/v1/peer"


@dataclass(slots=True)
class _Offer:
    """A pull in progress: which chunks of which directory are verified so far."""

    manifest: Manifest
    chunks: list[Chunk]
    directory: Path
    done: set[int]  # shared with the Partial that records verified chunks
    fetching: Callable[[], list[int]]  # chunks the pull has in flight from the service


WILDCARDS = ("0.0.0.0", "")  # the chunk server is IPv4 (http.server's default)


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def route_ip(url: str) -> str:
    """The local IPv4 address this host sends from towards ``url``'s host (no packet is sent).

    IPv4 only, as the chunk server listens: a service name that resolves to IPv6 first would
    otherwise be answered with an address nobody can connect to. May block on DNS."""
    parts = urlsplit(url)
    try:
        *_, addr = socket.getaddrinfo(parts.hostname or "127.0.0.1", parts.port or 80,
                                      family=socket.AF_INET, type=socket.SOCK_DGRAM)[0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except (OSError, ValueError):
        return "127.0.0.1"  # no route (now): announced to nobody but a service on loopback


# What the weight service accepts as a peer's URL (weight_svc.peers): a host name or an IPv4
# address and a port, nothing more, since every joiner connects to it as given.
PEER_URL_RE = re.compile(r"https?://[A-Za-z0-9.\-]{1,253}:\d{1,5}")


def peer_url_problem(url: object) -> str | None:
    """Why ``url`` is no peer URL, or None if it is one."""
    if not isinstance(url, str) or PEER_URL_RE.fullmatch(url) is None:
        return f"peer url must be http(s)://host:port, got {str(url)[:100]!r}"
    if not 0 < int(url.rsplit(":", 1)[1]) < 65536:
        return f"peer url has an invalid port: {url!r}"
    return None


def check_url(url: str, name: str) -> None:
    """At start-up, the rule the weight service applies at every registration."""
    if (problem := peer_url_problem(url)) is not None:
        raise ConfigError(name, problem)


class PeerServer:
    def __init__(
        self, weights_dir: Path, token: str | None, host: str = "127.0.0.1", port: int = 0,
        advertise: str | None = None, tls: Tls | None = None,
    ) -> None:
        self.weights_dir = weights_dir
        self.token = token
        self.tls = tls or Tls()
        self._scheme = "https" if self.tls.serving else "http"
        self._offers: dict[tuple[str, int], _Offer] = {}
        self._finals: dict[tuple[str, int], Manifest] = {}
        self._adverts: dict[tuple[str, str, int], None] = {}  # (service url, run, version)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._refresher: threading.Thread | None = None
        self.bytes_served = 0
        self.server = RangeServer(
            host, port, PEER_PREFIX, self._resolve, [token] if token else [], self._count,
            json_hook=self._json, range_hook=self._check_range, tls=self.tls.server(),
        )
        self.url = advertise or f"{self._scheme}://{host}:{self.server.port}"
        self._wildcard = host in WILDCARDS
        self._explicit = advertise is not None
        self._refused: set[str] = set()  # services told nothing: our URL is loopback to them

    @classmethod
    def from_config(cls, weights_dir: Path, token: str | None, cfg: PeerConfig,
                    tls: Tls | None = None) -> PeerServer:
        if cfg.url is not None:
            check_url(cfg.url, "RLBOOST_PEER_URL")
        return cls(weights_dir, token, cfg.addr, cfg.port, cfg.url, tls)

    @classmethod
    def from_env(
        cls, weights_dir: Path, token: str | None, env: Mapping[str, str] | None = None
    ) -> PeerServer:
        return cls.from_config(weights_dir, token, PeerConfig.from_env(env))

    def start(self) -> None:
        self.server.start()
        if self._refresher is None:
            self._refresher = threading.Thread(
                target=self._refresh, name="peer-refresh", daemon=True
            )
            self._refresher.start()

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        if self._refresher is not None:
            self._refresher.join()
            self._refresher = None
        self.server.close()

    # --- what this instance holds --------------------------------------------------------

    def offer(self, run_id: str, version: int, manifest: Manifest, directory: Path,
              done: set[int], fetching: Callable[[], list[int]] = list) -> None:
        """Serve the verified chunks of a pull in progress (``done`` grows as it runs)."""
        offer = _Offer(manifest, chunks_of(manifest), directory, done, fetching)
        with self._lock:
            self._offers[(run_id, version)] = offer

    def withdraw(self, run_id: str, version: int) -> None:
        """The pull ended: from now on only a complete final directory is served."""
        with self._lock:
            self._offers.pop((run_id, version), None)

    def url_for(self, service_url: str) -> str | None:
        """The URL to announce to ``service_url``; None where peers could not reach it, or
        would not (TLS on, no certificate to serve it with)."""
        if self.tls.on and not self.tls.serving:
            return None
        url = self.url
        if self._wildcard and not self._explicit:
            url = f"{self._scheme}://{route_ip(service_url)}:{self.server.port}"
        if _is_loopback(url) and not _is_loopback(service_url):
            with self._lock:
                first = service_url not in self._refused
                self._refused.add(service_url)
            if first:
                log.info("peer fan-out off towards %s: this instance would be announced as %s, "
                         "which other machines cannot reach (set RLBOOST_PEER_ADDR=0.0.0.0 or "
                         "RLBOOST_PEER_URL)", service_url, url)
            return None
        return url

    def advertise(self, service_url: str, run_id: str, version: int) -> None:
        """Register with the service now (in the background) and keep the entry fresh. Where
        to announce is decided at each refresh, off the caller's thread: it may take a DNS
        lookup, and a route that failed once may come back."""
        with self._lock:
            self._adverts[(service_url, run_id, version)] = None
        self._wake.set()

    def _final(self, run_id: str, version: int) -> Path:
        return self.weights_dir / run_id / str(version)

    def _complete(self, run_id: str, version: int) -> Manifest | None:
        final = self._final(run_id, version)
        with self._lock:
            cached = self._finals.get((run_id, version))
        if cached is not None and (final / MANIFEST_NAME).is_file():
            return cached  # a final directory never changes; it can only disappear
        manifest = local_manifest(final, run_id, version)
        with self._lock:
            if manifest is None:
                self._finals.pop((run_id, version), None)
            else:
                self._finals[(run_id, version)] = manifest
        return manifest

    # --- the server's hooks (run in its threads) -------------------------------------------

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_served += n

    def _resolve(self, run_id: str, version: int, name: str) -> Path:
        if self._complete(run_id, version) is not None:
            return self._final(run_id, version) / name
        with self._lock:
            offer = self._offers.get((run_id, version))
        if offer is None or all(f["name"] != name for f in offer.manifest["files"]):
            raise RangeError(404, f"{run_id}/{version}/{name} is not held here")
        return offer.directory / name

    def _check_range(self, run_id: str, version: int, name: str, start: int, end: int) -> None:
        if self._complete(run_id, version) is not None:
            return
        with self._lock:
            offer = self._offers.get((run_id, version))
            ok = offer is not None and any(
                c.name == name and c.offset == start and c.offset + c.size == end
                and c.number in offer.done for c in offer.chunks
            )
        if not ok:
            raise RangeError(404, f"{name} bytes {start}-{end - 1}: not a verified chunk here")

    def _json(self, run_id: str, version: int, what: str) -> object:
        if what != "have":
            raise RangeError(404, f"no route {what[:40]!r}")
        if self._complete(run_id, version) is not None:
            return {"complete": True, "chunks": []}
        with self._lock:
            offer = self._offers.get((run_id, version))
        if offer is None:
            raise RangeError(404, f"{run_id}/{version} is not held here")
        # Fetching first: a chunk is recorded done before it leaves the fetching list, so read
        # in this order it is in at least one of them, never missing from both.
        fetching = offer.fetching()
        with self._lock:
            chunks = sorted(offer.done)
        return {"complete": False, "chunks": chunks, "fetching": fetching}

    # --- registration with the service --------------------------------------------------------

    def _servable(self, run_id: str, version: int) -> bool:
        with self._lock:
            if (run_id, version) in self._offers:
                return True
        return (self._final(run_id, version) / MANIFEST_NAME).is_file()

    def _refresh(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        with httpx.Client(headers=headers, timeout=5.0, verify=self.tls.verify()) as client:
            while not self._closed.is_set():
                self._wake.clear()  # before reading: a wake from now on means another round
                with self._lock:
                    adverts = list(self._adverts)
                announce: dict[str, str | None] = {}  # per service, once a round: it may be DNS
                for service_url, run_id, version in adverts:
                    if not self._servable(run_id, version):
                        with self._lock:
                            self._adverts.pop((service_url, run_id, version), None)
                        continue
                    url = f"{service_url}/v1/weights/{run_id}/{version}/peers"
                    try:  # best effort: an unregistered peer costs egress, not correctness
                        if service_url not in announce:
                            announce[service_url] = self.url_for(service_url)
                        if (mine := announce[service_url]) is not None:
                            client.post(url, json={"url": mine}).raise_for_status()
                    except httpx.HTTPError as exc:
                        log.info("registering as a peer of %s/%d failed: %s", run_id, version, exc)
                self._wake.wait(REFRESH_S)
