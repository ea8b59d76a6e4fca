"""Every test file sits in a tier, and the system tier is marked slow.

``make test`` and ``make test-fast`` name the tier folders, so a test file left anywhere else
would never run; and ``-m "not slow"`` must leave out the whole system tier.
"""

from __future__ import annotations

import importlib
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "system")


def test_every_test_file_is_in_a_tier() -> None:
    files = [p.relative_to(TESTS) for p in TESTS.rglob("test_*.py")]
    assert len(files) > 20
    assert [f for f in files if f.parts[0] not in TIERS or len(f.parts) != 2] == []


def test_every_system_test_module_is_marked_slow() -> None:
    modules = sorted((TESTS / "system").glob("test_*.py"))
    assert modules
    for path in modules:
        module = importlib.import_module(f"tests.system.{path.stem}")
        mark = getattr(module, "pytestmark", None)
        assert mark is not None and mark.name == "slow", path.name
