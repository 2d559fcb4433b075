"""Why a board slowed down, in a few words, from what the board reports.

The rebalancer (``run.rebalance``) sees only step times. When it says a board slowed, this names the
likely cause from the board's latest telemetry and its caps, in this order:

1. its firmware throttles it now (a Pi's ``vcgencmd get_throttled`` flags: throttled, frequency
   capped, soft temperature limit, under-voltage);
2. it is hot (``temp_c`` at or above :data:`HOT_C`);
3. it shares its machine with other boards or with this coordinator (the same host name in the caps:
   the demo's local boards, a lab): their training takes the same cores;
4. other processes load it (a 1-minute load average above the training's threads plus one);
5. else what was looked at: its temperature and that no throttling flag is set, or that it sent no
   telemetry.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

from edgefleet.protocol.messages import BoardCaps, TelemetrySample

HOT_C = 80.0  # a Pi 4/5 starts to throttle at 80-85 °C, a Jetson's CPU near 95 °C: a board this hot may be slowed
_FIRMWARE_FLAGS = (("throttled_now", "throttled"), ("freq_capped_now", "frequency capped"),
                   ("soft_temp_limit_now", "soft temperature limit"), ("under_voltage_now", "under-voltage"))


def slowdown_cause(board: str, *, telemetry: Mapping[str, TelemetrySample], caps: Mapping[str, BoardCaps],
                   this_host: str | None = None) -> str:
    """The likely cause of ``board``'s slowdown, e.g. ``"throttled by its firmware: soft temperature limit, 83 °C"``
    or ``"CPU shared: vm's 2 cores also run 2 other boards and the coordinator, 97% busy"``.

    Args:
        board: The board that slowed.
        telemetry: Each board's latest telemetry sample (boards without one are fine).
        caps: Each board's caps (for its host name, cores and training threads).
        this_host: The coordinator's host name (default: this machine's).
    """
    sample = telemetry.get(board)
    own = caps.get(board)
    temp = f", {sample.temp_c:.0f} °C" if sample is not None and sample.temp_c is not None else ""
    if sample is not None:
        flags = [words for name, words in _FIRMWARE_FLAGS if getattr(sample, name)]
        if flags:
            return f"throttled by its firmware: {', '.join(flags)}{temp}"
        if sample.temp_c is not None and sample.temp_c >= HOT_C:
            return f"hot: {sample.temp_c:.0f} °C"
    if own is not None:
        shared = _sharing(board, own, caps, socket.gethostname() if this_host is None else this_host)
        if shared:
            return f"CPU shared: {own.hostname}'s {own.cores} cores also run {shared}{_busy(sample)}"
        if sample is not None and sample.load_avg_1m is not None and sample.load_avg_1m > max(own.train_threads, 1) + 1:
            return (f"other processes: load {sample.load_avg_1m:.1f} on {own.cores} cores, training uses "
                    f"{max(own.train_threads, 1)}{temp}")
    if sample is None:
        return "cause unknown: no telemetry from it"
    flags_known = sample.throttled_bits is not None
    busy = f", CPU {sample.cpu_percent:.0f}% busy" if sample.cpu_percent is not None else ""
    return f"cause unknown{temp}{', no throttling flag' if flags_known else ''}{busy}"


def _sharing(board: str, own: BoardCaps, caps: Mapping[str, BoardCaps], this_host: str) -> str:
    """Who else runs on ``board``'s machine: "2 other boards and the coordinator", or ""."""
    others = sum(1 for b, c in caps.items() if b != board and c.hostname == own.hostname)
    parts = [f"{others} other board{'s' if others != 1 else ''}"] if others else []
    if own.hostname == this_host:
        parts.append("the coordinator")
    return " and ".join(parts)


def _busy(sample: TelemetrySample | None) -> str:
    return f", {sample.cpu_percent:.0f}% busy" if sample is not None and sample.cpu_percent is not None else ""


__all__ = ["HOT_C", "slowdown_cause"]
