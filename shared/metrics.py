"""Prometheus ``/metrics`` for services that have no REST server of their own (trainer, rollout).

Each service owns a registry (no process globals) and serves it on RLBOOST_METRICS_PORT
(0 = any free port, reported by the service) at RLBOOST_METRICS_ADDR (loopback by default: a
spot machine sits on a network we do not control).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


def serve_metrics(registry: CollectorRegistry, addr: str, port: int) -> int:
    """Start the exporter thread; returns the port it listens on."""
    server, _ = start_http_server(port, addr=addr, registry=registry)
    return int(server.server_port)
