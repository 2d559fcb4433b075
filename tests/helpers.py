"""Small helpers shared by the tests: waiting on conditions (never sleeping to synchronise)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], *, timeout_s: float, interval_s: float = 0.05, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy; fail the test with ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def coordinator(*args: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    """Run the real ``edge-coordinator`` CLI in a subprocess."""
    return subprocess.run([sys.executable, "-m", "edgefleet.coordinator.cli", *args], capture_output=True, text=True, timeout=timeout_s)


def status_json(broker: str, *, config: Path | None = None) -> dict[str, dict[str, Any]]:
    """``edge-coordinator status --json`` as ``{board_id: row}``; ``{}`` if the CLI failed."""
    global_args = ("--config", str(config)) if config else ()
    result = coordinator("--broker", broker, *global_args, "status", "--json", "--wait", "2")
    if result.returncode != 0:
        assert "Traceback" not in result.stderr, result.stderr
        return {}
    return {row["board_id"]: row for row in json.loads(result.stdout)}


def interrupt_after(cmd: list[str], progress: Callable[[], int], at_least: int, *, what: str,
                    timeout_s: float = 180) -> tuple[int, str, str]:
    """Run ``cmd``, press Ctrl-C (SIGINT) once ``progress()`` reaches ``at_least``; (exit code, stdout, stderr)."""
    import signal

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: progress() >= at_least, timeout_s=timeout_s, what=what)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err


def wait_boards_online(broker: str, boards: list[str], *, timeout_s: float = 30) -> None:
    """Until ``edge-coordinator status`` shows every board in ``boards`` online (as train checks before it starts)."""
    wait_until(lambda: all(status_json(broker).get(board, {}).get("state") == "online" for board in boards),
               timeout_s=timeout_s, interval_s=0.2, what=f"{', '.join(boards)} online")
