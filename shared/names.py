"""Every NATS subject and Redis key, built in this one place.

Subjects (core NATS unless marked JetStream):
    rlb.inst.heartbeat.<id>.<fp>  instance -> manager, request/reply (Heartbeat -> HeartbeatReply)
    rlb.inst.release.<id>.<fp>  instance -> manager, request/reply (Release -> Ack)
    rlb.inst.assign.<id>.<fp>   manager -> one instance (Assign, Revoke)
    rlb.chunk.<run>.<id>.<fp>   instance -> manager, JetStream stream RLB_CHUNKS (TokenFrame)
    rlb.trainer.<verb>          trainer -> manager, request/reply
                                (poll|start|samples|finish|fail|record|warn|extend|close|
                                tools|answer)
    rlb.evt.group.<run>         manager -> trainer, best effort (GroupDone)
    rlb.evt.handoff.<run>       manager -> trainer, best effort (Handoff): seeding window over
    rlb.evt.barrier.<run>       manager -> trainer, best effort (Barrier); the trainer also polls
    rlb.weights.announce        weight service -> anyone (WeightsAnnounce)
    _INBOX.inst.<id>.>          replies to one instance's requests (its nats-py inbox prefix)
    $SYS.REQ.USER.AUTH          NATS server -> manager: the auth callout (manager_svc.callout)

Every subject an instance sends on or listens to ends in (or holds) its own id, so the NATS
permissions the manager grants one instance (:func:`rollout_permissions`) name only its own
subjects, and the manager checks that the id in a message equals the one in its subject: with
the shipped NATS config an instance can neither read another's work nor speak in its name.
``<fp>`` is the :func:`fingerprint` of the process's own NATS key: the auth callout grants a
login the subjects of its key alone, so a process that still holds a connection under an id
after the id passed to a newer process (its binding lapsed while it was cut off) reads none
of the newer one's assignments (their per-lease MAC keys) and speaks in none of its beats,
releases or chunks (its garbage never counts toward the newer one's quarantine). The manager
sends to the fingerprint the instance's accepted beats named. An instance that names none
(``rlb.inst.heartbeat.<id>``: a test's client, an image before the fingerprint) is served on
the id's bare subjects where the callout is off, and refused where it is on.
Instance ids follow :data:`INSTANCE_ID_PATTERN` everywhere (settings, messages, subjects, keys).
"""

from __future__ import annotations

import re

PREFIX = "rlb"
TOKENS_SUFFIX = ":tokens"  # Keys.tokens; the scripts get it from manager_svc.scripts
LOGPROBS_SUFFIX = ":logprobs"  # Keys.logprobs; likewise
RUN_INSTANCES_SUFFIX = ":instances"  # Keys.run_instances, after the run key
CHUNK_STREAM = "RLB_CHUNKS"
CHUNK_CONSUMER = "manager"

HEARTBEAT_ANY = f"{PREFIX}.inst.heartbeat.>"  # <id> or <id>.<fp>: subject_owner reads which
RELEASE_ANY = f"{PREFIX}.inst.release.>"
TRAINER_POLL = f"{PREFIX}.trainer.poll"
TRAINER_START = f"{PREFIX}.trainer.start"
TRAINER_SAMPLES = f"{PREFIX}.trainer.samples"
TRAINER_FINISH = f"{PREFIX}.trainer.finish"
TRAINER_FAIL = f"{PREFIX}.trainer.fail"
TRAINER_RECORD = f"{PREFIX}.trainer.record"
TRAINER_WARN = f"{PREFIX}.trainer.warn"
TRAINER_EXTEND = f"{PREFIX}.trainer.extend"  # dynamic sampling: more prompts for a step
TRAINER_CLOSE = f"{PREFIX}.trainer.close"  # dynamic sampling: the step's groups are decided
TRAINER_TOOLS = f"{PREFIX}.trainer.tools"  # agentic runs: claim awaited environment calls
TRAINER_ANSWER = f"{PREFIX}.trainer.answer"  # agentic runs: an environment's answer
WEIGHTS_ANNOUNCE = f"{PREFIX}.weights.announce"
CHUNK_WILDCARD = f"{PREFIX}.chunk.>"
AUTH_CALLOUT = "$SYS.REQ.USER.AUTH"
INBOX = "_INBOX"  # nats-py's default inbox prefix; the manager answers requests there alone

# One id shape for every rollout instance: a NATS subject token and a Redis key part that
# cannot collide with another key (no ':', '.', '*', '>', spaces), of bounded length.
INSTANCE_ID_MAX = 64
INSTANCE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
# "<run>:<step>:<prompt>:<sample>", the run id as the weight service checks it
REQUEST_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}:[0-9]{1,9}:[0-9]{1,9}:[0-9]{1,9}$"
_INSTANCE_ID = re.compile(INSTANCE_ID_PATTERN)
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)
# A key's fingerprint: 16 base32 characters of the public nkey after its role letter, 80 bits
# of the key, which no other process can match by making keys until one does. lua/beat.lua
# reads the same characters (2 to 17) of the key an id is bound to.
FINGERPRINT_LEN = 16
_FINGERPRINT = re.compile(f"[A-Z2-7]{{{FINGERPRINT_LEN}}}")


def valid_instance_id(instance_id: str) -> bool:
    return _INSTANCE_ID.fullmatch(instance_id) is not None


def valid_request_id(rid: str) -> bool:
    return _REQUEST_ID.fullmatch(rid) is not None


def fingerprint(public_nkey: str) -> str:
    """The part of a process's public user nkey that its instance subjects carry."""
    return public_nkey[1:1 + FINGERPRINT_LEN]


def _keyed(subject: str, fp: str) -> str:
    return f"{subject}.{fp}" if fp else subject


def assign_subject(instance_id: str, fp: str = "") -> str:
    return _keyed(f"{PREFIX}.inst.assign.{instance_id}", fp)


def heartbeat_subject(instance_id: str, fp: str = "") -> str:
    return _keyed(f"{PREFIX}.inst.heartbeat.{instance_id}", fp)


def release_subject(instance_id: str, fp: str = "") -> str:
    return _keyed(f"{PREFIX}.inst.release.{instance_id}", fp)


def chunk_subject(run_id: str, instance_id: str, fp: str = "") -> str:
    return _keyed(f"{PREFIX}.chunk.{run_id}.{instance_id}", fp)


def inbox_prefix(instance_id: str) -> str:
    """The instance's nats-py inbox prefix: replies to it are readable by it alone. (By any
    process logged in under the id, whatever its key: heartbeat replies and acks carry no
    secret, and a stale image must read its refusal there.)"""
    return f"{INBOX}.inst.{instance_id}"


def is_own_inbox(instance_id: str, subject: str) -> bool:
    """Whether ``subject`` is in ``instance_id``'s inbox (a reply the instance itself awaits)."""
    return subject.startswith(inbox_prefix(instance_id) + ".")


def subject_instance(subject: str) -> str:
    """The instance id a bare instance subject ends in."""
    return subject.rsplit(".", 1)[-1]


def chunk_sender(subject: str) -> tuple[str, str]:
    """(instance id, key fingerprint or "") of a ``rlb.chunk.<run>.<id>[.<fp>]`` subject;
    ("", "") for any other shape."""
    parts = subject.split(".")
    if len(parts) == 4:
        return parts[3], ""
    if len(parts) == 5 and _FINGERPRINT.fullmatch(parts[4]) is not None:
        return parts[3], parts[4]
    return "", ""


def subject_owner(subject: str) -> tuple[str, str]:
    """(instance id, key fingerprint or "") of a ``rlb.inst.<verb>.<id>[.<fp>]`` subject;
    ("", "") for any other shape."""
    parts = subject.split(".")
    if len(parts) not in (4, 5) or parts[:2] != [PREFIX, "inst"] or \
            not valid_instance_id(parts[3]):
        return "", ""
    fp = parts[4] if len(parts) == 5 else ""
    if len(parts) == 5 and _FINGERPRINT.fullmatch(fp) is None:
        return "", ""
    return parts[3], fp


def rollout_permissions(instance_id: str, fp: str) -> tuple[list[str], list[str]]:
    """(publish, subscribe) allowed to the rollout process of key fingerprint ``fp`` under
    ``instance_id``: its own subjects, and the version announcements; no JetStream API
    (publishing to the stream needs none). Its id's bare heartbeat subject too, where the
    manager answers an image that names no fingerprint with why it is refused."""
    publish = [heartbeat_subject(instance_id), heartbeat_subject(instance_id, fp),
               release_subject(instance_id, fp), chunk_subject("*", instance_id, fp)]
    subscribe = [assign_subject(instance_id, fp), f"{inbox_prefix(instance_id)}.>",
                 WEIGHTS_ANNOUNCE]
    return publish, subscribe


def group_subject(run_id: str) -> str:
    return f"{PREFIX}.evt.group.{run_id}"


def handoff_subject(run_id: str) -> str:
    return f"{PREFIX}.evt.handoff.{run_id}"


def barrier_subject(run_id: str) -> str:
    return f"{PREFIX}.evt.barrier.{run_id}"


def request_id(run_id: str, step: int, prompt_index: int, sample_index: int) -> str:
    return f"{run_id}:{step}:{prompt_index}:{sample_index}"


def call_id(request_id: str, turn: int) -> str:
    """The id of a trajectory's tool call at ``turn`` (0-based): ``<request id>:<turn>``, a pure
    function of (run, step, prompt, sample, turn), so a call run again after a fault carries the
    same id and a tool with side effects can dedupe on it."""
    if turn < 0:
        raise ValueError(f"turn must be >= 0, got {turn}")
    return f"{request_id}:{turn}"


def parse_request_id(rid: str) -> tuple[str, int, int, int]:
    run_id, step, prompt, sample = rid.rsplit(":", 3)
    return run_id, int(step), int(prompt), int(sample)


def tag(run_id: str) -> str:
    """A run's Redis hash tag: Redis Cluster places every key holding ``{<run>}`` on the slot
    of ``<run>``, so every key of a run is on one slot and one script may reach any of them.
    Run ids hold no braces (``REQUEST_ID_PATTERN``), so the tag is exactly the run id."""
    return "{" + run_id + "}"


def _tagged(prefix: str, rid: str) -> str:
    """``<prefix>{<run>}:<step>:<prompt>:<sample>``: a response's key, in its run's slot (the
    scripts build the same in keys.lua)."""
    run_id, rest = rid.split(":", 1)
    return f"{prefix}{{{run_id}}}:{rest}"


# Key prefixes the scripts build keys from (keys.lua, as constants: manager_svc.scripts).
REQUEST_PREFIX = f"{PREFIX}:req:"
LEASE_PREFIX = f"{PREFIX}:lease:"
HELD_PREFIX = f"{PREFIX}:held:"
RUN_PREFIX = f"{PREFIX}:run:"
# The control keys (run index and queue, the active run, instances and their liveness, the
# dispatch lease) share one tag, so the scripts that change several of them at once (a run's
# queueing and activation, a heartbeat's registration) stay on one slot of a Redis Cluster.
CONTROL = f"{{{PREFIX}}}"


class Keys:
    """Redis keys. Everything the control plane knows lives under these, never only in memory.

    Two kinds, so that Redis Cluster can hold them: every key of one run carries the run's
    hash tag (:func:`tag`: its run record, steps, responses, leases, the sets of what each
    instance holds in it), and every control key carries :data:`CONTROL`. No script reaches
    keys of both kinds, nor of two runs (tests/system/test_redis_cluster.py runs a whole run
    on a 3-node cluster)."""

    runs = f"{CONTROL}:runs"  # zset run id -> creation time
    queue = f"{CONTROL}:runq"  # list of queued run ids, FIFO
    expiring = f"{CONTROL}:runs:expiring"  # zset ended run id -> when its keys expire (ms)
    active = f"{CONTROL}:active"  # the run now being trained
    instances = f"{CONTROL}:instances"  # set of instance ids ever seen and not yet reaped
    dispatch_leader = f"{CONTROL}:leader:dispatch"  # the manager replica that dispatches

    @staticmethod
    def run(run_id: str) -> str:
        return RUN_PREFIX + tag(run_id)

    @staticmethod
    def step(run_id: str, step: int) -> str:
        return f"{PREFIX}:step:{tag(run_id)}:{step}"

    @staticmethod
    def pending(run_id: str, step: int) -> str:
        """Set of request ids of the step waiting for an instance."""
        return Keys.step(run_id, step) + ":pending"

    @staticmethod
    def leased(run_id: str, step: int) -> str:
        """Set of request ids of the step held under a lease."""
        return Keys.step(run_id, step) + ":leased"

    @staticmethod
    def done(run_id: str, step: int) -> str:
        """Set of request ids of the step whose response is complete."""
        return Keys.step(run_id, step) + ":done"

    @staticmethod
    def tooling(run_id: str, step: int) -> str:
        """Set of request ids of the step whose model turn ended and whose environment's
        answer (the next observation, or the end) is awaited: leased to nobody meanwhile."""
        return Keys.step(run_id, step) + ":tool"

    @staticmethod
    def dropped(run_id: str, step: int) -> str:
        """Set of request ids of the step that dynamic sampling left out of its training data
        (complete but not kept, or aborted in flight); kept so their hashes are deleted too."""
        return Keys.step(run_id, step) + ":dropped"

    @staticmethod
    def step_sets(run_id: str, step: int) -> list[str]:
        """Every set of the step's request ids: whatever state a response is in, it is in one
        of these (what cleanup walks)."""
        return [Keys.done(run_id, step), Keys.pending(run_id, step),
                Keys.leased(run_id, step), Keys.dropped(run_id, step),
                Keys.tooling(run_id, step)]

    @staticmethod
    def seeding(run_id: str) -> str:
        """The seeding controller's measurements and current window for a run."""
        return f"{PREFIX}:seeding:{tag(run_id)}"

    @staticmethod
    def step_records(run_id: str) -> str:
        """List of finished-step records (JSON), index == step."""
        return f"{PREFIX}:steps:{tag(run_id)}"

    @staticmethod
    def samples(run_id: str, step: int) -> str:
        """JSON list of the samples the trainer trained on, rewards included."""
        return f"{PREFIX}:samples:{tag(run_id)}:{step}"

    @staticmethod
    def run_warnings(run_id: str) -> str:
        """List of warnings about a run (a tracker that did not start), oldest first."""
        return Keys.run(run_id) + ":warnings"

    @staticmethod
    def quarantined(run_id: str) -> str:
        """Hash instance id -> why it gets no more work in the run (with a TTL of its own)."""
        return Keys.run(run_id) + ":quarantined"

    @staticmethod
    def events(run_id: str) -> str:
        """Capped stream of the run's instance events: join, version, leave, death."""
        return f"{PREFIX}:events:{tag(run_id)}"

    @staticmethod
    def run_instances(run_id: str) -> str:
        """Hash instance id -> "session|weight version" last seen in the run (for its events)."""
        return Keys.run(run_id) + RUN_INSTANCES_SUFFIX

    @staticmethod
    def holders(run_id: str) -> str:
        """Set of the instances ever leased a response of the run: whose held sets it has."""
        return Keys.run(run_id) + ":holders"

    @staticmethod
    def request(rid: str) -> str:
        return _tagged(REQUEST_PREFIX, rid)

    @staticmethod
    def tokens(rid: str) -> str:
        """A response's committed tokens as CSV, a string of its own so that a commit APPENDs:
        Redis logs a script by its effects, and a hash field would be rewritten whole, the
        append-only file growing with the square of the response's length."""
        return Keys.request(rid) + TOKENS_SUFFIX

    @staticmethod
    def logprobs(rid: str) -> str:
        """A response's behaviour log-probs, appended with its tokens: 8 hex digits per token
        (float32, little-endian), absent where no entry carried any."""
        return Keys.request(rid) + LOGPROBS_SUFFIX

    @staticmethod
    def response(rid: str) -> tuple[str, str, str]:
        """Every key one response owns (its hash, tokens and log-probs): what dropping it
        deletes."""
        return Keys.request(rid), Keys.tokens(rid), Keys.logprobs(rid)

    @staticmethod
    def lease(rid: str) -> str:
        """"<instance>:<epoch>" with a TTL; its absence means the response is not owned."""
        return _tagged(LEASE_PREFIX, rid)

    @staticmethod
    def held(run_id: str, instance_id: str) -> str:
        """Set of the run's request ids leased to the instance (one set per run, so that a
        lease, a commit or a revocation changes keys of its run alone)."""
        return f"{HELD_PREFIX}{tag(run_id)}:{instance_id}"

    @staticmethod
    def instance(instance_id: str) -> str:
        """Hash with a TTL: an instance is alive while this key exists."""
        return f"{CONTROL}:inst:{instance_id}"

    @staticmethod
    def identity(instance_id: str) -> str:
        """"<kind>:<public nkey>" of the process that holds this id, kind from its credential
        (TTL'd like the instance)."""
        return f"{CONTROL}:identity:{instance_id}"

    @staticmethod
    def credential_ids(kind: str) -> str:
        """Set of the instance ids logged in with the rollout credential of ``kind`` (the
        callout's cap on live ids per credential; members whose identity ended are pruned)."""
        return f"{CONTROL}:identities:{kind}"

    @staticmethod
    def chunk_key() -> str:
        """The manager's secret for per-lease chunk MAC keys, made once (manager_svc.chunk_auth)."""
        return f"{CONTROL}:chunk-key"

    @staticmethod
    def departed(instance_id: str) -> str:
        """Session of the process under this id that released and left (short TTL)."""
        return f"{CONTROL}:departed:{instance_id}"
