"""What the set-up installs, checked in a second on every run.

scripts/setup installs the ``[demo]`` extra (tests/packaging/test_setup_scripts.py checks the scripts and the
README's two commands; scripts/check_fresh_install.sh runs them on a fresh Debian 12 root, by hand). These tests
check that the extra covers every third-party import of the demo's code and nothing of the test tools.
"""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: the base dependency tomli
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
# What `edge-coordinator demo` runs: the command, the agents it spawns and their training workers,
# and the built-in models and datasets they load by name.
DEMO_MODULES = ("edgefleet.coordinator.cli.demo", "edgefleet.agent.__main__", "edgefleet.agent.worker",
                "edgefleet.workloads.models", "edgefleet.workloads.datasets")
TOOLS = {"ansible", "ansible-core", "ansible-lint", "pytest", "hypothesis", "mypy", "ruff"}


def _guarded(parents: list[ast.AST]) -> bool:
    """An import the code can live without: typing only, optional (except ImportError) or for another Python."""
    for node in parents:
        if isinstance(node, ast.If) and re.search(r"TYPE_CHECKING|version_info", ast.unparse(node.test)):
            return True
        if isinstance(node, ast.Try) and any(h.type is not None and "ImportError" in ast.unparse(h.type)
                                             for h in node.handlers):
            return True
    return False


def _imports(module: str) -> list[str]:
    """Every module name ``module`` imports, at the top or in a function, unless guarded."""
    parts = module.split(".")
    base = REPO.joinpath("edgefleet", *parts[1:])
    path = base / "__init__.py" if (base / "__init__.py").exists() else base.with_suffix(".py")
    if not path.exists():
        return []
    package = parts if path.name == "__init__.py" else parts[:-1]
    found: list[str] = []

    def visit(node: ast.AST, parents: list[ast.AST]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom) and not _guarded(parents):
                if isinstance(child, ast.Import):
                    found.extend(alias.name for alias in child.names)
                else:
                    stem = package[:len(package) - child.level + 1] if child.level else []
                    name = ".".join([*stem, *([child.module] if child.module else [])])
                    found.append(name)
                    found.extend(f"{name}.{alias.name}" for alias in child.names)
            visit(child, [*parents, child])

    visit(ast.parse(path.read_text(), filename=str(path)), [])
    return found


def _demo_third_party_imports() -> dict[str, str]:
    """Top-level third-party names the demo's code imports, each with one module that imports it."""
    seen: set[str] = set()
    todo = list(DEMO_MODULES)
    third_party: dict[str, str] = {}
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in _imports(module):
            top = name.split(".")[0]
            if top == "edgefleet":
                pieces = name.split(".")
                todo += [".".join(pieces[:n]) for n in range(1, len(pieces) + 1)]
            elif top not in sys.stdlib_module_names and top != "__future__":
                third_party.setdefault(top, module)
    assert len(seen) > 50, f"only {len(seen)} modules reached from {DEMO_MODULES}"
    return third_party


def _own_requirements(extras: list[str]) -> list[Requirement]:
    """What pyproject.toml asks for with ``extras``, our self-references (edgefleet[coordinator,train]) expanded."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    found: list[Requirement] = [Requirement(r) for r in project["dependencies"]]
    done: set[str] = set()
    wanted = list(extras)
    while wanted:
        extra = wanted.pop()
        if extra in done:
            continue
        done.add(extra)
        for text in project["optional-dependencies"][extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == "edgefleet":
                wanted += sorted(req.extras)
            else:
                found.append(req)
    return found


def _installed_closure(extras: list[str]) -> set[str]:
    """Every distribution ``pip install '.[extras]'`` installs (canonical names), from pyproject.toml and the
    installed distributions' metadata (this environment has them all)."""
    todo = _own_requirements(extras)
    closure: set[str] = set()
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        key = name + "[" + ",".join(sorted(req.extras)) + "]"
        if key in closure:
            continue
        closure.add(key)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            pytest.fail(f"{req.name} is not installed here, so its dependencies are unknown: pip install -e '.[test]'")
        for text in requires:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in [*req.extras, ""]):
                todo.append(sub)
    return {key.split("[")[0] for key in closure}


def test_the_demo_extra_covers_every_import_of_the_demos_code() -> None:
    installed = _installed_closure(["demo"])
    providers = metadata.packages_distributions()
    missing = []
    for top, importer in sorted(_demo_third_party_imports().items()):
        dists = {canonicalize_name(d) for d in providers.get(top, [])}
        if not dists & installed:
            missing.append(f"{top} (imported by {importer}; from {sorted(dists) or 'no installed distribution'})")
    assert not missing, "pip install '.[demo]' leaves out what the demo imports: " + "; ".join(missing)
    assert {"torch", "pytorch-lightning", "scikit-learn", "rich", "paho-mqtt"} <= installed


def test_the_demo_extra_leaves_out_the_test_and_rollout_tools() -> None:
    pulled = sorted(_installed_closure(["demo"]) & TOOLS)
    assert not pulled, f"pip install '.[demo]' installs {pulled}: they belong to the test and deploy extras"
    declared = {canonicalize_name(req.name) for req in _own_requirements(["test"])}
    assert {"ansible", "pytest"} <= declared, "the extras' expansion misses what it should find"
