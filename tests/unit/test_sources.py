"""Where a run's data and reward code may come from: the manager's lexical judgement of a path
against the dataset roots, the trainer's resolved one, and standard-library reward modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import Common
from shared.sources import EXAMPLES_DIR, outside_roots, stdlib_reward_module

ROOTS = [Path("/data"), Path("/repo/examples")]


@pytest.mark.parametrize(("path", "outside"), [
    ("/etc/passwd", True),
    ("/data/../etc/passwd", True),  # normalised before it is judged
    ("/datax/train.jsonl", True),  # a prefix of the text is not a parent directory
    ("/data/sub/../train.jsonl", False),
    ("/repo/examples/data/x.jsonl", False),
    ("examples/data/x.jsonl", False),  # relative: the trainer's working directory decides
])
def test_the_manager_judges_absolute_paths_by_their_text(path: str, outside: bool) -> None:
    assert outside_roots(path, ROOTS, resolve=False) is outside


def test_a_relative_root_leaves_every_path_to_the_trainer() -> None:
    assert not outside_roots("/etc/passwd", [Path("data")], resolve=False)


def test_the_trainer_follows_links_out_of_a_root(tmp_path: Path) -> None:
    root, secret = tmp_path / "root", tmp_path / "secret.jsonl"
    root.mkdir()
    secret.write_text("{}\n")
    (root / "link.jsonl").symlink_to(secret)
    assert not outside_roots(str(root / "link.jsonl"), [root], resolve=False)  # by its name
    assert outside_roots(str(root / "link.jsonl"), [root], resolve=True)  # by its target
    assert not outside_roots(str(secret), [tmp_path], resolve=True)


def test_default_roots_are_the_data_dir_and_the_examples(tmp_path: Path) -> None:
    cfg = Common.from_env({"RLBOOST_DATA_DIR": str(tmp_path)})
    assert cfg.dataset_dirs == [tmp_path.resolve(), EXAMPLES_DIR]
    assert (EXAMPLES_DIR / "data" / "word-problems-train.jsonl").is_file()
    named = Common.from_env({"RLBOOST_DATASET_ROOTS": "/a:/b/c:"})
    assert named.dataset_dirs == [Path("/a"), Path("/b/c")]


@pytest.mark.parametrize(("reward", "module"), [
    ("python:os:system", "os"), ("python:os.path:join", "os.path"),
    ("python:builtins:eval", "builtins"), ("python:sys:exit", "sys"),
    ("python:my_rewards:score", None), ("math", None), (None, None),
])
def test_standard_library_reward_modules(reward: str | None, module: str | None) -> None:
    assert stdlib_reward_module(reward) == module
