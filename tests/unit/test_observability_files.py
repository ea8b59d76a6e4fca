"""The compose profile ``observability``: Prometheus scrapes every service where it serves
/metrics, and Grafana is provisioned with the shipped data source and dashboard.

Which metric names the dashboard may use is checked against a running stack in
tests/system/test_observe.py; this file checks the wiring without one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    return doc


def env_of(svc: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in (svc.get("environment") or {}).items()}


def test_prometheus_scrapes_every_service_where_it_serves_metrics() -> None:
    services = compose()["services"]
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    targets: dict[str, set[str]] = {}
    for job in prom["scrape_configs"]:
        for static in job.get("static_configs", []):
            targets.setdefault(job["job_name"], set()).update(static["targets"])
        for dns in job.get("dns_sd_configs", []):
            targets.setdefault(job["job_name"], set()).update(
                f"{name}:{dns['port']}" for name in dns["names"])
    ours = {n: s for n, s in services.items() if s.get("command", [""])[0] == "python"}
    assert set(ours) == {"manager", "weights", "trainer", "rollout"}
    for name, svc in ours.items():
        env = env_of(svc)
        if name in ("manager", "weights"):  # /metrics on the REST port of its own URL
            url = env["RLBOOST_MANAGER_URL" if name == "manager" else "RLBOOST_WEIGHTS_URL"]
            port = url.rsplit(":", 1)[1]
        else:  # the exporter of shared.metrics, reachable from the compose network
            port = env["RLBOOST_METRICS_PORT"]
            assert env["RLBOOST_METRICS_ADDR"] == "0.0.0.0", name
        assert f"{name}:{port}" in targets.get(name, set()), (name, targets)
    # The REST services guard /metrics off loopback: Prometheus sends each one's own token,
    # from a compose secret made from that service's variable.
    secrets = compose()["secrets"]
    mounted = set(services["prometheus"]["secrets"])
    for job in prom["scrape_configs"]:
        name = job["job_name"]
        if name in ("manager", "weights"):
            secret = job["authorization"]["credentials_file"].removeprefix("/run/secrets/")
            assert secret in mounted, name
            var = secrets[secret]["environment"]
            assert var == {"manager": "RLBOOST_API_TOKEN",
                           "weights": "RLBOOST_WEIGHTS_READ_TOKEN"}[name]
            assert var in env_of(services[name]), name  # the token that service accepts
        else:
            assert "authorization" not in job, name
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["observability"]
    assert prom["scrape_configs"][-1]["dns_sd_configs"][0]["type"] == "A"  # every replica


def test_grafana_is_provisioned_with_the_shipped_dashboard() -> None:
    grafana = compose()["services"]["grafana"]
    mounts = {inside: host for host, inside, *_ in (v.split(":") for v in grafana["volumes"])}
    assert (COMPOSE / mounts["/etc/grafana/provisioning"].removeprefix("./")).is_dir()
    source = yaml.safe_load((COMPOSE / "grafana/provisioning/datasources/prometheus.yml")
                            .read_text())["datasources"][0]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    provider = yaml.safe_load((COMPOSE / "grafana/provisioning/dashboards/rlboost.yml")
                              .read_text())["providers"][0]
    inside = provider["options"]["path"]
    host = COMPOSE / mounts[inside].removeprefix("./")
    dashboard = json.loads((host / "rlboost.json").read_text())
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == \
        f"{inside}/rlboost.json"
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
    # Nobody logs in: viewers only, and so no admin password is shipped or needed.
    assert grafana["environment"]["GF_AUTH_DISABLE_LOGIN_FORM"] == "true"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert grafana["ports"] == ["127.0.0.1:3000:3000"]
