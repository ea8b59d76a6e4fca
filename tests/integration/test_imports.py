"""The services' modules import in one direction: no cycle, in any order, lazy or not.

Two checks, because each misses what the other sees. The static one reads every ``import`` of
``rollout_svc`` and ``trainer_svc`` (and ``shared``, which they import), including those inside
functions, and fails on any cycle: a cycle hidden behind a deferred import never fails at run
time, yet it is still a cycle. The dynamic one imports each module first, with no other module of
the services loaded, in a fresh interpreter: a cycle of top-level imports can work in one order
and fail in another. A third check keeps the emulator light: an ``emu`` instance never loads
torch, transformers or sglang.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("rollout_svc", "trainer_svc")
GRAPHED = (*SERVICES, "shared")


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the graphed packages."""
    found: dict[str, Path] = {}
    for package in GRAPHED:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The graphed module an import of ``name`` loads (the longest known prefix), if any."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The graphed modules ``module`` imports anywhere in its file (functions included)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            # ``from pkg import name`` loads pkg.name when that is a module, else pkg itself.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                     for alias in node.names]
        for name in names:
            target = _resolve(name, known)
            if target is not None and target != module:
                targets.add(target)
    return targets


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def test_the_static_checker_sees_a_deferred_cycle() -> None:
    # The shape the engine factory had: the package imports a child inside a function and the
    # child imports the package back at the top.
    graph = {"pkg": {"pkg.child"}, "pkg.child": {"pkg"}, "pkg.other": {"pkg.child"}}
    assert _cycles(graph) == [["pkg", "pkg.child"]]
    assert _cycles({"pkg": {"pkg.child"}, "pkg.child": set()}) == []


def test_no_import_cycle_anywhere() -> None:
    graph = _graph()
    assert {"rollout_svc.engines", "trainer_svc.policies"} <= set(graph)
    # The factories reach their concrete modules; nothing inside reaches back to the factory.
    assert "rollout_svc.engines.emu" in graph["rollout_svc.engines"]
    assert "trainer_svc.policies.distributed" in graph["trainer_svc.policies"]
    assert _cycles(graph) == []


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
    modules = sorted(m for m in _modules() if m.split(".")[0] in SERVICES)
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
