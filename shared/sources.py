"""Where a run's user-named data and code may come from: dataset roots and reward modules.

Contract:

- A run spec's ``dataset.path`` and ``eval.path`` must lie under one of the dataset roots
  (RLBOOST_DATASET_ROOTS; unset: RLBOOST_DATA_DIR and the shipped ``examples/`` directory,
  :func:`default_dataset_roots`). :func:`outside_roots` is the check. The trainer, which opens
  the file, checks with ``resolve=True``: symlinks and ``..`` are followed on its own file
  system first, so a link inside a root that points out of it is outside. The manager, at
  submit, sees neither the trainer's files nor its working directory: with ``resolve=False``
  it judges an absolute path by its normalised text and lets a relative one through to the
  trainer.
- A ``python:<module>:<function>`` reward is imported from the trainer's reward path only (or
  is one of the built-in reward modules, which the trainer names); a module named like one of
  the standard library's can be neither, so the manager refuses it at submit
  (:func:`stdlib_reward_module`) rather than let a spec call ``os:system``.

Why: a run spec is the REST API's to accept, and the trainer runs it with the trainer's
rights; without these bounds any user of the API could read any file the trainer can and
call any installed function with the trainer's credentials.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

# The repository's examples/ (run specs and the word-problem data), beside the packages.
EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
PYTHON_REWARD = "python:"


def default_dataset_roots(data_dir: Path) -> list[Path]:
    """The roots when RLBOOST_DATASET_ROOTS is unset: the data dir and the shipped examples."""
    return [data_dir, EXAMPLES_DIR]


def outside_roots(path: str, roots: Sequence[Path], *, resolve: bool) -> bool:
    """Whether ``path`` lies outside every root (see the module docstring for ``resolve``)."""
    if resolve:
        where = Path(path).expanduser().resolve()
        return not any(where.is_relative_to(Path(r).expanduser().resolve()) for r in roots)
    if not os.path.isabs(path) or not all(os.path.isabs(r) for r in roots):
        return False  # relative to the trainer's working directory: the trainer's to judge
    where = Path(os.path.normpath(path))
    return not any(where.is_relative_to(os.path.normpath(r)) for r in roots)


def roots_text(roots: Sequence[Path]) -> str:
    """The roots as an error message names them."""
    return ", ".join(str(r) for r in roots) or "(none)"


def stdlib_reward_module(reward: str | None) -> str | None:
    """The module of a ``python:`` reward whose top-level package is a standard-library one
    (``os``, ``subprocess``, ``builtins`` ...), else None."""
    if reward is None or not reward.startswith(PYTHON_REWARD):
        return None
    module = reward[len(PYTHON_REWARD):].split(":", 1)[0]
    top = module.split(".", 1)[0]
    return module if top in sys.stdlib_module_names or top in sys.builtin_module_names else None
