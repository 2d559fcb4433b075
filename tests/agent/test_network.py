from __future__ import annotations

from edgefleet.agent.sensors.network import COUNTER_32, NetworkSource, counter_delta, rates


def test_counter_delta_normal_wrap_and_reset() -> None:
    assert counter_delta(100, 250) == 150
    assert counter_delta(COUNTER_32 - 100, 50) == 150          # 32-bit wrap
    assert counter_delta(2**40, 5_000) == 5_000                 # reset (driver reload): counted from zero
    assert counter_delta(COUNTER_32 - 10, COUNTER_32 - 20) == COUNTER_32 - 20  # not plausibly a wrap: reset


def test_rates_ignore_interfaces_without_a_baseline() -> None:
    before = {"eth0": (1000, 2000), "wlan0": (10, 10)}
    after = {"eth0": (3000, 2500), "usb0": (999_999, 999_999)}  # wlan0 gone, usb0 plugged in
    assert rates(before, after, 2.0) == (1000.0, 250.0)


def test_source_uses_its_clock_and_counters() -> None:
    times = iter([0.0, 0.5, 1.5])
    readings = iter([{"eth0": (0, 0)}, {"eth0": (500, 100)}, {"eth0": (1500, 100)}])
    source = NetworkSource(clock=lambda: next(times), counters=lambda _: next(readings))
    assert source.read() == {"net_rx_bytes_per_s": 1000.0, "net_tx_bytes_per_s": 200.0}
    assert source.read() == {"net_rx_bytes_per_s": 1000.0, "net_tx_bytes_per_s": 0.0}
