"""Configuration: one object per service, read from an injectable environment, validated once.

The names are the design's interface (compose files, docs and tests use them verbatim):
RLBOOST_NATS_URL, RLBOOST_REDIS_URL, RLBOOST_MANAGER_URL, RLBOOST_WEIGHTS_URL, RLBOOST_API_TOKEN,
RLBOOST_ENGINE, RLBOOST_INSTANCE_KIND, RLBOOST_DATA_DIR, RLBOOST_INSTANCE_ID. The tuning knobs
below them have defaults that suit one machine; each is documented where it is read.
"""

from __future__ import annotations

import os
import shlex
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlparse

from shared.errors import ConfigError

Engine = Literal["torch", "sglang", "emu"]
ENGINES: tuple[Engine, ...] = ("torch", "sglang", "emu")
_NATS, _REDIS, _HTTP = ("nats", "tls"), ("redis", "rediss"), ("http", "https")


def _url(env: Mapping[str, str], name: str, default: str, schemes: tuple[str, ...]) -> str:
    value = env.get(name, "") or default
    parsed = urlparse(value)
    if parsed.scheme not in schemes or not parsed.hostname:
        raise ConfigError(name, f"expected a {'/'.join(schemes)} URL, got {value!r}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, minimum: float = 0.0) -> float:
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(name, f"expected a number, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {value}")
    return value


def env_int(env: Mapping[str, str], name: str, default: int, minimum: int = 0) -> int:
    """An integer setting: ``default`` when unset; a ConfigError naming it when bad."""
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(name, f"expected an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {value}")
    return value


def _choice(env: Mapping[str, str], name: str, default: str, options: tuple[str, ...]) -> Any:
    value = env.get(name) or default
    if value not in options:
        raise ConfigError(name, f"one of {', '.join(options)}, got {value!r}")
    return value


def url_port(url: str, default: int) -> int:
    """The port a service listens on: the one in its own URL variable."""
    return urlparse(url).port or default


@dataclass(frozen=True, slots=True)
class Common:
    nats_url: str
    redis_url: str
    manager_url: str
    weights_url: str
    api_token: str | None
    weights_token: str | None  # RLBOOST_WEIGHTS_TOKEN, else the API token
    data_dir: Path
    log_level: str
    torch_threads: int | None  # RLBOOST_TORCH_THREADS: intra-op threads of torch services
    metrics_addr: str  # RLBOOST_METRICS_ADDR: where trainer/rollout serve /metrics
    metrics_port: int  # RLBOOST_METRICS_PORT: 0 = any free port
    emu_time_scale: float  # RLBOOST_EMU_TIME_SCALE: multiplies every modelled GPU time

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Common:
        return cls(
            nats_url=_url(env, "RLBOOST_NATS_URL", "nats://127.0.0.1:4222", _NATS),
            redis_url=_url(env, "RLBOOST_REDIS_URL", "redis://127.0.0.1:6379/0", _REDIS),
            manager_url=_url(env, "RLBOOST_MANAGER_URL", "http://127.0.0.1:8000", _HTTP),
            weights_url=_url(env, "RLBOOST_WEIGHTS_URL", "http://127.0.0.1:8001", _HTTP),
            api_token=env.get("RLBOOST_API_TOKEN") or None,
            weights_token=env.get("RLBOOST_WEIGHTS_TOKEN") or env.get("RLBOOST_API_TOKEN") or None,
            torch_threads=env_int(env, "RLBOOST_TORCH_THREADS", 0, 0) or None,
            metrics_addr=env.get("RLBOOST_METRICS_ADDR") or "127.0.0.1",
            metrics_port=env_int(env, "RLBOOST_METRICS_PORT", 0, 0),
            emu_time_scale=_float(env, "RLBOOST_EMU_TIME_SCALE", 1.0, 0.0),
            data_dir=Path(env.get("RLBOOST_DATA_DIR") or "./data").resolve(),
            log_level=(env.get("RLBOOST_LOG_LEVEL") or "INFO").upper(),
        )

    def describe(self) -> dict[str, object]:
        """For the one start-up log line: every field, secrets masked."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = "***" if "token" in f.name and value else str(value)
        return out


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    common: Common
    lease_ttl_s: float  # a response whose lease is not renewed for this long is taken back
    instance_ttl_s: float  # an instance silent for this long is dead
    dispatch_interval_s: float  # dispatch loop period (it also wakes on events)
    migration: Literal["token", "request"]  # resume from committed tokens, or restart (ablation)
    rebalance_skew: int  # move work when busiest - idlest instance exceeds this (0 = never)
    # Off (ablation): an instance that joins mid-step waits for the next step, as if weights
    # were pushed only at step boundaries instead of pulled on arrival.
    midstep_join: bool

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ManagerConfig:
        env = os.environ if env is None else env
        return cls(
            common=Common.from_env(env),
            lease_ttl_s=_float(env, "RLBOOST_LEASE_TTL_S", 3.0, 0.2),
            instance_ttl_s=_float(env, "RLBOOST_INSTANCE_TTL_S", 3.0, 0.2),
            dispatch_interval_s=_float(env, "RLBOOST_DISPATCH_INTERVAL_S", 0.05, 0.001),
            migration=_choice(env, "RLBOOST_MIGRATION", "token", ("token", "request")),
            rebalance_skew=env_int(env, "RLBOOST_REBALANCE_SKEW", 2, 0),
            midstep_join=_choice(env, "RLBOOST_MIDSTEP_JOIN", "on", ("on", "off")) == "on",
        )


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    common: Common
    engine: Engine
    kind: Literal["reserved", "spot"]
    instance_id: str
    heartbeat_s: float  # heartbeat period; leases are renewed on each beat
    chunk_tokens: int  # tokens per streamed chunk
    max_batch: int  # responses generated concurrently
    grace_s: float  # preemption notice: hand work back and leave within this
    notice: Literal["off", "aws", "gcp"]  # poll this cloud's metadata for preemption notices
    metadata_url: str | None  # the metadata server (default: the cloud's own address)
    notice_poll_s: float  # how often to poll it
    sglang_url: str | None  # RLBOOST_SGLANG_URL: attach to this SGLang server; unset = start one
    sglang_args: tuple[str, ...]  # RLBOOST_SGLANG_ARGS: extra launch_server flags (shell words)
    instances: int  # emu only: instances served by this one process (ids get -0, -1, ...)
    emu_model: str  # emu only: serving-cost preset (rollout_svc.emu_models), e.g. emu-32b

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RolloutConfig:
        env = os.environ if env is None else env
        engine = env.get("RLBOOST_ENGINE") or "torch"
        if engine not in ENGINES:
            raise ConfigError("RLBOOST_ENGINE", f"one of {', '.join(ENGINES)}, got {engine!r}")
        kind = env.get("RLBOOST_INSTANCE_KIND") or "spot"
        if kind not in ("reserved", "spot"):
            raise ConfigError("RLBOOST_INSTANCE_KIND", f"reserved or spot, got {kind!r}")
        default_id = f"{kind}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        instance_id = env.get("RLBOOST_INSTANCE_ID") or default_id
        if not instance_id.replace("-", "").replace("_", "").isalnum():
            raise ConfigError("RLBOOST_INSTANCE_ID", "letters, digits, '-' and '_' only")
        return cls(
            common=Common.from_env(env),
            engine=engine,
            kind=cast(Literal["reserved", "spot"], kind),
            instance_id=instance_id,
            heartbeat_s=_float(env, "RLBOOST_HEARTBEAT_S", 0.5, 0.05),
            chunk_tokens=env_int(env, "RLBOOST_CHUNK_TOKENS", 4, 1),
            max_batch=env_int(env, "RLBOOST_MAX_BATCH", 32, 1),
            grace_s=_float(env, "RLBOOST_GRACE_S", 30.0, 0.0),
            notice=_choice(env, "RLBOOST_PREEMPTION_NOTICE", "off", ("off", "aws", "gcp")),
            metadata_url=env.get("RLBOOST_METADATA_URL") or None,
            notice_poll_s=_float(env, "RLBOOST_NOTICE_POLL_S", 5.0, 0.05),
            instances=env_int(env, "RLBOOST_EMU_INSTANCES", 1, 1),
            emu_model=env.get("RLBOOST_EMU_MODEL") or "emu-8b",
            sglang_url=_url(env, "RLBOOST_SGLANG_URL", "", _HTTP)
            if env.get("RLBOOST_SGLANG_URL") else None,
            sglang_args=tuple(shlex.split(env.get("RLBOOST_SGLANG_ARGS") or "")),
        )


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    common: Common
    trainer_id: str
    poll_s: float  # how often the trainer polls for work and for the barrier

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TrainerConfig:
        env = os.environ if env is None else env
        return cls(
            common=Common.from_env(env),
            trainer_id=env.get("RLBOOST_TRAINER_ID") or f"trainer-{socket.gethostname()}",
            poll_s=_float(env, "RLBOOST_TRAINER_POLL_S", 0.5, 0.01),
        )


@dataclass(frozen=True, slots=True)
class WeightsConfig:
    common: Common
    keep_last: int  # versions kept per run; older ones are collected
    token: str | None  # RLBOOST_WEIGHTS_TOKEN, else the API token

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WeightsConfig:
        env = os.environ if env is None else env
        common = Common.from_env(env)
        return cls(
            common=common,
            keep_last=env_int(env, "RLBOOST_WEIGHTS_KEEP", 3, 1),
            token=common.weights_token,
        )
