"""The run spec on the command line: one typed flag per RunSpec field, and spec files.

Contract: :func:`add_spec_flags` walks :class:`shared.spec.RunSpec` with
``msgspec.inspect`` and adds one flag per field, nested structs as dotted flags
(``--steps 10``, ``--seeding.mode fixed``, ``--dataset.path data.jsonl``), each typed and with
its choices, bounds and default in ``--help``; a field added to RunSpec gets its flag with no
change here. Lists take several values (``--trackers tensorboard mlflow``); a field of a type
with no plain spelling takes JSON. :func:`spec_body` merges, in order, a spec file (YAML, or
JSON), ``--set key=value`` pairs and the typed flags into the body of ``POST /v1/runs``; only
what was given is sent, and the manager validates the whole (a bad value is its 422).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import yaml

from shared.spec import RunSpec

DEST = "spec:"  # prefix of the flags' argparse destinations
NULLS = ("null", "none")


def _bounds(t: Any) -> str:
    parts = []
    for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        value = getattr(t, attr, None)
        if value is not None:
            parts.append(f"{sign}{value}")
    return f" ({', '.join(parts)})" if parts else ""


def _json(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _leaf(t: Any) -> tuple[Callable[[str], Any], list[Any] | None, str, str | None]:
    """How a value of type ``t`` is read: converter, choices, help, nargs."""
    inspect = msgspec.inspect
    if isinstance(t, inspect.UnionType):
        rest = [u for u in t.types if not isinstance(u, inspect.NoneType)]
        if len(rest) == 1:
            parse, choices, text, nargs = _leaf(rest[0])
            return ((lambda raw: None if raw.lower() in NULLS else parse(raw)),
                    None if choices is None else [*choices, "null"], text + " or null", nargs)
        return _json, None, "JSON", None
    if isinstance(t, inspect.BoolType):
        return (lambda raw: raw.lower() in ("1", "true", "yes", "on")), None, "true|false", None
    if isinstance(t, inspect.IntType):
        return int, None, "integer" + _bounds(t), None
    if isinstance(t, inspect.FloatType):
        return float, None, "number" + _bounds(t), None
    if isinstance(t, inspect.StrType):
        return str, None, "text", None
    if isinstance(t, inspect.LiteralType):
        kinds = {type(v) for v in t.values}
        return (int if kinds == {int} else str), list(t.values), "one of the choices", None
    if isinstance(t, inspect.ListType | inspect.SetType | inspect.VarTupleType):
        parse, choices, text, _ = _leaf(t.item_type)
        return parse, choices, f"zero or more: {text}", "*"
    return _json, None, "JSON", None


def _struct_of(t: Any) -> Any:
    """The struct a field holds (also inside ``X | None``), if any."""
    inspect = msgspec.inspect
    if isinstance(t, inspect.StructType):
        return t
    if isinstance(t, inspect.UnionType):
        structs = [u for u in t.types if isinstance(u, inspect.StructType)]
        if len(structs) == 1:
            return structs[0]
    return None


def _default(field: Any) -> str:
    if field.default is not msgspec.NODEFAULT:
        return json.dumps(field.default)
    if field.default_factory is not msgspec.NODEFAULT:
        made = field.default_factory()
        return json.dumps(msgspec.to_builtins(made)) if not isinstance(made, msgspec.Struct) \
            else "{}"
    return "required"


def add_spec_flags(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset(),
                   spec: type[msgspec.Struct] = RunSpec) -> None:
    """One flag per field of ``spec`` (dotted for nested structs), except those in ``skip``."""
    group = parser.add_argument_group(
        "run spec", "each run-spec field as a flag (unset ones keep the manager's default)")

    def walk(struct: Any, prefix: str) -> None:
        for field in struct.fields:
            name = prefix + field.encode_name
            if name in skip:
                continue
            inner = _struct_of(field.type)
            if inner is not None:
                walk(inner, name + ".")
                continue
            parse, choices, text, nargs = _leaf(field.type)
            group.add_argument(f"--{name}", dest=DEST + name, type=parse, choices=choices,
                               nargs=nargs, default=argparse.SUPPRESS,
                               metavar=None if choices else name.rsplit(".", 1)[-1].upper(),
                               help=f"{text}; default {_default(field)}")

    walk(msgspec.inspect.type_info(spec), "")


def load_spec_file(path: str) -> dict[str, Any]:
    """A run spec file: JSON for ``.json``, YAML otherwise (YAML also reads JSON)."""
    text = Path(path).read_text()
    body = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ValueError(f"{path}: a run spec is a mapping of fields, not {type(body).__name__}")
    return body


def _put(body: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        nested = body.get(key)
        if not isinstance(nested, dict):
            nested = body[key] = {}
        body = nested
    body[leaf] = value


def spec_body(args: argparse.Namespace) -> dict[str, Any]:
    """The body of ``POST /v1/runs``: the spec file, then ``--set``, then the typed flags."""
    body: dict[str, Any] = load_spec_file(args.spec) if getattr(args, "spec", None) else {}
    for item in getattr(args, "set", None) or []:
        key, _, value = item.partition("=")
        _put(body, key, _json(value))
    for dest, value in vars(args).items():
        if dest.startswith(DEST):
            _put(body, dest[len(DEST):], value)
    return body
