"""The weight service's parts, made once per app and shared by its routes.

Contract: :class:`WeightService` holds the store (which builds each version's delta at commit,
counted by outcome), the metrics, the registry of peers serving a
version, the link its downloads share (``RLBOOST_WEIGHTS_EGRESS_BYTES_S``), the ``sendfile`` data
plane, the NATS announcer and a lock per run (a commit's
collection and a pin of the same run never interleave). It holds the tokens the data plane and
the API's guard accept: the read token and the write token read, the write token writes.
:meth:`WeightService.start` (sweep what a killed upload left, count the versions on disk, start
the announcer and the data plane) and :meth:`WeightService.stop` are the app's lifespan.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Gauge

from shared.config import WeightsConfig
from shared.settings import reveal
from shared.weights.range_server import Link
from weight_svc.announce import Announcer
from weight_svc.peers import DataPlane, PeerRegistry, bind_host
from weight_svc.store import Store, StoreLimits

log = logging.getLogger("weight_svc.app")  # the API's log, one name whichever module writes


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.bytes_served = Counter("rlboost_weights_bytes_served", "File bytes sent", registry=r)
        self.bytes_received = Counter("rlboost_weights_bytes_received", "Upload bytes", registry=r)
        self.uploads = Counter("rlboost_weights_uploads", "Files uploaded", registry=r)
        self.commits = Counter("rlboost_weights_commits", "Versions published", registry=r)
        self.collected = Counter("rlboost_weights_collected", "Versions collected", registry=r)
        self.announced = Counter("rlboost_weights_announced", "Versions announced", registry=r)
        self.errors = Counter("rlboost_weights_errors", "Error replies", ["status"], registry=r)
        self.deltas = Counter(
            "rlboost_weights_deltas", "Delta builds at commit: kept, too_large or failed",
            ["outcome"], registry=r
        )
        self.versions = Gauge(
            "rlboost_weights_versions", "Versions on disk", ["run_id"], registry=r
        )


class WeightService:
    def __init__(self, cfg: WeightsConfig, limits: StoreLimits | None = None) -> None:
        """``limits`` default to the configured ones (tests pass small chunks)."""
        self.cfg = cfg
        self.metrics = Metrics()
        self.store = Store(cfg.common.data_dir, limits or StoreLimits.of(cfg),
                           lambda outcome: self.metrics.deltas.labels(outcome).inc())
        write, read = reveal(cfg.token), reveal(cfg.read_token)
        self.readers = [t for t in (read, write) if t]  # tokens that read
        self.writers = [write] if write else []  # tokens that write
        self.peers = PeerRegistry()
        self.host = bind_host(cfg.common.weights_url)
        # One link for both ports' downloads (RLBOOST_WEIGHTS_EGRESS_BYTES_S); None: no limit.
        self.link = Link(cfg.egress_bytes_s) if cfg.egress_bytes_s > 0 else None
        self.data = DataPlane(self.store, self.host, cfg.data_port, self.readers,
                              self.metrics.bytes_served.inc, cfg.max_connections,
                              cfg.common.tls.server(), self.link)
        self.announcer = Announcer(cfg.common.nats_url, cfg.common.tls.client())
        self.run_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        nats_up = Gauge(
            "rlboost_weights_nats_connected", "1 if NATS is connected",
            registry=self.metrics.registry
        )
        nats_up.set_function(lambda: float(self.announcer.connected))

    def count_versions(self, run_id: str) -> None:
        self.metrics.versions.labels(run_id).set(len(self.store.versions(run_id)))

    async def start(self) -> None:
        await asyncio.to_thread(self.store.sweep)
        for run_id in await asyncio.to_thread(self.store.runs):
            self.count_versions(run_id)
        self.announcer.start()
        self.data.start()
        log.info("data plane (sendfile downloads) on port %d", self.data.port)

    async def stop(self) -> None:
        await asyncio.to_thread(self.data.close)
        await self.announcer.close()
