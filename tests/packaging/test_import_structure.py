"""The package's import structure: no module imports another that (directly or through others)
imports it back, whether the import sits at the top of a file or inside a function; and the
sub-packages' directions hold (docs/architecture.md): the agent never reaches into the coordinator,
the protocol and transport layers import neither, and the development brokers stand apart."""

from __future__ import annotations

import ast
from pathlib import Path

import edgefleet

ROOT = Path(edgefleet.__file__).parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``path`` imports at run time (imports under ``if TYPE_CHECKING:`` left out)."""
    tree = ast.parse(path.read_text())
    type_only = {id(node) for stmt in ast.walk(tree) if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test)
                 for node in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module in modules:
            # ``from pkg import mod`` names the package too (as a reader and an import-following tool see it)
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v] - {v}:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) for name, path in modules.items()}


def test_no_module_imports_itself_back() -> None:
    assert _cycles(_graph()) == []


def test_the_layers_import_in_one_direction() -> None:
    forbidden = {"edgefleet.agent": ("edgefleet.coordinator", "edgefleet.lab"),
                 "edgefleet.protocol": ("edgefleet.agent", "edgefleet.coordinator", "edgefleet.transport", "edgefleet.workloads",
                                        "edgefleet.lab", "edgefleet.brokers"),
                 "edgefleet.transport": ("edgefleet.agent", "edgefleet.coordinator", "edgefleet.workloads", "edgefleet.lab"),
                 "edgefleet.workloads": ("edgefleet.agent", "edgefleet.coordinator", "edgefleet.lab"),
                 "edgefleet.brokers": ("edgefleet.agent", "edgefleet.coordinator", "edgefleet.lab", "edgefleet.workloads"),
                 "edgefleet.coordinator": ("edgefleet.lab",),
                 "edgefleet.coordinator.control": tuple(f"edgefleet.coordinator.{p}" for p in
                                                        ("run", "exchange", "planning", "cli", "report", "exporter")),
                 "edgefleet.coordinator.exchange": tuple(f"edgefleet.coordinator.{p}" for p in
                                                         ("run", "control", "planning", "cli", "report", "exporter"))}
    wrong = sorted(f"{source} imports {target}" for source, targets in _graph().items() for target in targets
                   for layer, banned in forbidden.items() if source.startswith(layer + ".") or source == layer
                   if target.startswith(banned))
    assert wrong == []


def test_the_links_at_the_top_lead_into_the_package() -> None:
    repo = ROOT.parent
    for name in ("agent", "coordinator", "protocol", "transport", "workloads", "lab"):
        link = repo / name
        if link.exists():  # a source checkout (an installed wheel has no links)
            assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), name
            assert not (ROOT / name).is_symlink(), f"edgefleet/{name} must be the real folder"
