"""The board's energy total (``agent.energy``): the trapezoid rule over the readings, gaps left out, the total kept
in the state_dir across restarts; and a real agent whose ``energy_wh`` goes on from where it stopped."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from edgefleet.agent.energy import SAVE_EVERY_S, EnergyMeter, energy_file_path, load_energy_wh
from edgefleet.brokers.local_broker import LocalBroker
from edgefleet.protocol.messages import TelemetrySample
from edgefleet.protocol.topics import telemetry_topic
from tests.agent.test_home_assistant import late_message
from tests.board_watch import PREFIX
from tests.conftest import AgentFactory
from tests.helpers import wait_until


class Clock:
    """Monotonic seconds that the test moves forward."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_readings_integrate_by_the_trapezoid_rule_and_gaps_add_nothing(tmp_path: Path) -> None:
    clock = Clock()
    meter = EnergyMeter(board_id="pi-1", interval_s=1.0, record=None, clock=clock)
    assert meter.add(None) is None  # no power reading yet: no total to report
    assert meter.add(3.0) == 0.0
    clock.now += 1800
    assert meter.add(5.0) == 0.0  # 30 minutes apart: far past MAX_GAP_INTERVALS, not guessed
    start = clock.now
    for _ in range(3600):         # an hour at 1 s, from 5 W rising by 1 mW a second to 8.6 W
        clock.now += 1.0
        meter.add(5.0 + (clock.now - start) / 1000)
    expected = 5.0 + 3.6 / 2      # an hour at the ramp's mean: exact under the trapezoid rule
    assert meter.total_wh == pytest.approx(expected, abs=1e-9)
    clock.now += 1.0
    assert meter.add(None) == round(expected, 4)  # a failed reading keeps the total and breaks the segment
    clock.now += 1.0
    meter.add(100.0)
    assert meter.total_wh == pytest.approx(expected, abs=1e-9)


def test_the_total_survives_a_restart_through_the_state_dir(tmp_path: Path) -> None:
    record = energy_file_path(str(tmp_path), "pi-1")
    assert record is not None and energy_file_path("", "pi-1") is None
    clock = Clock()
    meter = EnergyMeter(board_id="pi-1", interval_s=1.0, record=record, clock=clock)
    meter.add(36.0)
    clock.now += 1.0
    meter.add(36.0)               # 36 W for 1 s: 0.01 Wh
    assert not record.exists()    # written every SAVE_EVERY_S, not every sample
    clock.now += SAVE_EVERY_S
    meter.add(None)
    assert load_energy_wh(record, "pi-1") == pytest.approx(0.01)
    clock.now += 1.0
    meter.add(36.0)
    clock.now += 1.0
    meter.add(36.0)
    meter.save()                  # the agent's clean stop
    assert json.loads(record.read_text())["energy_wh"] == pytest.approx(0.02)
    assert record.stat().st_mode & 0o777 == 0o600

    again = EnergyMeter(board_id="pi-1", interval_s=1.0, record=record, clock=clock)
    assert again.add(36.0) == pytest.approx(0.02)  # goes on from the record, never back to 0
    # Another board's record (a copied state_dir) or a broken one is not used: counting starts at 0.
    assert EnergyMeter(board_id="pi-2", interval_s=1.0, record=record, clock=clock).add(1.0) == 0.0
    with pytest.raises(ValueError, match="of board 'pi-1', not of 'pi-2'"):
        load_energy_wh(record, "pi-2")
    record.write_text('{"version": 1, "board_id": "pi-1", "energy_wh": -3}')
    with pytest.raises(ValueError, match="not a number"):
        load_energy_wh(record, "pi-1")


def _energy(broker: LocalBroker, board: str) -> float:
    return float(TelemetrySample.from_json(late_message(broker, telemetry_topic(PREFIX, board))).energy_wh or 0)


def test_a_real_agent_goes_on_from_its_saved_total_after_a_restart(mosquitto: LocalBroker, agents: AgentFactory,
                                                                  tmp_path: Path) -> None:
    board = "energy-board-1"
    config = f'board_id = "{board}"\nstate_dir = "{tmp_path}"\n[power]\nsource = "estimated"\n[telemetry]\ninterval_s = 0.1\n'
    agent = agents.start(board, mosquitto.address, config=config)
    wait_until(lambda: _energy(mosquitto, board) > 0, timeout_s=20, what="a growing energy total")
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=20) == 0
    record = tmp_path / f"energy-{board}.json"
    saved = load_energy_wh(record, board)  # written at the clean stop
    assert saved > 0
    # As if it had run for months: a total no fresh count could reach in this test.
    record.write_text(json.dumps({"version": 1, "board_id": board, "energy_wh": saved + 1000.0}))

    agents.start(board, mosquitto.address, config=config)
    # Telemetry is not retained: the next sample is the restarted agent's, and it goes on from the record (the
    # telemetry's total is rounded to 0.1 mWh, so it may read up to half of that below the record).
    assert saved + 1000.0 - 0.00005 <= _energy(mosquitto, board) < saved + 1001.0
