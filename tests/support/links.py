"""Every network link of a test cluster through its own fault proxy (tests.support.faultproxy).

Contract: :class:`Links` is a :class:`~rlboost.launcher.Cluster`'s ``per_child`` hook. As each
process starts it gets its own proxies and the URLs that point at them:

- the manager: its Redis and its NATS;
- the trainer: its NATS;
- a rollout instance: its NATS, and its weights link, which carries the weight service's REST
  port, its sendfile data port (``RLBOOST_WEIGHTS_DATA_PORT``, fixed here so the link can
  listen on it) and the instance's own peer chunk server (``RLBOOST_PEER_URL`` names the link,
  so joining peers reach it through it too: a partitioned instance serves no one).

The weight service itself is not proxied (it sits beside the trainer on the reserved side). A
process restarted under the same name (the manager) keeps its links.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from shared.ports import free_port
from tests.support.faultproxy import Hub, Link


def _port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


@dataclass
class ProcessLinks:
    name: str
    links: dict[str, Link] = field(default_factory=dict)  # "nats" | "redis" | "weights"


class Links:
    def __init__(self) -> None:
        self.hub = Hub()
        self.by_process: dict[str, ProcessLinks] = {}
        self.data_port = free_port()  # the weight service's data plane, behind each link

    def base_env(self) -> dict[str, str]:
        """What the whole cluster needs for its links to stand in every path."""
        return {"RLBOOST_WEIGHTS_DATA_PORT": str(self.data_port)}

    def __call__(self, name: str, env: dict[str, str]) -> dict[str, str]:
        if name == "weights":
            return {}
        if name in self.by_process:  # a restart: same process, same links
            return self._env(self.by_process[name], env)
        mine = ProcessLinks(name)
        mine.links["nats"] = self.hub.link(f"{name}/nats", [_port(env["RLBOOST_NATS_URL"])])
        if name == "manager":
            mine.links["redis"] = self.hub.link(f"{name}/redis",
                                                [_port(env["RLBOOST_REDIS_URL"])])
        elif name != "trainer":  # a rollout instance
            mine.links["weights"] = self.hub.link(
                f"{name}/weights", [_port(env["RLBOOST_WEIGHTS_URL"]), self.data_port,
                                    free_port()])
        self.by_process[name] = mine
        return self._env(mine, env)

    @staticmethod
    def _env(mine: ProcessLinks, env: dict[str, str]) -> dict[str, str]:
        out = {"RLBOOST_NATS_URL": mine.links["nats"].url(env["RLBOOST_NATS_URL"])}
        if "redis" in mine.links:
            out["RLBOOST_REDIS_URL"] = mine.links["redis"].url(env["RLBOOST_REDIS_URL"])
        if (weights := mine.links.get("weights")) is not None:
            out["RLBOOST_WEIGHTS_URL"] = weights.url(env["RLBOOST_WEIGHTS_URL"])
            peer_port = weights.ports[2]
            out["RLBOOST_PEER_PORT"] = str(peer_port)
            out["RLBOOST_PEER_URL"] = f"http://{weights.host}:{peer_port}"
        return out

    def of(self, name: str) -> dict[str, Link]:
        return self.by_process[name].links if name in self.by_process else {}

    def close(self) -> None:
        self.hub.close()
