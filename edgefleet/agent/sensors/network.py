"""Network throughput from interface byte counters, safe across wraps, resets and hot-plug."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import psutil

COUNTER_32 = 2**32
COUNTER_64 = 2**64


def counter_delta(previous: int, current: int) -> int:
    """Bytes between two readings of one interface counter.

    A counter that went down either wrapped (32-bit counters on some ARM drivers, 64-bit
    elsewhere) or was reset (driver reload, interface re-created). A wrap is assumed only when
    the previous value was close enough to the counter's limit; otherwise the counter restarted
    from zero and ``current`` bytes were counted since.
    """
    if current >= previous:
        return current - previous
    for limit in (COUNTER_32, COUNTER_64):
        if previous < limit:
            wrapped = current + limit - previous
            if wrapped <= limit // 4:  # a plausible amount for one interval
                return wrapped
            break
    return current


def rates(previous: Mapping[str, tuple[int, int]], current: Mapping[str, tuple[int, int]], elapsed_s: float) -> tuple[float, float]:
    """Summed (rx, tx) bytes per second over interfaces present in both readings.

    An interface that appeared since the previous reading has no baseline and adds nothing;
    one that disappeared is left out.
    """
    if elapsed_s <= 0:
        return 0.0, 0.0
    rx = tx = 0
    for nic, (rx_now, tx_now) in current.items():
        if nic in previous:
            rx_before, tx_before = previous[nic]
            rx += counter_delta(rx_before, rx_now)
            tx += counter_delta(tx_before, tx_now)
    return rx / elapsed_s, tx / elapsed_s


def read_counters(interfaces: Iterable[str] = ()) -> dict[str, tuple[int, int]]:
    """Raw (rx, tx) byte counters per interface; loopback excluded unless named."""
    wanted = set(interfaces)
    counters = psutil.net_io_counters(pernic=True, nowrap=False)
    return {
        nic: (c.bytes_recv, c.bytes_sent)
        for nic, c in counters.items()
        if (nic in wanted if wanted else nic != "lo")
    }


class NetworkSource:
    name = "network"

    def __init__(self, interfaces: Iterable[str] = (), *, clock: Callable[[], float] = time.monotonic,
                 counters: Callable[[Iterable[str]], dict[str, tuple[int, int]]] = read_counters) -> None:
        self.interfaces = tuple(interfaces)
        self._clock = clock
        self._counters = counters
        self._previous = self._counters(self.interfaces)
        self._previous_t = self._clock()

    def available(self) -> bool:
        return True

    def read(self) -> dict[str, Any]:
        now_t, now = self._clock(), self._counters(self.interfaces)
        rx, tx = rates(self._previous, now, now_t - self._previous_t)
        self._previous, self._previous_t = now, now_t
        return {"net_rx_bytes_per_s": round(rx, 1), "net_tx_bytes_per_s": round(tx, 1)}
