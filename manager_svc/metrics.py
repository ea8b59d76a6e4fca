"""Prometheus metrics of the manager, on a registry owned by the service (no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ManagerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.chunks = Counter(
            "rlboost_chunks_total", "Token chunks received, by commit outcome", ["result"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "rlboost_tokens_committed_total", "Tokens committed exactly once",
            registry=self.registry,
        )
        self.discarded = Counter(
            "rlboost_tokens_discarded_total", "Tokens of responses that dynamic sampling "
            "aborted or left out of a closed step (never trained on)", registry=self.registry,
        )
        self.forged = Counter(
            "rlboost_forged_chunks_rejected_total", "Chunks not from their lease holder (bad "
            "MAC, or another instance's subject), rejected before any commit",
            registry=self.registry,
        )
        self.logins = Counter(
            "rlboost_nats_logins_total", "Rollout logins answered by the auth callout",
            ["result"], registry=self.registry,
        )
        self.malformed = Counter(
            "rlboost_malformed_messages_total", "Bus messages dropped because they do not parse",
            ["subject"], registry=self.registry,
        )
        self.assignments = Counter(
            "rlboost_assignments_total", "Responses leased to an instance", registry=self.registry,
        )
        self.revocations = Counter(
            "rlboost_lease_revocations_total", "Leases taken back, by reason", ["reason"],
            registry=self.registry,
        )
        # Series at zero from the start, so a dashboard's rate() has them before the first loss.
        for reason in ("preempt", "shutdown", "dead", "expired", "lost", "no_progress",
                       "engine_stuck", "backup"):
            self.revocations.labels(reason)
        self.instances = Gauge(
            "rlboost_instances_alive", "Rollout instances with a live heartbeat", ["kind"],
            registry=self.registry,
        )
        self.steps = Counter(
            "rlboost_steps_finished_total", "Training steps finished", registry=self.registry,
        )
        self.step_seconds = Histogram(
            "rlboost_step_seconds", "Wall time of a training step",
            buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600), registry=self.registry,
        )
        self.reward_errors = Counter(
            "rlboost_reward_errors_total", "Reward calls that raised or timed out (scored 0), "
            "as the trainer reported them", registry=self.registry,
        )
        self.handler_errors = Counter(
            "rlboost_handler_errors_total", "Bus handler failures (logged, not fatal)",
            ["subject"], registry=self.registry,
        )
        # Of several manager replicas, one commits the chunk stream and one dispatches (not
        # always the same one); each says here whether it is that one.
        self.ingest_pinned = Gauge(
            "rlboost_manager_ingest_active", "1 while this replica holds the chunk stream's pin",
            registry=self.registry,
        )
        self.dispatch_leader = Gauge(
            "rlboost_manager_dispatch_leader", "1 while this replica holds the dispatch lease",
            registry=self.registry,
        )
        self._screening()

    def _screening(self) -> None:
        """What the manager refuses of instances: foreign releases, kind claims, floods,
        stuck engines, garbage entries, quarantines, versions."""
        self.foreign_releases = Counter(
            "rlboost_foreign_releases_total",
            "Leases a release named that its sender did not hold: refused, the holder keeps them",
            registry=self.registry,
        )
        self.capacity_clamped = Counter(
            "rlboost_capacity_claims_clamped_total", "Heartbeats of spot instances declaring "
            "more capacity than RLBOOST_MAX_SPOT_CAPACITY: served at it", registry=self.registry,
        )
        self.kind_refused = Counter(
            "rlboost_kind_claims_refused_total", "Heartbeats (and token frames) claiming "
            "reserved from a spot rollout credential: served (counted) as spot",
            registry=self.registry,
        )
        self.shed = Counter(
            "rlboost_bus_messages_shed_total", "Bus requests dropped unanswered: another from "
            "the same instance already waiting (pending), or too many handlers running (busy)",
            ["reason"], registry=self.registry,
        )
        self.stuck_engines = Counter(
            "rlboost_stuck_engines_total", "Instances drained: their engine did not advance "
            "for the progress timeout while they held work", registry=self.registry,
        )
        self.rejected_entries = Counter(
            "rlboost_rejected_entries_total", "Frame entries dropped before any commit, by "
            "reason (vocabulary, offset, partial_token, mac, run, instance)", ["reason"],
            registry=self.registry,
        )
        self.quarantined = Counter(
            "rlboost_instances_quarantined_total", "Instances given no more work in a run, by "
            "cause (invalid entries, or an engine that cannot serve the run's model)",
            ["cause"], registry=self.registry,
        )
        self.protocol_refused = Counter(
            "rlboost_protocol_refused_total", "Heartbeats refused for another protocol version",
            registry=self.registry,
        )
        self.superseded = Counter(
            "rlboost_superseded_messages_total", "Heartbeats and releases refused because "
            "their sender's key does not hold their instance id (an older connection under "
            "the id, or an image that names no key), by message", ["message"],
            registry=self.registry,
        )
