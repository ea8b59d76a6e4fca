"""Configuration: one settings class per service, read from an injectable environment.

The names are the design's interface (compose files, docs and tests use them verbatim):
RLBOOST_NATS_URL, RLBOOST_REDIS_URL, RLBOOST_MANAGER_URL, RLBOOST_WEIGHTS_URL, RLBOOST_API_TOKEN,
RLBOOST_ENGINE, RLBOOST_INSTANCE_KIND, RLBOOST_DATA_DIR, RLBOOST_INSTANCE_ID. The tuning knobs
below them have defaults that suit one machine. Each field names its variable and says what it
does; the settings page (docs/settings.md) lists them all (a test holds the two together).

``XConfig.from_env(env)`` reads ``env`` (default os.environ) and raises ConfigError naming the
first bad variable; credentials are ``SecretStr`` (:func:`shared.settings.reveal` where one is
sent), and :meth:`~shared.settings.Settings.describe` is what a service logs at start-up. How a
setting is read, checked and masked lives in :mod:`shared.settings`.
"""

from __future__ import annotations

import re
import shlex
import socket
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlparse

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    FilePath,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import NoDecode

from shared.identity import IdentityError, public_key
from shared.names import INSTANCE_ID_MAX, valid_instance_id
from shared.settings import Settings, UrlOf, reveal, setting
from shared.sources import default_dataset_roots
from shared.tls import Tls

Engine = Literal["torch", "sglang", "emu"]
ENGINES: tuple[Engine, ...] = ("torch", "sglang", "emu")
NatsUrl = Annotated[str, UrlOf(("nats", "tls"), many=True)]
RedisUrl = Annotated[str, UrlOf(("redis", "rediss"))]
HttpUrl = Annotated[str, UrlOf(("http", "https"))]
Port = Annotated[int, Field(ge=0, le=65535)]  # 0 = any free port


def url_port(url: str, default: int) -> int:
    """The port a service listens on: the one in its own URL variable."""
    return urlparse(url).port or default


def _on_off(value: Any) -> Any:
    """'on' / 'off' (the ablation switches' spelling) as a bool; anything else is refused."""
    if isinstance(value, str):
        if value not in ("on", "off"):
            raise ValueError(f"one of on, off, got {value!r}")
        return value == "on"
    return value


def _shell_words(value: Any) -> Any:
    return tuple(shlex.split(value)) if isinstance(value, str) else value


class Common(Settings):
    """What every service reads: where the others are, credentials, data, logs, metrics."""

    nats_url: NatsUrl = setting(
        "RLBOOST_NATS_URL", "nats://127.0.0.1:4222", "the NATS server; several, comma-separated, "
        "for the nodes of a cluster (a client connects to any that answers)")
    redis_url: RedisUrl = setting(
        "RLBOOST_REDIS_URL", "redis://127.0.0.1:6379/0", "the Redis server (and database)")
    manager_url: HttpUrl = setting(
        "RLBOOST_MANAGER_URL", "http://127.0.0.1:8000", "the manager's REST API; it listens on "
        "this URL's port")
    weights_url: HttpUrl = setting(
        "RLBOOST_WEIGHTS_URL", "http://127.0.0.1:8001", "the weight service; it listens on this "
        "URL's port")
    api_token: SecretStr | None = setting(
        "RLBOOST_API_TOKEN", None, "REST bearer token; unset = open, allowed only where the "
        "manager listens on loopback (it refuses to start open beyond it)")
    weights_token: SecretStr | None = setting(
        "RLBOOST_WEIGHTS_TOKEN", None, "the weight service's write token: upload, commit, pin "
        "(the trainer; it reads too); unset with no read token = open, allowed only on a "
        "loopback URL (the weight service refuses to start without it beyond)")
    weights_read_token: SecretStr | None = setting(
        "RLBOOST_WEIGHTS_READ_TOKEN", None, "the weight service's read token: manifests, "
        "downloads, peer registration (rollout instances and their peers)")
    data_dir: Annotated[Path, AfterValidator(Path.resolve)] = setting(
        "RLBOOST_DATA_DIR", Path("./data"), "where a service keeps its files")
    dataset_roots: str = setting(
        "RLBOOST_DATASET_ROOTS", "", "colon-separated directories a run spec's dataset.path and "
        "eval.path must lie under (else 422 at submit, or the run fails); unset = "
        "RLBOOST_DATA_DIR and the shipped examples/ directory")
    log_level: Annotated[str, AfterValidator(str.upper)] = setting(
        "RLBOOST_LOG_LEVEL", "INFO", "Python logging level")
    torch_threads: Annotated[int | None, AfterValidator(lambda n: n or None)] = setting(
        "RLBOOST_TORCH_THREADS", None, "intra-op threads of torch services; 0 = torch's choice",
        ge=0)
    metrics_addr: str = setting(
        "RLBOOST_METRICS_ADDR", "127.0.0.1", "where trainer and rollout serve /metrics")
    metrics_port: int = setting(
        "RLBOOST_METRICS_PORT", 0, "port of that /metrics; 0 = any free port", ge=0)
    emu_time_scale: float = setting(
        "RLBOOST_EMU_TIME_SCALE", 1.0, "emu: multiplies every modelled GPU time", ge=0.0)
    emu_publish_s: float = setting(
        "RLBOOST_EMU_PUBLISH_S", 0.0, "emu: modelled seconds the trainer's publish of a version "
        "takes (write, hash, upload: shared.hardware.publish_seconds)", ge=0.0)
    emu_start_s: float = setting(
        "RLBOOST_EMU_START_S", 0.0, "emu: modelled seconds a spot process takes to start "
        "serving (VM boot + engine start: shared.hardware)", ge=0.0)
    emu_token_scale: int = setting(
        "RLBOOST_EMU_TOKEN_SCALE", 1, "emu: modelled tokens each emitted token stands for: the "
        "engine's decode steps, context and lengths, and the tokens the trainer trains on "
        "(reasoning lengths at a token rate two cores carry)", ge=1)
    expose: Literal["auto", "open", "token"] = setting(
        "RLBOOST_EXPOSE", "auto", "/metrics, /docs and /openapi.json of the manager and the "
        "weight service: open, behind the bearer token, or auto = open only on a loopback bind")
    tls_ca_file: FilePath | None = setting(
        "RLBOOST_TLS_CA_FILE", None, "CA certificate (PEM): set, every NATS and HTTP connection "
        "a service makes uses TLS and trusts this CA only (rlboost certs DIR makes one)")
    tls_cert_file: FilePath | None = setting(
        "RLBOOST_TLS_CERT_FILE", None, "certificate (PEM) the manager and the weight service "
        "serve HTTPS with (a rollout instance: its peer chunk server); needs the key")
    tls_key_file: FilePath | None = setting(
        "RLBOOST_TLS_KEY_FILE", None, "the private key (PEM) of that certificate")
    allow_plaintext: bool = setting(
        "RLBOOST_ALLOW_PLAINTEXT", False, "let the manager and the weight service serve plain "
        "HTTP beyond loopback (TLS ends at a proxy in front); unset, they refuse to")

    @model_validator(mode="after")
    def _cert_and_key(self) -> Self:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("RLBOOST_TLS_CERT_FILE and RLBOOST_TLS_KEY_FILE: set both or neither")
        return self

    @property
    def tls(self) -> Tls:
        return Tls(self.tls_ca_file, self.tls_cert_file, self.tls_key_file)

    @property
    def dataset_dirs(self) -> list[Path]:
        """The directories a run's dataset and eval files may be read from."""
        named = [Path(d) for d in self.dataset_roots.split(":") if d]
        return named or default_dataset_roots(self.data_dir)


class ManagerConfig(Settings):
    """The manager: leases, liveness, dispatch, migration and load balancing."""

    common: Common = Field(default_factory=Common)
    lease_ttl_s: float = setting(
        "RLBOOST_LEASE_TTL_S", 3.0, "a response whose lease is not renewed for this long is "
        "taken back", ge=0.2)
    instance_ttl_s: float = setting(
        "RLBOOST_INSTANCE_TTL_S", 3.0, "an instance silent for this long is dead", ge=0.2)
    dispatch_interval_s: float = setting(
        "RLBOOST_DISPATCH_INTERVAL_S", 0.05, "dispatch loop period (it also wakes on events)",
        ge=0.001)
    migration: Literal["token", "request"] = setting(
        "RLBOOST_MIGRATION", "token", "a moved response resumes from its committed tokens "
        "(token) or restarts (request: ablation)")
    rebalance_skew: int = setting(
        "RLBOOST_REBALANCE_SKEW", 2, "move work when the busiest instance has this many more "
        "responses than the idlest (0 = never)", ge=0)
    # Far above a healthy gap between two commits of a lease (chunk_tokens decode steps: ~0.1 s
    # on an emulated H100; the CPU engine's wave a new lease waits behind, seconds on the
    # embedded models; a resumed lease's re-prefill of a 32k context ~1 s), and above a Redis
    # or NATS restart, so only a hung or 100x-slowed engine meets it. It bounds what one hung
    # instance adds to a step (docs/invariants.md, "Hung and slow instances").
    progress_timeout_s: float = setting(
        "RLBOOST_PROGRESS_TIMEOUT_S", 30.0, "a lease that commits nothing this long while its "
        "holder heartbeats is revoked and its response migrates; an instance whose engine "
        "does not advance this long while holding work is drained; near a step's end a "
        "quarter of it (at least two instance TTLs) moves a lagging response to an idle "
        "instance. A hung instance adds at most about this + an instance TTL + 1 s + one "
        "response's regeneration to a step", ge=0.5)
    # Off is the ablation of pull-based weights: as if they were pushed at step boundaries.
    midstep_join: Annotated[bool, BeforeValidator(_on_off)] = setting(
        "RLBOOST_MIDSTEP_JOIN", "on", "on: an instance joining mid-step takes work at once; "
        "off: it waits for the next step (ablation)")
    issuer_seed: SecretStr | None = setting(
        "RLBOOST_NATS_ISSUER_SEED", None, "account nkey seed the NATS auth callout signs "
        "rollout identities with (its public key is NATS_ISSUER in nats.conf); unset = no "
        "callout")
    rollout_password: SecretStr | None = setting(
        "RLBOOST_NATS_ROLLOUT_PASSWORD", None, "the NATS password of user rollout, checked by "
        "the callout (NATS_ROLLOUT_PASSWORD); required with the issuer seed")
    # The kind an instance serves as comes from the password it logged in with, never from
    # its own heartbeat: a spot machine's credential cannot claim to be reserved.
    rollout_reserved_password: SecretStr | None = setting(
        "RLBOOST_NATS_ROLLOUT_RESERVED_PASSWORD", None, "the password of user rollout on "
        "reserved machines (NATS_ROLLOUT_RESERVED_PASSWORD): its logins serve as reserved, "
        "the rollout password's as spot; unset = every callout login is spot")
    max_instances_per_credential: int = setting(
        "RLBOOST_MAX_INSTANCES_PER_CREDENTIAL", 1024, "live instance ids one rollout "
        "password may hold at once; a login past it is refused", ge=1)
    max_spot_capacity: int = setting(
        "RLBOOST_MAX_SPOT_CAPACITY", 256, "responses a spot instance is leased at once at most, "
        "whatever capacity its heartbeats declare (a larger claim is served at this)", ge=1)
    max_body_bytes: int = setting(
        "RLBOOST_MAX_BODY_BYTES", 1 << 20, "a larger REST request body is refused with 413", ge=1)
    max_step_responses: int = setting(
        "RLBOOST_MAX_STEP_RESPONSES", 131_072, "a run spec with more responses per step "
        "(prompts_per_step x samples_per_prompt) is refused with 422", ge=1)
    retention_s: float = setting(
        "RLBOOST_RETENTION_S", 86_400.0, "a finished run's Redis keys expire this long after it "
        "ends; its archive in the data dir stays", ge=0)
    stream_replicas: int = setting(
        "RLBOOST_STREAM_REPLICAS", 1, "copies of the chunk stream a JetStream cluster keeps "
        "(3 on the compose profile \"ha\"'s 3-node cluster); 1 on one server", ge=1, le=5)
    stream_max_bytes: int = setting(
        "RLBOOST_STREAM_MAX_BYTES", 1 << 30, "bytes the chunk stream holds at most; full, it "
        "refuses new frames (their instances retry) and never drops stored ones", ge=1 << 20)
    redis_replica_acks: int = setting(
        "RLBOOST_REDIS_REPLICA_ACKS", 0, "Redis replicas a commit (and a finished step's "
        "record) must reach (WAIT) before it is acked: 1 with a replica per primary, so a "
        "failover loses no acked commit; 0 = off", ge=0, le=5)
    max_queued_runs: int = setting(
        "RLBOOST_MAX_QUEUED_RUNS", 100, "POST /v1/runs past this many queued runs is refused "
        "with 429", ge=1)
    quarantine_invalid: int = setting(
        "RLBOOST_QUARANTINE_INVALID", 16, "an instance that sends this many invalid or forged "
        "frame entries in a run is quarantined: its leases revoked, no more work in the run "
        "(0 = never)", ge=0)
    quarantine_ttl_s: float = setting(
        "RLBOOST_QUARANTINE_TTL_S", 3600.0, "a run's quarantines last this long after its "
        "latest one (state in Redis, kept across manager restarts)", ge=1.0)
    unserved_fail_s: float = setting(
        "RLBOOST_UNSERVED_FAIL_S", 60.0, "a run with work to do whose every live instance is "
        "quarantined (e.g. an emu engine on a non-emu model) for this long fails, its error "
        "naming why", ge=0.1)
    # A test hook, never set in production: fault tests place a manager crash inside one
    # multi-key change (step creation, the seeding hand-off) to show it completes on restart.
    crash_points: str = setting(
        "RLBOOST_CRASH_POINTS", "", "test hook: comma-separated points where the manager "
        "SIGKILLs itself, each once per data dir (unset in production)")

    @model_validator(mode="after")
    def _callout(self) -> Self:
        seed = reveal(self.issuer_seed)
        if seed is not None:
            try:
                key = public_key(seed)
            except IdentityError:
                key = ""
            if not key.startswith("A"):
                raise ValueError("RLBOOST_NATS_ISSUER_SEED: not an account nkey seed (SA...)")
            if self.rollout_password is None:
                raise ValueError("RLBOOST_NATS_ROLLOUT_PASSWORD: required with "
                                 "RLBOOST_NATS_ISSUER_SEED")
        return self


class PeerConfig(Settings):
    """A rollout instance's chunk server for joining peers (shared.weights.peer)."""

    addr: str = setting("RLBOOST_PEER_ADDR", "127.0.0.1", "address the peer chunk server binds")
    port: Port = setting("RLBOOST_PEER_PORT", 0, "its port; 0 = any free port")
    url: str | None = setting(
        "RLBOOST_PEER_URL", None, "the http://host:port peers are told to use (a published "
        "port); unset = derived from the bind address")


class RolloutConfig(Settings):
    """One rollout process: its engine, identity, streaming, preemption notices, peers."""

    common: Common = Field(default_factory=Common)
    peer: PeerConfig = Field(default_factory=PeerConfig)
    engine: Engine = setting(
        "RLBOOST_ENGINE", "torch", "the generation engine: torch, sglang or emu (emulated GPU)")
    kind: Literal["reserved", "spot"] = setting(
        "RLBOOST_INSTANCE_KIND", "spot", "reserved or spot")
    instance_id: str = setting(
        "RLBOOST_INSTANCE_ID", "", "this instance's stable name; unset = kind-host-random")
    heartbeat_s: float = setting(
        "RLBOOST_HEARTBEAT_S", 0.5, "heartbeat period; leases are renewed on each beat",
        ge=0.05)
    chunk_tokens: int = setting(
        "RLBOOST_CHUNK_TOKENS", 4, "flush interval: once a response has this many new tokens "
        "(or ends) the instance publishes one frame with every response's new tokens; a "
        "preempted response wastes at most this many", ge=1)
    max_batch: int = setting("RLBOOST_MAX_BATCH", 32, "responses generated concurrently", ge=1)
    grace_s: float = setting(
        "RLBOOST_GRACE_S", 30.0, "after a preemption notice, hand work back and leave within "
        "this", ge=0.0)
    notice: Literal["off", "aws", "gcp"] = setting(
        "RLBOOST_PREEMPTION_NOTICE", "off", "also poll this cloud's metadata server for "
        "preemption notices")
    metadata_url: str | None = setting(
        "RLBOOST_METADATA_URL", None, "that metadata server; unset = the cloud's own address")
    notice_poll_s: float = setting(
        "RLBOOST_NOTICE_POLL_S", 5.0, "how often to poll it", ge=0.05)
    seeded_bases: Path | None = setting(
        "RLBOOST_SEEDED_BASES_DIR", None, "LoRA bases in the instance's image: "
        "<dir>/<base_sha256>/ holds a base version's files, and an adapter version naming "
        "that content hash uses them (hashed once per process) instead of pulling its base; "
        "unset = every base is pulled")
    sglang_url: HttpUrl | None = setting(
        "RLBOOST_SGLANG_URL", None, "sglang: attach to this server; unset = start one")
    sglang_args: Annotated[tuple[str, ...], NoDecode, BeforeValidator(_shell_words)] = setting(
        "RLBOOST_SGLANG_ARGS", (), "sglang: extra launch_server flags (shell words)")
    instances: int = setting(
        "RLBOOST_EMU_INSTANCES", 1, "emu: instances served by this one process (ids get -0, "
        "-1, ...)", ge=1)
    emu_stall_after_s: float | None = setting(
        "RLBOOST_EMU_STALL_AFTER_S", None, "emu, fault tests: after this many seconds of "
        "generating the engine stops producing tokens while the process keeps heartbeating "
        "(a hung GPU); unset = never", ge=0.0)
    emu_slow_after_s: float | None = setting(
        "RLBOOST_EMU_SLOW_AFTER_S", None, "emu, fault tests: after this many seconds of "
        "generating every modelled decode step takes RLBOOST_EMU_SLOW_FACTOR times as long "
        "(an overloaded host); unset = never", ge=0.0)
    emu_slow_factor: float = setting(
        "RLBOOST_EMU_SLOW_FACTOR", 1000.0, "emu: that slow-down", ge=1.0)
    emu_model: str = setting(
        "RLBOOST_EMU_MODEL", "emu-8b", "emu: serving-cost preset (rollout_svc.engines.emu_models)")
    emu_true_context: Annotated[bool, BeforeValidator(_on_off)] = setting(
        "RLBOOST_EMU_TRUE_CONTEXT", "off", "emu, on: each sequence's KV read is charged at its "
        "own context (prompt + modelled position); off: at the preset's constant 4k tokens")
    emu_link: Annotated[bool, BeforeValidator(_on_off)] = setting(
        "RLBOOST_EMU_LINK", "off", "emu, on: weight updates as the simulator's paper regime "
        "has them: a spot instance's pull is the weight service's real transfer (over "
        "RLBOOST_WEIGHTS_EGRESS_BYTES_S) and its update charges only the load into HBM after "
        "it; a reserved instance pulls nothing (it swaps the trainer's weights in device "
        "memory). off: every instance pulls, and a spot update charges pull and load together")

    @field_validator("instance_id")
    @classmethod
    def _instance_id(cls, value: str, info: ValidationInfo) -> str:
        # Unset: a name that is new on each start; RLBOOST_INSTANCE_ID keeps one across restarts.
        if not value:
            host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40]
            value = f"{info.data.get('kind', 'spot')}-{host}-{uuid.uuid4().hex[:6]}"
        if not valid_instance_id(value):
            raise ValueError(f"letters, digits, '-' and '_' only, at most {INSTANCE_ID_MAX} "
                             "characters, starting with a letter or digit")
        return value

    @model_validator(mode="after")
    def _emu_ids(self) -> Self:
        # Several emu instances per process are named <id>-<k>: those names must be ids too.
        if not valid_instance_id(f"{self.instance_id}-{self.instances - 1}"):
            raise ValueError(f"RLBOOST_INSTANCE_ID: {self.instance_id!r} with the suffix "
                             f"-{self.instances - 1} is longer than {INSTANCE_ID_MAX}")
        return self


class TrainerConfig(Settings):
    """The trainer: its name and how often it polls the manager."""

    common: Common = Field(default_factory=Common)
    trainer_id: str = setting(
        "RLBOOST_TRAINER_ID", "", "the trainer's name; unset = trainer-<host>")
    poll_s: float = setting(
        "RLBOOST_TRAINER_POLL_S", 0.5, "how often the trainer polls for work and for the "
        "barrier", ge=0.01)
    reward_path: str = setting(
        "RLBOOST_REWARD_PATH", "", "colon-separated directories python:<module>:<function> "
        "rewards are imported from (no other module but the built-in trainer_svc.inputs.rewards)")
    reward_env: str = setting(
        "RLBOOST_REWARD_ENV", "", "comma-separated names of further environment variables reward "
        "workers get (a judge's API key); they get no other of the trainer's but PATH, HOME, "
        "locale, Python, HF offline and thread settings")
    tool_workers: int = setting(
        "RLBOOST_TOOL_WORKERS", 4, "agentic runs: environment worker processes beside the "
        "trainer (calls that run at once)", ge=1, le=256)
    reward_timeout_s: float = setting(
        "RLBOOST_REWARD_TIMEOUT_S", 10.0, "a reward call running longer scores 0 and counts as "
        "a reward error", gt=0.0)
    sharding: Literal["replicate", "fsdp2"] = setting(
        "RLBOOST_TRAINER_SHARDING", "replicate", "under torchrun: replicate (a full model and "
        "AdamW per rank) or fsdp2 (parameters, gradients and AdamW state sharded over ranks)")
    param_dtype: Literal["bfloat16", "float16", "float32", "model"] = setting(
        "RLBOOST_TRAINER_PARAM_DTYPE", "bfloat16", "fsdp2: the dtype layers compute in; master "
        "weights stay in the model's dtype (model = no cast)")
    reduce_dtype: Literal["bfloat16", "float32", "model"] = setting(
        "RLBOOST_TRAINER_REDUCE_DTYPE", "float32", "fsdp2: the dtype gradients are summed over "
        "ranks in (model = the compute dtype)")
    activation_checkpointing: bool = setting(
        "RLBOOST_TRAINER_ACTIVATION_CHECKPOINTING", False, "fsdp2: recompute each layer's "
        "activations in backward instead of keeping them")
    offload_optimizer: bool = setting(
        "RLBOOST_TRAINER_OFFLOAD_OPTIMIZER", False, "fsdp2: keep parameters, gradients and "
        "AdamW state in host memory (the optimizer step runs there)")

    @property
    def reward_dirs(self) -> list[str]:
        return [d for d in self.reward_path.split(":") if d]

    @property
    def reward_env_names(self) -> list[str]:
        return [n.strip() for n in self.reward_env.split(",") if n.strip()]

    @field_validator("trainer_id")
    @classmethod
    def _trainer_id(cls, value: str) -> str:
        return value or f"trainer-{socket.gethostname()}"


class WeightsConfig(Settings):
    """The weight service: retention, chunking, upload limit, data-plane port."""

    common: Common = Field(default_factory=Common)
    keep_last: int = setting(
        "RLBOOST_WEIGHTS_KEEP", 3, "versions kept per run (never fewer than the newest two, "
        "nor a pinned one)", ge=1)
    chunk_bytes: int = setting(
        "RLBOOST_WEIGHTS_CHUNK_BYTES", 4 << 20, "the unit of download, verification and resume",
        ge=1)
    max_file_bytes: int = setting(
        "RLBOOST_WEIGHTS_MAX_FILE_BYTES", 8 << 30, "a larger upload is refused with 413", ge=1)
    max_connections: int = setting(
        "RLBOOST_WEIGHTS_MAX_CONNECTIONS", 64, "concurrent connections of the sendfile data "
        "port (and of each peer chunk server); more are answered 503 at once", ge=1)
    data_port: Port = setting(
        "RLBOOST_WEIGHTS_DATA_PORT", 0, "port of the sendfile download server; 0 = any free "
        "port")
    egress_bytes_s: float = setting(
        "RLBOOST_WEIGHTS_EGRESS_BYTES_S", 0.0, "file bytes per second the service sends, "
        "shared by every download of both ports (one link); 0 = no limit", ge=0.0)
    peers: Annotated[bool, BeforeValidator(_on_off)] = setting(
        "RLBOOST_WEIGHTS_PEERS", "on", "off: no peer is listed, so every pull comes from the "
        "service alone (over its egress)")
    deltas: Annotated[bool, BeforeValidator(_on_off)] = setting(
        "RLBOOST_WEIGHTS_DELTAS", "on", "off: versions are published without a delta, so a "
        "holder of the version before pulls the next one in full")

    @property
    def token(self) -> SecretStr | None:
        """The write token (upload, commit, pin); it reads too."""
        return self.common.weights_token

    @property
    def read_token(self) -> SecretStr | None:
        """The read token (manifests, downloads, peer registration)."""
        return self.common.weights_read_token


# Every settings class by the service(s) that read it: docs/settings.md's table, row source.
SETTINGS: dict[str, type[Settings]] = {
    "all": Common,
    "manager": ManagerConfig,
    "rollout": RolloutConfig,
    "rollout (peers)": PeerConfig,
    "trainer": TrainerConfig,
    "weights": WeightsConfig,
}
