"""How a setting is read, checked and printed: the machinery under :mod:`shared.config`.

Contract:
- A settings class derives from :class:`Settings` (pydantic-settings) and declares each field
  with :func:`setting`, which names its environment variable in full (``RLBOOST_...``): the name
  a user sets is the name a reader greps for, and the attribute may keep a shorter name. Every
  name must start with :data:`PREFIX`; a class that breaks this fails at import.
- ``Cls.from_env(env)`` reads the mapping ``env`` (default ``os.environ``). An empty variable
  counts as unset and names are case-sensitive, as the hand parser before this one had it. A bad
  value raises :class:`~shared.errors.ConfigError` naming the variable, never a pydantic dump.
- Nothing printed reveals a credential. :meth:`Settings.describe` (the one start-up log line),
  ``repr`` and the errors of :meth:`Settings.from_env` show a secret field (``SecretStr``) as
  ``***`` and every URL with the password of its user info masked (:func:`mask_url`). Which is
  which follows from a field's type and a value's shape, never from its name.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Self, get_args
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, GetCoreSchemaHandler, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import CoreSchema, core_schema
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from shared.errors import ConfigError

PREFIX = "RLBOOST_"
MASK = "***"

# The mapping the settings being built read. pydantic-settings reads os.environ itself; tests and
# launchers hand a mapping instead, and a context variable carries it into the source hook (and
# into nested settings built by default factories): each build sees its own mapping, even with
# builds in several threads or tasks at once.
_environment: ContextVar[Mapping[str, str] | None] = ContextVar("rlboost_env", default=None)


def setting(env: str, default: Any, doc: str, **rules: Any) -> Any:
    """A field read from ``env`` (else ``default``); ``doc`` says what it does (docs/settings.md's
    table carries it too); ``rules`` are pydantic constraints (ge=...)."""
    return Field(default, validation_alias=env, description=doc, **rules)


def env_names(field: FieldInfo) -> tuple[str, ...]:
    """The variable a field is read from, as a one-name tuple; () for a nested part."""
    alias = field.validation_alias
    if isinstance(alias, str):
        return (alias,)
    return ()


def split_urls(value: str) -> list[str]:
    """The URLs of a comma-separated list (RLBOOST_NATS_URL may name every node of a cluster).
    A comma splits only where a URL starts after it (``scheme://``), so one inside a password
    stays in its URL."""
    urls: list[str] = []
    for part in value.split(","):
        if urls and "://" not in part.strip():
            urls[-1] += "," + part
        else:
            urls.append(part.strip())
    return urls


def mask_url(url: str) -> str:
    """``url`` with the password in its user info replaced by ``***`` (in each URL of a
    comma-separated list). A user name alone is masked whole: NATS carries a bare token there.
    Anything that is not a URL is left as it is; a URL too malformed to split is masked whole
    rather than risk printing it."""
    if "://" not in url or "@" not in url:
        return url
    many = split_urls(url)
    if len(many) > 1:
        return ",".join(mask_url(one) for one in many)
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=f"{user + ':' + MASK if colon else MASK}@{hostport}"))


def shown(value: object) -> str:
    """A setting's value as it may be printed."""
    if isinstance(value, SecretStr):
        return MASK if value.get_secret_value() else ""
    return mask_url(str(value))


def reveal(secret: SecretStr | None) -> str | None:
    """The credential itself, for the one place that sends or compares it."""
    return None if secret is None else secret.get_secret_value()


@dataclass(frozen=True)
class UrlOf:
    """Field metadata: the value is a URL with a host and one of ``schemes`` (``many``: or a
    comma-separated list of such, as a client of a cluster is given every node)."""

    schemes: tuple[str, ...]
    many: bool = False

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def check(self, value: str) -> str:
        for one in split_urls(value) if self.many else [value]:
            try:
                parts = urlsplit(one)
                # .port raises on a port that is no number ("4222," of a stray comma)
                ok = parts.scheme in self.schemes and bool(parts.hostname) and (
                    parts.port is None or parts.port > 0)
            except ValueError:
                ok = False
            if not ok:
                what = f"a {'/'.join(self.schemes)} URL" + (" (or a comma-separated list)"
                                                            if self.many else "")
                raise ValueError(f"expected {what}, got {mask_url(value)!r}")
        return value


class _Environment(EnvSettingsSource):
    """pydantic-settings' environment source, over a given mapping rather than os.environ."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        self._env = env  # read by _load_env_vars, which the base __init__ calls
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        ignore_empty = self.env_ignore_empty
        return {k: v for k, v in self._env.items() if not (ignore_empty and v == "")}


class Settings(BaseSettings):
    """Base of every settings class: see the module's contract."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX,  # setting() names carry it in full (checked below)
        case_sensitive=True,
        env_ignore_empty=True,
        frozen=True,
        validate_default=True,  # defaults pass the same validators (a path is resolved)
        validate_by_name=True,
        validate_by_alias=True,
    )

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for name, field in cls.model_fields.items():
            names = env_names(field)
            if not names and not _is_part(field):
                raise TypeError(f"{cls.__name__}.{name}: declare it with setting(...)")
            if any(not n.startswith(PREFIX) for n in names):
                raise TypeError(f"{cls.__name__}.{name}: {names} must start with {PREFIX}")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        env = _environment.get()
        # Only keyword arguments and the environment: no .env or secrets-dir files are read.
        return init_settings, _Environment(settings_cls, os.environ if env is None else env)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Self:
        """Read and check every setting; a bad one is a ConfigError naming its variable."""
        token = _environment.set(os.environ if env is None else env)
        try:
            return cls()
        except ValidationError as exc:
            raise _config_error(exc) from None
        finally:
            _environment.reset(token)

    def describe(self) -> dict[str, str]:
        """Every setting by its variable name, as it may be printed (nested parts flattened)."""
        out: dict[str, str] = {}
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            if isinstance(value, Settings):
                out.update(value.describe())
            else:
                out[env_names(field)[0]] = shown(value)
        return out

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        for name, value in super().__repr_args__():
            yield name, shown(value) if isinstance(value, (str, SecretStr)) else value


def _is_part(field: FieldInfo) -> bool:
    """A nested settings object (``common``), read from the same environment by its own class."""
    return any(isinstance(t, type) and issubclass(t, Settings)
               for t in (field.annotation, *get_args(field.annotation)))


def _config_error(exc: ValidationError) -> ConfigError:
    """The first problem, with the variable's name and the value masked as it would print."""
    error = exc.errors(include_url=False)[0]
    name = str(error["loc"][0]) if error["loc"] else exc.title
    problem = error["msg"].removeprefix("Value error, ")
    if error["type"] != "value_error" and isinstance(error.get("input"), str):
        # Our own checks say what they got, masked; pydantic's constraints do not say it.
        problem += f", got {mask_url(error['input'])!r}"
    return ConfigError(name, problem)
