"""The README's set-up block, checked in a second on every run.

scripts/check_fresh_install.sh runs the same block verbatim on a fresh Debian 12 root (by hand: it
downloads several hundred MB). These tests check what can be read without installing anything: the block
uses a virtual environment, installs the pinned CPU torch before edgefleet, and the ``[demo]``
extra it installs covers every third-party import of the demo's code and nothing of the test tools.
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: the base dependency tomli
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
CHECK_SCRIPT = REPO / "scripts" / "check_fresh_install.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# What `edge-coordinator demo` runs: the command, the agents it spawns and their training workers,
# and the built-in models and datasets they load by name.
DEMO_MODULES = ("edgefleet.coordinator.cli.demo", "edgefleet.agent.__main__", "edgefleet.agent.worker",
                "edgefleet.workloads.models", "edgefleet.workloads.datasets")
TOOLS = {"ansible", "ansible-core", "ansible-lint", "pytest", "hypothesis", "mypy", "ruff"}


def _setup_commands() -> list[list[str]]:
    """The README's set-up block as the fresh-install check runs it, one argument vector per command."""
    done = subprocess.run(["bash", str(CHECK_SCRIPT), "--print-setup"], capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 0 and done.stdout.strip(), f"--print-setup failed:\n{done.stdout}{done.stderr}"
    commands = []
    for line in done.stdout.splitlines():
        for part in re.split(r"&&|;", line):
            words = shlex.split(part, comments=True)
            if words:
                commands.append(words)
    return commands


def _pip_installs(commands: list[list[str]]) -> list[tuple[int, list[str]]]:
    return [(i, words) for i, words in enumerate(commands) if words[:2] == ["pip", "install"]]


def test_the_setup_installs_venv_and_mosquitto_first_and_pip_only_inside_a_venv() -> None:
    commands = _setup_commands()
    apt = [i for i, words in enumerate(commands) if "apt" in words[:2] or "apt-get" in words[:2]]
    assert apt and "python3-venv" in commands[apt[-1]] and "mosquitto" in commands[apt[-1]], commands
    venv = next((i for i, words in enumerate(commands) if words[:3] == ["python3", "-m", "venv"]), None)
    assert venv is not None, f"the set-up makes no virtual environment: {commands}"
    folder = commands[venv][3]
    activate = next((i for i, words in enumerate(commands) if words in ([".", f"{folder}/bin/activate"],
                                                                        ["source", f"{folder}/bin/activate"])), None)
    assert activate is not None and activate > venv, f"the set-up does not activate {folder}: {commands}"
    installs = _pip_installs(commands)
    assert installs and all(i > activate for i, _ in installs), f"pip runs before the venv is active: {commands}"
    assert all("sudo" not in words and "pip3" not in words[:1] for words in commands if "pip" in " ".join(words))
    assert not [words for _, words in installs if {"--user", "--break-system-packages"} & set(words)]
    assert apt[-1] < venv, "install python3-venv before making the venv"


def test_torch_is_pinned_from_the_cpu_index_before_edgefleet_installs() -> None:
    installs = _pip_installs(_setup_commands())
    torch = [(i, words) for i, words in installs if any(w.startswith("torch") for w in words[2:])]
    assert len(torch) == 1, f"expected one pip install of torch: {installs}"
    torch_at, words = torch[0]
    (pin,) = [w for w in words if w.startswith("torch")]
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", pin), f"torch is not pinned to one release: {pin}"
    assert words[words.index("--index-url") + 1] == CPU_INDEX, f"torch does not come from the CPU index: {words}"
    train = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    (wanted,) = [Requirement(r) for r in train if canonicalize_name(Requirement(r).name) == "torch"]
    assert SpecifierSet(str(wanted.specifier)).contains(pin.split("==")[1]), f"{pin} does not satisfy the train extra's {wanted}"
    ours = [(i, words) for i, words in installs if any(w.startswith(".[") or w == "." for w in words[2:])]
    assert ours, f"the set-up does not install this checkout: {installs}"
    for i, words in ours:
        assert i > torch_at, "torch must come first: the extra would pull PyPI's CUDA build"
        assert [w for w in words[2:] if w.startswith(".")] == [".[demo]"], f"the set-up installs {words}, not .[demo]"


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
