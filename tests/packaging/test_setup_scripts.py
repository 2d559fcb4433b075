"""The README's two set-up commands (scripts/setup, scripts/test), the CPU-index probe they use, and .ci/run.

Nothing here installs anything: the scripts are read, checked with ``bash -n``, and scripts/setup runs once
against a venv that already holds everything (the second run a user makes), which must do nothing.
"""

from __future__ import annotations

import hashlib
import http.server
import importlib.util
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: the base dependency tomli
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
SETUP, TEST, CI = REPO / "scripts" / "setup", REPO / "scripts" / "test", REPO / ".ci" / "run"
CHECK_SCRIPT = REPO / "scripts" / "check_fresh_install.sh"


def _torch_index() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torch_index", REPO / "scripts" / "torch_index.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["torch_index"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _readme_commands() -> list[list[str]]:
    """The README's set-up block as scripts/check_fresh_install.sh reads it, one argument vector a line."""
    done = subprocess.run(["bash", str(CHECK_SCRIPT), "--print-setup"], capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 0, done.stderr
    return [shlex.split(line, comments=True) for line in done.stdout.splitlines() if line.strip()]


def test_the_readme_setup_is_the_two_scripts_and_their_options_exist() -> None:
    assert _readme_commands() == [["scripts/setup"], ["scripts/test"]]
    readme = (REPO / "README.md").read_text()
    for script, options in ((SETUP, ("--no-demo",)), (TEST, ("--quick", "--install-only"))):
        text = script.read_text()
        assert os.access(script, os.X_OK), f"{script.name} is not executable"
        assert text.startswith("#!/usr/bin/env bash\n") and "\nset -euo pipefail\n" in text
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
        for option in options:
            assert re.search(rf"^\s*{option}\)|\"{option}\" \]", text, re.M), f"{script.name} does not handle {option}"
    assert "--no-demo" in readme and "--quick" in readme


def test_setup_installs_cpu_torch_into_the_venv_before_edgefleet() -> None:
    text = SETUP.read_text()
    pin = re.search(r"^TORCH_VERSION=(\S+)$", text, re.M)
    assert pin, "scripts/setup pins no torch version"
    train = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    (wanted,) = [Requirement(r) for r in train if Requirement(r).name == "torch"]
    assert SpecifierSet(str(wanted.specifier)).contains(pin.group(1)), f"torch {pin.group(1)} is outside the train extra's {wanted}"
    torch_at = text.index('pip install -q "torch==$TORCH_VERSION" "${index_args[@]}"')
    ours_at = text.index('pip install -q -e ".[$extras]"')
    assert text.index("scripts/torch_index.py") < torch_at < ours_at, "the probe, then torch, then edgefleet"
    assert re.search(r"^extras=demo$", text, re.M)
    pips = re.findall(r"(\S+) -m pip install", text)
    assert pips and set(pips) == {'"$VPY"'}, f"pip must install into the venv only: {pips}"
    assert "--break-system-packages" not in text and "--user" not in text


def test_scripts_test_builds_on_setup_and_ci_runs_it_in_the_venv() -> None:
    test = TEST.read_text()
    assert "bash scripts/setup --no-demo" in test and '"$VPY" -m pip install -q -e ".[test]"' in test
    assert 'args+=(-m "not lab and not deploy")' in test
    ci = CI.read_text()
    assert "bash scripts/test --install-only" in ci and re.search(r"^bash scripts/test$", ci, re.M)
    assert '"$VENV/bin/python" -m ruff check .' in ci and '"$VENV/bin/python" -m mypy' in ci
    assert "python3 -m pip" not in ci, "the system's pip refuses on Debian 12 (externally-managed-environment)"
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert {Requirement(r).name for r in extra} >= {"ruff", "mypy", "pytest"}, "CI's ruff and mypy come from [test]"


def test_the_quick_markers_are_registered() -> None:
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert {m.split(":")[0] for m in markers} >= {"lab", "deploy"}


def test_a_second_setup_does_nothing(tmp_path: Path) -> None:
    """A venv that has torch and the stamp of this pyproject.toml: no pip, no apt, no demo; exit 0."""
    if subprocess.run([sys.executable, "-c", "import torch"], check=False).returncode != 0:
        pytest.skip("torch is not installed here")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    # A wrapper, not a link: a link to a venv's python outside its venv would be the base Python.
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".edgefleet-demo").write_text(hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest() + "\n")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env |= {"EDGEFLEET_VENV": str(venv), "EDGEFLEET_PYTHON": sys.executable,
            "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}"}
    if not (Path("/usr/sbin/mosquitto").exists() or subprocess.run(["sh", "-c", "command -v mosquitto"],
                                                                     capture_output=True, check=False).returncode == 0):
        pytest.skip("mosquitto is not installed: the set-up would install it")
    done = subprocess.run(["bash", str(SETUP), "--no-demo"], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "already in" in done.stderr and "nothing to do" in done.stderr, done.stderr
    assert "pip install" not in done.stderr and "apt-get" not in done.stderr, done.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when this returns: a connection is refused at once


@pytest.fixture
def index_server() -> Iterator[str]:
    """A local HTTP server that answers HEAD (200 for /, 404 elsewhere), like a reachable index."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_the_cpu_index_is_used_when_it_answers(index_server: str) -> None:
    torch_index = _torch_index()
    chosen = torch_index.choose_index({}, url=index_server, timeout_s=5)
    assert chosen.pip_args == ("--index-url", index_server) and "CPU index" in chosen.reason
    assert torch_index.reachable(index_server + "no/such/page", timeout_s=5), "a 404 is an answer"


def test_an_unreachable_cpu_index_falls_back_to_pips_configuration_and_says_so() -> None:
    torch_index = _torch_index()
    url = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    chosen = torch_index.choose_index({}, url=url, timeout_s=2)
    assert chosen.pip_args == ()
    assert url in chosen.reason and "did not answer" in chosen.reason and torch_index.ENV_VAR in chosen.reason
    assert not torch_index.reachable("not a url", timeout_s=2)


def test_the_override_needs_no_probe() -> None:
    torch_index = _torch_index()
    unreachable = f"http://127.0.0.1:{_closed_port()}/"
    mirror = torch_index.choose_index({torch_index.ENV_VAR: "https://mirror.example/whl/cpu"}, url=unreachable)
    assert mirror.pip_args == ("--index-url", "https://mirror.example/whl/cpu")
    assert torch_index.choose_index({torch_index.ENV_VAR: "pip"}, url=unreachable).pip_args == ()
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "torch_index.py")], capture_output=True, text=True,
                          env={**os.environ, torch_index.ENV_VAR: "https://mirror.example/whl/cpu"}, timeout=30, check=False)
    assert done.returncode == 0 and done.stdout.splitlines() == ["--index-url", "https://mirror.example/whl/cpu"]
    assert "mirror.example" in done.stderr
