"""Every NATS subject and Redis key, built in this one place.

Subjects (core NATS unless marked JetStream):
    rlb.inst.heartbeat          instance -> manager, request/reply (Heartbeat -> HeartbeatReply)
    rlb.inst.release            instance -> manager, request/reply (Release -> Ack)
    rlb.inst.assign.<id>        manager -> one instance (Assign)
    rlb.chunk.<run>             instance -> manager, JetStream stream RLB_CHUNKS (TokenChunk)
    rlb.trainer.<verb>          trainer -> manager, request/reply (poll|start|samples|finish|fail)
    rlb.evt.group.<run>         manager -> trainer, best effort (GroupDone)
    rlb.evt.handoff.<run>       manager -> trainer, best effort (Handoff): seeding window over
    rlb.evt.barrier.<run>       manager -> trainer, best effort (Barrier); the trainer also polls
    rlb.weights.announce        weight service -> anyone (WeightsAnnounce)
"""

from __future__ import annotations

PREFIX = "rlb"
CHUNK_STREAM = "RLB_CHUNKS"
CHUNK_CONSUMER = "manager"

HEARTBEAT = f"{PREFIX}.inst.heartbeat"
RELEASE = f"{PREFIX}.inst.release"
TRAINER_POLL = f"{PREFIX}.trainer.poll"
TRAINER_START = f"{PREFIX}.trainer.start"
TRAINER_SAMPLES = f"{PREFIX}.trainer.samples"
TRAINER_FINISH = f"{PREFIX}.trainer.finish"
TRAINER_FAIL = f"{PREFIX}.trainer.fail"
WEIGHTS_ANNOUNCE = f"{PREFIX}.weights.announce"
CHUNK_WILDCARD = f"{PREFIX}.chunk.>"


def assign_subject(instance_id: str) -> str:
    return f"{PREFIX}.inst.assign.{instance_id}"


def chunk_subject(run_id: str) -> str:
    return f"{PREFIX}.chunk.{run_id}"


def group_subject(run_id: str) -> str:
    return f"{PREFIX}.evt.group.{run_id}"


def handoff_subject(run_id: str) -> str:
    return f"{PREFIX}.evt.handoff.{run_id}"


def barrier_subject(run_id: str) -> str:
    return f"{PREFIX}.evt.barrier.{run_id}"


def request_id(run_id: str, step: int, prompt_index: int, sample_index: int) -> str:
    return f"{run_id}:{step}:{prompt_index}:{sample_index}"


def parse_request_id(rid: str) -> tuple[str, int, int, int]:
    run_id, step, prompt, sample = rid.rsplit(":", 3)
    return run_id, int(step), int(prompt), int(sample)


class Keys:
    """Redis keys. Everything the control plane knows lives under these, never only in memory."""

    runs = f"{PREFIX}:runs"  # zset run id -> creation time
    queue = f"{PREFIX}:runq"  # list of queued run ids, FIFO
    active = f"{PREFIX}:active"  # the run now being trained
    instances = f"{PREFIX}:instances"  # set of instance ids ever seen and not yet reaped

    @staticmethod
    def run(run_id: str) -> str:
        return f"{PREFIX}:run:{run_id}"

    @staticmethod
    def step(run_id: str, step: int) -> str:
        return f"{PREFIX}:step:{run_id}:{step}"

    @staticmethod
    def pending(run_id: str, step: int) -> str:
        """Set of request ids of the step waiting for an instance."""
        return f"{PREFIX}:step:{run_id}:{step}:pending"

    @staticmethod
    def leased(run_id: str, step: int) -> str:
        """Set of request ids of the step held under a lease."""
        return f"{PREFIX}:step:{run_id}:{step}:leased"

    @staticmethod
    def done(run_id: str, step: int) -> str:
        """Set of request ids of the step whose response is complete."""
        return f"{PREFIX}:step:{run_id}:{step}:done"

    @staticmethod
    def seeding(run_id: str) -> str:
        """The seeding controller's measurements and current window for a run."""
        return f"{PREFIX}:seeding:{run_id}"

    @staticmethod
    def step_records(run_id: str) -> str:
        """List of finished-step records (JSON), index == step."""
        return f"{PREFIX}:steps:{run_id}"

    @staticmethod
    def samples(run_id: str, step: int) -> str:
        """JSON list of the samples the trainer trained on, rewards included."""
        return f"{PREFIX}:samples:{run_id}:{step}"

    @staticmethod
    def request(rid: str) -> str:
        return f"{PREFIX}:req:{rid}"

    @staticmethod
    def lease(rid: str) -> str:
        """"<instance>:<epoch>" with a TTL; its absence means the response is not owned."""
        return f"{PREFIX}:lease:{rid}"

    @staticmethod
    def instance(instance_id: str) -> str:
        """Hash with a TTL: an instance is alive while this key exists."""
        return f"{PREFIX}:inst:{instance_id}"

    @staticmethod
    def departed(instance_id: str) -> str:
        """Session of the process under this id that released and left (short TTL)."""
        return f"{PREFIX}:departed:{instance_id}"

    @staticmethod
    def instance_held(instance_id: str) -> str:
        """Set of request ids leased to the instance."""
        return f"{PREFIX}:inst:{instance_id}:held"
