"""One import root: the wheel installs ``edgefleet`` and nothing else, no module imports the old bare
names, and the commands run from the installed package even in a folder with packages of the same names."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from edgefleet.launch import module_command

REPO = Path(__file__).resolve().parents[2]
SUB_PACKAGES = ("agent", "coordinator", "protocol", "transport", "workloads", "lab")
SCANNED = ("agent", "coordinator", "protocol", "transport", "workloads", "lab", "edgefleet", "tests", "bench", "examples")
FLEET_FILE = REPO / "lab" / "fleets" / "mixed4.toml"


def _python_files() -> list[Path]:
    files: list[Path] = []
    for top in SCANNED:
        root = REPO / top
        if root.is_dir() and not root.is_symlink():
            files += [p for p in root.rglob("*.py") if "__pycache__" not in p.parts]
    return files


def _bare_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top in SUB_PACKAGES or (name.startswith("tests.lab") and name != "tests.lab.quota_fleet"):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    return found


def test_no_module_imports_the_old_bare_names() -> None:
    files = _python_files()
    assert len(files) > 100, f"only {len(files)} Python files found under {REPO}"
    offenders = [hit for path in files for hit in _bare_imports(path)]
    assert not offenders, "import these through edgefleet (edgefleet.agent, ...):\n" + "\n".join(offenders)


def test_the_wheel_installs_one_top_level_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
        (top_level_txt,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        declared = archive.read(top_level_txt).decode().split()
    assert top_level == {"edgefleet"}, f"the wheel installs {sorted(top_level)}"
    assert declared == ["edgefleet"]
    for sub in SUB_PACKAGES:
        assert f"edgefleet/{sub}/__init__.py" in names, f"edgefleet.{sub} is missing from the wheel"
    assert "edgefleet/lab/fleets/mixed4.toml" in names, "the lab's fleet files are not shipped"
    assert not [n for n in names if n.startswith("edgefleet/tests/") or "/test_" in n]


@pytest.fixture
def decoy_folder(tmp_path: Path) -> Path:
    """A folder with packages named like ours whose import fails loudly."""
    for name in ("agent", "protocol", "coordinator", "workloads", "edgefleet"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the decoy {name} package was imported')\n")
    (tmp_path / "edgefleet" / "agent").mkdir()
    (tmp_path / "edgefleet" / "agent" / "__init__.py").write_text("raise ImportError('the decoy was imported')\n")
    return tmp_path


def _command(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is not installed (pip install -e '.[test]')"
    return found


@pytest.mark.parametrize("argv", [["edge-agent", "--version"], ["edge-coordinator", "--version"],
                                  ["edge-lab", "check", str(FLEET_FILE)]])
def test_commands_run_from_a_folder_with_packages_of_the_same_names(decoy_folder: Path, argv: list[str]) -> None:
    done = subprocess.run([_command(argv[0]), *argv[1:]], cwd=decoy_folder, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "decoy" not in done.stdout + done.stderr


def test_a_started_module_is_ours_while_the_folder_stays_importable(decoy_folder: Path) -> None:
    """How the agent starts its training worker (and the lab its agents): the current directory
    cannot shadow edgefleet, and a user's own module in it still imports."""
    (decoy_folder / "users_module.py").write_text("VALUE = 42\n")
    probe = decoy_folder / "probe.py"
    probe.write_text("import edgefleet.agent, users_module\nprint(edgefleet.agent.__file__, users_module.VALUE)\n")
    done = subprocess.run(module_command("edgefleet.agent", "--version"), cwd=decoy_folder, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0 and done.stdout.startswith("edge-agent "), done.stdout + done.stderr
    boot = module_command("edgefleet.agent", "--version")
    program = boot[2].replace("runpy.run_module(module, run_name='__main__', alter_sys=True)\n",
                              "import runpy; runpy.run_path('probe.py')\n")
    done = subprocess.run([sys.executable, "-c", program, "x"], cwd=decoy_folder, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    ours, value = done.stdout.split()
    assert Path(ours).resolve().is_relative_to(REPO.resolve()) or "site-packages" in ours
    assert value == "42"


def test_one_version_from_the_package_metadata() -> None:
    from importlib import metadata

    import edgefleet

    assert edgefleet.__version__ == metadata.version("edgefleet")
    done = subprocess.run([_command("edge-agent"), "--version"], capture_output=True, text=True, timeout=60, check=False)
    assert done.stdout.split() == ["edge-agent", edgefleet.__version__]
