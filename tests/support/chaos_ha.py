"""The fault campaign's injector on clustered brokers (rlboost.ha_stack): the faults of a node.

:class:`HaInjector` is :class:`tests.support.chaos.Injector` with the broker faults of a
cluster in place of a lone server's restart, and no link or engine faults (the campaign on one
server has those): rollout instances SIGKILLed and SIGTERMed, a manager replica SIGKILLed and
started again, the Redis primary serving the run's keys (or the control keys) SIGKILLed until
its replica has taken its slots over and then started again as that replica's replica, and a
NATS node SIGKILLed for 1-3 s and started again. A broker fault counts only when it hit a live
process and, for Redis, once the promotion is seen: a failover that did not happen is no
failover.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from rlboost.ha_stack import HaStack
from rlboost.launcher import Cluster
from shared.names import Keys
from shared.ports import wait_port
from tests.support.chaos import Injector, hit

# Each redis_failover waits this long at most for a replica to take the slots over.
FAILOVER_S = 30.0


class HaInjector(Injector):
    def __init__(self, cluster: Cluster, ha: HaStack, seed: int, interval_s: float) -> None:
        super().__init__(cluster, ha, None, seed, interval_s,  # type: ignore[arg-type]
                         stall_bound_s=0.0)
        self.ha = ha
        self.failovers: list[float] = []  # seconds from a primary's kill to its successor

    def restart_manager(self) -> bool:
        """SIGKILL one manager replica (either), then start it again."""
        managers = [c for c in self.cluster.children if c.name.startswith("manager")]
        victim = self.rng.choice(managers)
        done = hit(victim, signal.SIGKILL)
        victim.start()
        url = self.cluster.manager_urls[managers.index(victim)]
        wait_port(int(url.rsplit(":", 1)[1]), 30)
        return done

    def redis_failover(self) -> bool:
        """SIGKILL the primary serving the run's slot or the control slot; once a replica
        serves that slot, start the dead node again (it rejoins as the new primary's
        replica, which RLBOOST_REDIS_REPLICA_ACKS=1 waits for before it acks a commit)."""
        redis = self.ha.redis
        key = self.rng.choice([Keys.run(self.target), Keys.active])
        home = redis.primary_of(key)
        killed_at = time.monotonic()
        if not redis.kill(home):
            return False
        end = killed_at + FAILOVER_S
        while redis.primary_of(key) == home:
            if time.monotonic() > end:
                raise TimeoutError(f"no replica took {key}'s slot over from {home}")
            time.sleep(0.1)
        self.failovers.append(time.monotonic() - killed_at)
        redis.restart(home)
        end = time.monotonic() + FAILOVER_S
        while not redis.replicas_synced() and time.monotonic() < end:
            time.sleep(0.2)
        return True

    def nats_node_kill(self) -> bool:
        """SIGKILL one NATS node for 1-3 s, then start it again (as the same node: it
        catches the R3 chunk stream up from the other two before it reads healthy)."""
        node = self.rng.randrange(self.ha.nats.size)
        done = self.ha.nats.kill(node)
        time.sleep(self.rng.uniform(1.0, 3.0))
        self.ha.nats.restart(node)
        return done

    def kinds(self) -> list[tuple[str, Callable[[], bool], float]]:
        return [
            ("rollout_sigkill", self.kill_rollout, 0.2),
            ("rollout_sigterm", self.preempt_rollout, 0.1),
            ("manager_sigkill", self.restart_manager, 0.15),
            ("redis_failover", self.redis_failover, 0.3),
            ("nats_node_kill", self.nats_node_kill, 0.25),
        ]

    def _draw(self, kinds: list[tuple[str, Callable[[], bool], float]]
              ) -> tuple[str, Callable[[], bool], float]:
        return self.rng.choices(kinds, weights=[k[2] for k in kinds])[0]
