"""Hostile payloads a board (or anyone with its MQTT credentials) can publish, shared by the hostile tests."""

from __future__ import annotations

import json
from typing import Any

# ~100 KB of nested JSON: over the size limit, and RecursionError in json.loads before the limits.
NESTED_100K = b"[" * 100_000
# Valid JSON nested 30,000 deep in 60 KB: under the size limit, so only the depth limit refuses it.
NESTED_VALID_60K = b"[" * 30_000 + b"]" * 30_000
# The same depth as objects, with brackets inside strings that must not count.
NESTED_OBJECTS = b'{"a":' * 5_000 + b'"[[[[{{{{"' + b"}" * 5_000

HUGE_INT = 10 ** 400  # 401 digits: json.loads takes it; float() of it raises OverflowError
MARKUP = "[bold red]x[/]"
CLOSING_TAG = "[/]"

# (field, value): a telemetry value no board can physically report, each refused naming its field.
ABSURD_TELEMETRY: list[tuple[str, Any]] = [
    ("mem_used_bytes", HUGE_INT),
    ("mem_total_bytes", -HUGE_INT),
    ("mem_used_bytes", -5),
    ("cpu_percent", 1e308),
    ("cpu_percent", 250.0),
    ("cpu_percent", -0.5),
    ("temp_c", float("nan")),
    ("temp_c", 5000.0),
    ("power_w", float("inf")),
    ("power_w", -3.0),
    ("power_w", 1e308),
    ("net_rx_bytes_per_s", -1.0),
    ("interval_s", 1e308),          # a sample that would never go stale
    ("interval_s", 0.0),
    ("seq", -1),
    ("ts", -1e308),
    ("cpu_percent_per_core", [10.0, HUGE_INT]),
    ("cpu_percent_per_core", [10.0] * 5000),
    ("temps_c", {"cpu": 1e308}),
    ("temps_c", {"x" * 300: 40.0}),
    ("power_rails_w", {"VDD_IN": float("-inf")}),
    ("power_source", "\x1b[2J\x1b[H"),  # a terminal escape: clear the screen
    ("power_source", "y" * 10_000),
]


def telemetry(board_id: str, seq: int = 1, **over: Any) -> bytes:
    """A telemetry sample as an agent sends it, with fields overridden (NaN and Infinity allowed: junk)."""
    sample: dict[str, Any] = {
        "board_id": board_id, "ts": 1.7e9 + seq, "seq": seq, "interval_s": 0.2, "cpu_percent": 12.5,
        "cpu_percent_per_core": [10.0, 15.0], "mem_total_bytes": 8_000_000_000, "mem_used_bytes": 2_000_000_000,
        "mem_available_bytes": 6_000_000_000, "mem_percent": 25.0, "net_rx_bytes_per_s": 100.0, "net_tx_bytes_per_s": 50.0,
        "temp_c": 48.3, "temps_c": {"cpu-thermal": 48.3}, "power_w": 3.2, "power_source": "ina3221",
        "power_rails_w": {"VDD_IN": 3.2}, "schema_version": 1}
    sample.update(over)
    return json.dumps(sample).encode()
