"""The services' modules import in any order, and an emu instance stays light.

The static side of "no import cycle" is ``make lint``: import-linter's contracts in
pyproject.toml, with ``tests/support/import_contracts.py`` for cycles through a package's own
``__init__`` (tests/unit/test_import_contracts.py shows that it fails on one). What a static
check cannot see is checked here, in fresh interpreters: each module of ``rollout_svc`` and
``trainer_svc`` imported first, with no other module of the services loaded, because a cycle of
top-level imports can work in one order and fail in another; and an ``emu`` instance never
loads torch, transformers or sglang.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("rollout_svc", "trainer_svc")


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the services."""
    found: dict[str, Path] = {}
    for package in SERVICES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            found[".".join(parts)] = path
    return found


# Run in a fresh interpreter: for each module, every module of the services is dropped from
# sys.modules and the module is imported first. Third-party packages stay loaded, so torch is
# imported once rather than once per module.
_FIRST_IMPORT = """
import importlib, json, sys, traceback
services, modules = sys.argv[1].split(","), sys.argv[2].split(",")
failed = {}
for name in modules:
    for loaded in [m for m in sys.modules if m.split(".")[0] in services]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed[name] = traceback.format_exc(limit=-3)
print(json.dumps({"failed": failed, "sglang": "sglang" in sys.modules}))
"""


def _first_imports(root: Path, packages: list[str], modules: list[str]) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", _FIRST_IMPORT, ",".join(packages), ",".join(modules)],
        cwd=root, capture_output=True, text=True, timeout=300, check=True)
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_the_first_import_check_sees_an_order_dependent_cycle(tmp_path: Path) -> None:
    # a first: b finds a half-initialised a in sys.modules and needs nothing from it yet.
    # b first: a asks b for B before b has defined it.
    (tmp_path / "cyc").mkdir()
    (tmp_path / "cyc" / "__init__.py").write_text("")
    (tmp_path / "cyc" / "a.py").write_text("from cyc.b import B\nA = 1\n")
    (tmp_path / "cyc" / "b.py").write_text("import cyc.a\nB = 2\n")
    failed = _first_imports(tmp_path, ["cyc"], ["cyc.a", "cyc.b"])["failed"]
    assert isinstance(failed, dict) and list(failed) == ["cyc.b"]


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    modules = sorted(_modules())
    assert len(modules) > 20
    result = _first_imports(REPO, list(SERVICES), modules)
    assert result["failed"] == {}
    assert not result["sglang"]  # the sglang engine drives a server; it never imports sglang


# What an emu rollout process loads: its entry point (and through it the service, config and
# bus), the serving-cost presets, and an engine built by the factory.
_EMU_INSTANCE = """
import sys
import rollout_svc.__main__
from rollout_svc.engines import create_engine
from rollout_svc.engines.emu_models import serving_model
options = {**serving_model("emu-32b").engine_options(), "time_scale": 0.0}
engine = create_engine("emu", **options)
engine.load(None, "run", 1)
assert engine.name == "emu" and engine.loaded == ("run", 1)
print(sorted(m for m in ("torch", "transformers", "sglang") if m in sys.modules))
"""


def test_an_emu_instance_loads_no_model_library() -> None:
    proc = subprocess.run([sys.executable, "-c", _EMU_INSTANCE], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
