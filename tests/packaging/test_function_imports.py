"""Imports inside functions: the package imports its own modules, torch, Lightning and numpy at the
top of a file, except to keep a heavy import off a hot start-up path (the idle agent, which must stay
small; the command line's start and ``--help``; the training worker's start). Each import kept inside
a function says why in a comment, on its line or just above it (or above the group of imports it
belongs to). An import of one of the package's modules that loads nothing heavy belongs at the top.
"""

from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

import edgefleet

ROOT = Path(edgefleet.__file__).parent

# Third-party packages that are slow or large to import, or optional: an import of one of them (or of
# a module of the package that imports one at its top, directly or through others) may wait in a function.
HEAVY = frozenset({"torch", "torchvision", "torchmetrics", "lightning", "pytorch_lightning", "numpy", "sklearn",
                   "matplotlib", "rich", "prometheus_client", "amqtt", "jtop", "cryptography"})
# What importing one of them loads besides (torch imports numpy, Lightning imports torch).
IMPLIES = {"torch": ("numpy",), "torchvision": ("torch", "numpy"), "torchmetrics": ("torch", "numpy"),
           "lightning": ("torch", "numpy"), "pytorch_lightning": ("torch", "numpy"), "sklearn": ("numpy",),
           "matplotlib": ("numpy",)}
# What a function-level import of these needs a comment for (the package's own modules are checked too).
MUST_EXPLAIN = frozenset({"torch", "lightning", "pytorch_lightning", "numpy"})
# Imports of light modules of the package kept in a function for a reason the closure below cannot see:
# (importing module, imported module) -> why.
LIGHT_BUT_KEPT = {
    ("edgefleet.coordinator.cli.main", "edgefleet.agent.__main__"):
        "the agent's parser, for the completion script only: keeps the agent's modules off the CLI's start",
}
PRAGMAS = ("noqa", "type:", "pragma", "pyright:", "fmt:")


@dataclass(frozen=True)
class FunctionImport:
    path: Path
    line: int
    module: str      # the module imported from, made absolute
    names: tuple[str, ...]
    explained: bool


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, path: Path) -> str:
    if not node.level:
        return node.module or ""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _comment_lines(source: str) -> set[int]:
    """Lines with a comment that says something (pragmas such as ``# noqa`` alone do not)."""
    found = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if text and not text.startswith(PRAGMAS):
                found.add(tok.start[0])
    return found


def _comment_above(lines: list[str], comments: set[int], line: int) -> bool:
    """A comment line directly above ``line`` (1-based)."""
    above = line - 1
    return above >= 1 and above in comments and lines[above - 1].lstrip().startswith("#")


def _function_imports(path: Path) -> list[FunctionImport]:
    source = path.read_text()
    lines = source.splitlines()
    comments = _comment_lines(source)
    found = []

    def visit_body(stmts: list[ast.stmt], in_function: bool) -> None:
        group_explained = False  # a comment above the first of consecutive imports covers the group
        previous: ast.stmt | None = None
        for stmt in stmts:
            is_import = isinstance(stmt, (ast.Import, ast.ImportFrom))
            if is_import and in_function:
                own = any(n in comments for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
                above = _comment_above(lines, comments, stmt.lineno)
                starts_group = not isinstance(previous, (ast.Import, ast.ImportFrom))
                if starts_group:
                    group_explained = above
                explained = own or above or group_explained
                if isinstance(stmt, ast.ImportFrom):
                    found.append(FunctionImport(path, stmt.lineno, _absolute(stmt, path),
                                                tuple(a.name for a in stmt.names), explained))
                else:
                    found.extend(FunctionImport(path, stmt.lineno, a.name, (), explained) for a in stmt.names)
            previous = stmt
            visit(stmt, in_function)

    def visit(node: ast.AST, in_function: bool) -> None:
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for field in ("body", "orelse", "finalbody"):
            value = getattr(node, field, None)
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                visit_body(value, inner)
        for handler in getattr(node, "handlers", []):
            visit_body(handler.body, inner)
        for case in getattr(node, "cases", []):
            visit_body(case.body, inner)

    visit(ast.parse(source), False)
    return found


def _all_function_imports() -> list[FunctionImport]:
    return [imp for path in sorted(ROOT.rglob("*.py")) for imp in _function_imports(path)]


def _where(imp: FunctionImport) -> str:
    return f"{imp.path.relative_to(ROOT.parent)}:{imp.line} {imp.module}"


def test_every_kept_import_says_why() -> None:
    unexplained = [_where(imp) for imp in _all_function_imports()
                   if (imp.module == "edgefleet" or imp.module.startswith("edgefleet.")
                       or imp.module.split(".")[0] in MUST_EXPLAIN) and not imp.explained]
    assert not unexplained, ("imports inside functions without a comment saying why (a heavy import kept off a start-up "
                             "path, or an optional dependency):\n" + "\n".join(unexplained))


# The package's import graph at module level (what importing a module runs), for the test below.

def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in ROOT.rglob("*.py")}


def _top_level_imports(path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(the package's modules, third-party top-level names) that importing ``path`` imports, leaving out
    imports inside functions and under ``if TYPE_CHECKING:``."""
    own: set[str] = set()
    other: set[str] = set()

    def add(module: str, names: tuple[str, ...] = ()) -> None:
        if module == "edgefleet" or module.startswith("edgefleet."):
            parts = module.split(".")
            own.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules)
            own.update(f"{module}.{n}" for n in names if f"{module}.{n}" in modules)
        else:
            other.add(module.split(".")[0])

    def visit(stmts: list[ast.stmt]) -> None:
        for stmt in stmts:
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    add(alias.name)
            elif isinstance(stmt, ast.ImportFrom):
                add(_absolute(stmt, path), tuple(a.name for a in stmt.names))
            elif isinstance(stmt, ast.If) and "TYPE_CHECKING" not in ast.unparse(stmt.test):
                visit(stmt.body)
                visit(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                visit(stmt.body)
                for handler in stmt.handlers:
                    visit(handler.body)
                visit(stmt.orelse)
                visit(stmt.finalbody)

    visit(ast.parse(path.read_text()).body)
    return own, other


def _heavy_closure() -> dict[str, frozenset[str]]:
    """For each module of the package, the heavy third-party packages importing it loads (its parent
    packages' ``__init__`` included: importing a module runs them first)."""
    modules = _modules()
    edges = {name: _top_level_imports(path, modules) for name, path in modules.items()}
    deps = {name: own | {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)} - {name}
            for name, (own, _) in edges.items()}
    heavy = {name: {h for top in other & HEAVY for h in {top, *IMPLIES.get(top, ())}} for name, (_, other) in edges.items()}
    changed = True
    while changed:  # to a fixed point: a package and its modules import each other
        changed = False
        for name in modules:
            grown = heavy[name].union(*(heavy[d] for d in deps[name] if d in heavy))
            if grown != heavy[name]:
                heavy[name], changed = grown, True
    return {name: frozenset(found) for name, found in heavy.items()}


def test_light_modules_of_the_package_are_imported_at_the_top() -> None:
    """An import inside a function of one of the package's modules that loads nothing heavy (nor anything
    more than the importing module loads already) only hides the dependency: it belongs at the top."""
    heavy = _heavy_closure()
    movable = []
    for imp in _all_function_imports():
        if not (imp.module == "edgefleet" or imp.module.startswith("edgefleet.")):
            continue
        importer = _module_name(imp.path)
        targets = [f"{imp.module}.{n}" for n in imp.names if f"{imp.module}.{n}" in heavy] or [imp.module]
        loads = frozenset().union(*(heavy.get(t, frozenset()) for t in targets))
        if loads <= heavy[importer] and (importer, imp.module) not in LIGHT_BUT_KEPT:
            movable.append(_where(imp))
    assert not movable, "light modules of the package imported inside functions (move them to the top):\n" + "\n".join(movable)
