"""An import-linter contract that no module takes part in an import cycle.

import-linter's own ``acyclic_siblings`` squashes each child package into one node and never
looks at a package's ``__init__``, so it misses the cycle a factory makes: the package imports a
concrete module (often inside a function) and that module imports the package back. This
contract works on modules, not packages: it fails on every strongly connected component of more
than one module among the imports of the listed packages, deferred imports included (grimp
reads every ``import`` statement in a file). Registered in pyproject.toml as ``acyclic_modules``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from typing import cast

import grimp
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


def module_graph(graph: grimp.ImportGraph, packages: Iterable[str]) -> dict[str, set[str]]:
    """Each module of ``packages`` (package ``__init__`` included) -> those of them it imports."""
    modules: set[str] = set()
    for package in packages:
        modules |= {package, *graph.find_descendants(package)}
    return {m: graph.find_modules_directly_imported_by(m) & modules - {m} for m in modules}


def cycles(graph: Mapping[str, Set[str]]) -> list[list[str]]:
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


class AcyclicModulesContract(Contract):
    """No import cycle between any two modules of ``packages``, however deep or deferred."""

    type_name = "acyclic_modules"

    packages = fields.SetField(subfield=fields.StringField())

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        # A field on the class, its parsed value on the instance (import-linter's own pattern).
        modules = module_graph(graph, sorted(cast(set[str], self.packages)))
        found = cycles(modules)
        # For each cycle, the imports that close it, with their lines, for the report.
        details = [[(importer, imported, [d["line_number"] for d in graph.get_import_details(
                        importer=importer, imported=imported)])
                    for importer in cycle for imported in sorted(modules[importer] & set(cycle))]
                   for cycle in found]
        return ContractCheck(kept=not found, metadata={"cycles": found, "imports": details})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for cycle, imports in zip(check.metadata["cycles"], check.metadata["imports"],
                                  strict=True):
            output.print_error(f"Import cycle between {', '.join(cycle)}:")
            for importer, imported, lines in imports:
                where = ", ".join(f"l.{n}" for n in lines)
                output.print_error(f"- {importer} -> {imported} ({where})", bold=False)
            output.new_line()
