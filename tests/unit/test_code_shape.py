"""The shape the production code keeps: no function longer than a screen and a half.

A function past ~80 lines is where state starts living in locals that closures mutate and where
a change can no longer be read whole (the ingest loop and both app factories were such before
they became a class and routers). The bound holds for every production package; benchmarks and
tests are exempt, being scripts and scenarios read top to bottom.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("manager_svc", "weight_svc", "trainer_svc", "rollout_svc", "shared", "rlboost", "sim")
MAX_LINES = 80


def long_functions(package: Path, limit: int) -> list[str]:
    """``path:line name (n lines)`` for each function or method of ``package`` over ``limit``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    where = path.relative_to(package.parent)
                    found.append(f"{where}:{node.lineno} {node.name} ({lines})")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_over_the_bound(package: str) -> None:
    assert (ROOT / package).is_dir(), package
    too_long = long_functions(ROOT / package, MAX_LINES)
    assert not too_long, f"functions over {MAX_LINES} lines: {too_long}"


def test_the_walk_finds_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\nasync def long():\n{body}\n")
    found = long_functions(tmp_path, MAX_LINES)
    assert len(found) == 1 and " long (81)" in found[0]
