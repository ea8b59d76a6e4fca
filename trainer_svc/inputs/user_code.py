"""``python:<module>:<attr>`` specs: user code found through the reward path, nothing else.

Contract:

- :func:`split_spec` checks a spec's shape (``python:<module>:<attr>``) and imports nothing.
- :func:`load_attr` imports ``<module>`` and returns its callable ``<attr>``. The module must be
  found in a directory of ``dirs`` (RLBOOST_REWARD_PATH: rewards and environments share these
  roots) and load from there, or be one of the ``builtin`` modules; an installed package or a
  standard-library module (``os:system``) is refused before it is imported, and so is a
  reward-path file that an already imported module of the same name shadows.
- Every failure raises :class:`UserCodeError` (or the subclass the caller names), carrying
  ``spec`` and ``cause`` and saying which kind of thing (``reward``, ``env``) it was.

Resolution imports user code and may touch ``sys.path``: it is meant to run in a worker
process (:mod:`trainer_svc.inputs.workers`), never in the trainer's own.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PYTHON_PREFIX = "python:"
PATH_SETTING = "RLBOOST_REWARD_PATH"


class UserCodeError(ValueError):
    """A spec that names nothing callable; ``spec`` and ``cause`` say what and why."""

    kind = "user code"  # what the spec names, first word of the message
    attr_word = "name"  # what the spec's last part names

    def __init__(self, spec: str, cause: str) -> None:
        super().__init__(f"{self.kind} {spec!r}: {cause}")
        self.spec = spec
        self.cause = cause


def split_spec(spec: str, error: type[UserCodeError]) -> tuple[str, str]:
    """``(module, attr)`` of a ``python:<module>:<attr>`` spec; raises ``error`` if malformed."""
    parts = spec[len(PYTHON_PREFIX):].split(":") if spec.startswith(PYTHON_PREFIX) else []
    if len(parts) != 2 or not all(parts):
        raise error(spec, f"expected python:<module>:<{error.attr_word}>")
    return parts[0], parts[1]


def load_attr(spec: str, dirs: Sequence[str], builtin: Sequence[str],
              error: type[UserCodeError]) -> Any:
    """The callable a ``python:`` spec names; user modules are searched on ``dirs`` first."""
    module_name, attr = split_spec(spec, error)
    dirs = [d for d in dirs if d]
    where = ":".join(dirs) or "(empty)"
    if module_name not in builtin:
        _check_on_path(spec, module_name, dirs, builtin, error)
    # Prepended in order, so the first directory listed wins, as on PATH.
    for directory in reversed(dirs):
        if directory not in sys.path:
            sys.path.insert(0, directory)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is the user's to see
        raise error(
            spec, f"cannot import module {module_name!r} (reward path {where}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if module_name not in builtin and not _loaded_from(module, dirs):
        raise error(
            spec, f"module {module_name!r} loads from {getattr(module, '__file__', None)!r}, "
            f"not from the reward path {where} (a module of that name was imported already)")
    fn: Any = getattr(module, attr, None)
    if fn is None:
        raise error(spec, f"module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise error(spec, f"{module_name}.{attr} is not callable")
    return fn


def _check_on_path(spec: str, module_name: str, dirs: Sequence[str], builtin: Sequence[str],
                   error: type[UserCodeError]) -> None:
    """Refuse, before importing anything, a module whose top-level package is not in a
    reward-path directory: an installed package's import-time code is not the user's to run."""
    top = module_name.split(".", 1)[0]
    if importlib.machinery.PathFinder.find_spec(top, list(dirs)) is None:
        raise error(
            spec, f"cannot import module {module_name!r}: No module named {top!r} in the reward "
            f"path {':'.join(dirs) or '(empty)'} ({PATH_SETTING}; python: {error.kind}s come "
            f"from there, or from {', '.join(builtin)})")


def _loaded_from(module: Any, dirs: Sequence[str]) -> bool:
    origin = getattr(module, "__file__", None)
    if not origin:
        return False
    path = Path(origin).resolve()
    return any(path.is_relative_to(Path(d).resolve()) for d in dirs)
