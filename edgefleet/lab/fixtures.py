"""pytest fixtures for the emulated fleet; a plugin any test directory (or benchmark) can load.

    # tests/lab/conftest.py loads these; elsewhere add to a conftest.py:
    pytest_plugins = ["edgefleet.lab.fixtures"]

    def test_something(lab):             # mixed4, agents online, keepalive 2 s
        rows = lab.status_json()

Why one shared lab per fleet: building a lab takes about a second, but its agents need several
seconds to start under their CPU quotas; tests that only look share it. At most one lab exists on
a machine (one bridge, one address plan), so asking for another fleet tears the current one
down first. The lab is always torn down: at the end of the session, on SIGTERM (turned into
KeyboardInterrupt so pytest runs its finalizers), and by ``atexit`` as a last resort.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edgefleet.lab.fleet_file import FleetError, load_fleet
from edgefleet.lab.host_check import lab_unavailable_reason
from edgefleet.lab.lab import Lab, LabBusy, LabUnavailable
from edgefleet.lab.naming import PREFIX

log = logging.getLogger(__name__)

FLEETS = Path(__file__).parent / "fleets"
MIXED4 = FLEETS / "mixed4.toml"
FLEET8 = FLEETS / "fleet8.toml"
TEST_KEEPALIVE_S = 2     # fault tests see a lost board within 3 s
TEST_INTERVAL_S = 0.5


class LabManager:
    """Holds at most one running lab, keyed by fleet file and options."""

    def __init__(self, logs_dir: Path) -> None:
        self.logs_dir = logs_dir
        self.current: Lab | None = None
        self._key: tuple[Any, ...] | None = None

    def get(self, fleet_path: Path, *, start_agents: bool = True, wait_online: bool = True) -> Lab:
        """The running lab for ``fleet_path`` (built if needed); skips the test if the machine can't."""
        key = (str(fleet_path), start_agents)
        if self.current is not None and self._key == key:
            return self.current
        self.release()
        try:
            fleet = load_fleet(fleet_path)
        except FleetError as exc:  # the shipped fleets' syntax is checked by test_fleet_file on any machine
            pytest.skip(f"{fleet_path.name} does not fit this machine: {exc}")
        lab = Lab(fleet, interval_s=TEST_INTERVAL_S, keepalive_s=TEST_KEEPALIVE_S,
                  start_agents=start_agents, logs_dir=self.logs_dir / fleet_path.stem)
        try:
            lab.up()
        except LabUnavailable as exc:
            pytest.skip(f"emulated fleet unavailable: {exc}")
        except LabBusy as exc:
            pytest.skip(str(exc))
        self.current, self._key = lab, key
        if start_agents and wait_online:
            try:
                lab.wait_online(timeout_s=90)
            except BaseException:
                self.release()
                raise
        return lab

    def release(self) -> None:
        """Tear the current lab down (if any)."""
        lab, self.current, self._key = self.current, None, None
        if lab is not None:
            lab.down()


def _interrupt_on_sigterm(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def lab_manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabManager]:
    """The session's lab holder; SIGTERM/SIGHUP become KeyboardInterrupt while it lives."""
    previous = {sig: signal.signal(sig, _interrupt_on_sigterm) for sig in (signal.SIGTERM, signal.SIGHUP)}
    manager = LabManager(tmp_path_factory.mktemp(f"{PREFIX}logs"))
    try:
        yield manager
    finally:
        manager.release()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@pytest.fixture
def lab(lab_manager: LabManager) -> Lab:
    """mixed4 (Pi 4, Pi 5, Jetson Nano, x86), every agent online; shared between tests."""
    return lab_manager.get(MIXED4)


@pytest.fixture
def lab8(lab_manager: LabManager) -> Lab:
    """fleet8 (eight boards, broker and coordinator in a gigabit server namespace), agents online."""
    return lab_manager.get(FLEET8)


@pytest.fixture
def no_lab(lab_manager: LabManager) -> None:
    """For tests that build labs of their own: the machine can run one, and no shared lab is up."""
    reason = lab_unavailable_reason()
    if reason:
        pytest.skip(f"emulated fleet unavailable: {reason}")
    lab_manager.release()


__all__ = ["FLEET8", "MIXED4", "LabManager", "lab", "lab8", "lab_manager", "no_lab"]
