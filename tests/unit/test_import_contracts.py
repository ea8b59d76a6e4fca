"""The ``acyclic_modules`` contract (tests/support/import_contracts.py) fails where it should.

``make lint`` runs it, with import-linter's built-in contracts, on the project. Here it runs on
a package made for the purpose, with the shape the engine factory once had, which
``acyclic_siblings`` does not see; and on the project's own graph, to show that the graph holds
the factories' deferred imports (a contract that saw no imports would pass on anything).
"""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest

from tests.support.import_contracts import AcyclicModulesContract, cycles, module_graph

PACKAGES = ("shared", "manager_svc", "trainer_svc", "rollout_svc", "weight_svc", "rlboost",
            "benchmarks")


def test_cycles_are_the_components_of_more_than_one_module() -> None:
    # The package imports a child inside a function and the child imports the package back.
    graph = {"pkg": {"pkg.child"}, "pkg.child": {"pkg"}, "pkg.other": {"pkg.child"}}
    assert cycles(graph) == [["pkg", "pkg.child"]]
    assert cycles({"pkg": {"pkg.child"}, "pkg.child": set()}) == []


def test_the_contract_breaks_on_a_deferred_cycle_through_a_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cyc").mkdir()
    (tmp_path / "cyc" / "__init__.py").write_text("def make():\n    from cyc import child\n")
    (tmp_path / "cyc" / "child.py").write_text("import cyc\n")
    (tmp_path / "cyc" / "other.py").write_text("from cyc import child\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cyc", cache_dir=None)
    contract = AcyclicModulesContract("no cycle", {}, {"packages": ["cyc"]})
    check = contract.check(graph, verbose=False)
    assert not check.kept
    assert check.metadata["cycles"] == [["cyc", "cyc.child"]]
    (tmp_path / "cyc" / "child.py").write_text("")
    kept = contract.check(grimp.build_graph("cyc", cache_dir=None), verbose=False)
    assert kept.kept


def test_the_project_graph_holds_the_factories_imports_and_no_cycle() -> None:
    graph = module_graph(grimp.build_graph(*PACKAGES, cache_dir=None), PACKAGES)
    assert {"rollout_svc.engines", "trainer_svc.learn.policies"} <= set(graph)
    # The factories reach their concrete modules; nothing inside reaches back to the factory.
    assert "rollout_svc.engines.emu" in graph["rollout_svc.engines"]
    assert "trainer_svc.learn.policies.distributed" in graph["trainer_svc.learn.policies"]
    assert cycles(graph) == []
