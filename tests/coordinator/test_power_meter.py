"""PowerMeter on a real FleetView fed real telemetry payloads, with a clock the test moves."""

from __future__ import annotations

from edgefleet.coordinator.control.fleet import FleetView
from edgefleet.coordinator.control.power_meter import PowerMeter
from edgefleet.protocol.messages import TelemetrySample
from edgefleet.protocol.topics import telemetry_topic
from tests.helpers import wait_until

PREFIX = "edgefleet/v1"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _send(view: FleetView, meter: PowerMeter, board: str, seq: int, power_w: float | None, source: str = "estimated") -> None:
    sample = TelemetrySample(board_id=board, ts=1e9 + seq, seq=seq, interval_s=0.2, power_w=power_w, power_source=source)
    before = meter.seen(board)
    view.ingest(telemetry_topic(PREFIX, board), sample.to_json())
    wait_until(lambda: meter.seen(board) > before, timeout_s=5, what=f"the meter to keep {board}'s sample {seq}")


def test_a_window_averages_the_samples_seen_inside_it_and_waits_for_a_late_one() -> None:
    clock = Clock()
    view = FleetView(PREFIX, clock=clock)
    with PowerMeter(view, ["pi", "orin", "quiet"], clock=clock) as meter:
        _send(view, meter, "pi", 1, 3.0)            # before the window: not counted
        clock.now = 1.0
        start = meter.start()
        clock.now = 2.0
        _send(view, meter, "pi", 2, 6.0)
        _send(view, meter, "orin", 1, 9.5, "ina3221")
        clock.now = 3.0
        _send(view, meter, "pi", 3, 8.0)
        clock.now = 4.0
        inside = meter.stop(wait_for_late=False)
        clock.now = 4.5                              # the quiet board's first sample comes after the window
        _send(view, meter, "quiet", 1, 2.5)
        late = meter.average(start, 4.0)

    assert inside["pi"].mean_power_w == 7.0 and inside["pi"].samples == 2 and not inside["pi"].measured
    assert inside["orin"].mean_power_w == 9.5 and inside["orin"].measured
    assert inside["quiet"].mean_power_w is None and inside["quiet"].samples == 0
    assert late["quiet"].mean_power_w == 2.5 and late["quiet"].samples == 1
    assert late["pi"] == inside["pi"]
