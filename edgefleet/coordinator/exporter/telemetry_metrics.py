"""Which :class:`~edgefleet.protocol.messages.TelemetrySample` field becomes which Prometheus metric.

Every numeric field of a sample is exported, so a field added to the telemetry later (GPU load,
throttling flags, disk usage) shows up on ``/metrics`` with no change here: its metric name is
derived from the field name and the unit suffix it carries (house style puts units in field
names), converted to Prometheus' base units (``_percent`` becomes a 0-1 ``_ratio``, ``_mhz``
``_hertz``). :data:`NAMED_FIELDS` gives the established fields the names and help texts
Grafana users expect; add a row there to rename a derived metric or improve its help.

A field that is ``None`` (not reported by that board) is left out, never exported as 0. Rates are not
gauges here: ``cpu_percent`` and every ``…_bytes_per_s`` field become counters in
:mod:`.board_counters` (``…_cpu_seconds_total``, ``…_bytes_total``), so this module leaves them out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import DataclassInstance  # typeshed's protocol of a dataclass instance: no runtime module

PREFIX = "edgefleet_board_"


@dataclass(frozen=True, slots=True)
class FieldMetric:
    """How one telemetry field is exported."""

    name: str            # the full metric name, e.g. edgefleet_board_power_watts
    help: str
    scale: float = 1.0   # multiplies the field's value (percent -> ratio: 0.01)
    label: str = ""      # for a dict field: the label its keys go in (e.g. "sensor")


@dataclass(frozen=True, slots=True)
class _Unit:
    suffix: str          # the field name's unit suffix
    metric_suffix: str   # the Prometheus base unit
    scale: float
    words: str           # for the derived help text


# Longest suffix first: "_bytes_per_s" must win over "_s".
_UNITS = (
    _Unit("_bytes_per_s", "_bytes_per_second", 1.0, "bytes per second"),
    _Unit("_percent", "_ratio", 0.01, "0-1, reported in percent"),
    _Unit("_bytes", "_bytes", 1.0, "bytes"),
    _Unit("_mhz", "_hertz", 1e6, "Hz, reported in MHz"),
    _Unit("_c", "_celsius", 1.0, "degrees Celsius"),
    _Unit("_w", "_watts", 1.0, "watts"),
    _Unit("_s", "_seconds", 1.0, "seconds"),
)

# Fields that are not levels: identity, bookkeeping, or exported in their own way (power_source in
# edgefleet_board_power_info; the per-core list would add a series per core; CPU load and the board's
# energy counter feed the counters of board_counters).
SKIPPED_FIELDS = frozenset({"board_id", "ts", "seq", "interval_s", "schema_version", "power_source", "cpu_percent_per_core",
                            "cpu_percent", "energy_wh"})
RATE_SUFFIX = "_bytes_per_s"  # a byte rate: a counter (board_counters), never a gauge

NAMED_FIELDS: dict[str, FieldMetric] = {
    "cpu_freq_mhz": FieldMetric(f"{PREFIX}cpu_frequency_hertz", "current CPU clock", 1e6),
    "load_avg_1m": FieldMetric(f"{PREFIX}load1", "1-minute load average"),
    "load_avg_5m": FieldMetric(f"{PREFIX}load5", "5-minute load average"),
    "load_avg_15m": FieldMetric(f"{PREFIX}load15", "15-minute load average"),
    "mem_total_bytes": FieldMetric(f"{PREFIX}memory_total_bytes", "RAM of the board"),
    "mem_used_bytes": FieldMetric(f"{PREFIX}memory_used_bytes", "RAM in use (total - available)"),
    "mem_available_bytes": FieldMetric(f"{PREFIX}memory_available_bytes", "RAM available to new work"),
    "mem_percent": FieldMetric(f"{PREFIX}memory_used_ratio", "RAM in use (0-1)", 0.01),
    "swap_total_bytes": FieldMetric(f"{PREFIX}swap_total_bytes", "swap space"),
    "swap_used_bytes": FieldMetric(f"{PREFIX}swap_used_bytes", "swap in use"),
    "temp_c": FieldMetric(f"{PREFIX}temperature_celsius", "hottest temperature sensor"),
    "temps_c": FieldMetric(f"{PREFIX}sensor_temperature_celsius", "each temperature sensor", label="sensor"),
    "power_w": FieldMetric(f"{PREFIX}power_watts", "power drawn by the board at its last sample; "
                                                   "edgefleet_board_power_info says where it comes from"),
    "power_rails_w": FieldMetric(f"{PREFIX}power_rail_watts", "power per measured rail", label="rail"),
    "gpu_load_percent": FieldMetric(f"{PREFIX}gpu_utilization_ratio", "a Jetson's iGPU busy (0-1)", 0.01),
    "gpu_mem_used_bytes": FieldMetric(f"{PREFIX}gpu_memory_used_bytes", "a Jetson's iGPU memory in use (shared with the CPU)"),
    "gpu_mem_total_bytes": FieldMetric(f"{PREFIX}gpu_memory_total_bytes", "the RAM a Jetson's iGPU shares"),
    "throttled_bits": FieldMetric(f"{PREFIX}throttled_bits", "a Pi's raw vcgencmd get_throttled value (the flags below, "
                                                             "decoded)"),
    "under_voltage_now": FieldMetric(f"{PREFIX}under_voltage_now", "1 while a Pi's firmware sees under-voltage"),
    "freq_capped_now": FieldMetric(f"{PREFIX}freq_capped_now", "1 while a Pi's firmware caps the ARM frequency"),
    "throttled_now": FieldMetric(f"{PREFIX}throttled_now", "1 while a Pi's firmware throttles the CPU"),
    "soft_temp_limit_now": FieldMetric(f"{PREFIX}soft_temp_limit_now", "1 while a Pi is at its soft temperature limit"),
    "under_voltage_since_boot": FieldMetric(f"{PREFIX}under_voltage_since_boot", "1 if a Pi saw under-voltage since boot"),
    "freq_capped_since_boot": FieldMetric(f"{PREFIX}freq_capped_since_boot", "1 if a Pi's frequency was capped since boot"),
    "throttled_since_boot": FieldMetric(f"{PREFIX}throttled_since_boot", "1 if a Pi was throttled since boot"),
    "soft_temp_limit_since_boot": FieldMetric(f"{PREFIX}soft_temp_limit_since_boot",
                                              "1 if a Pi reached its soft temperature limit since boot"),
    "disk_data_used_bytes": FieldMetric(f"{PREFIX}disk_data_used_bytes", "used on the file system of the agent's state_dir"),
    "disk_data_total_bytes": FieldMetric(f"{PREFIX}disk_data_total_bytes", "size of the file system of the agent's state_dir"),
    "disk_run_used_bytes": FieldMetric(f"{PREFIX}disk_run_used_bytes", "used on the file system jobs run in"),
    "disk_run_total_bytes": FieldMetric(f"{PREFIX}disk_run_total_bytes", "size of the file system jobs run in"),
}


def derived_metric(field_name: str) -> FieldMetric:
    """The metric of a field not in :data:`NAMED_FIELDS`: ``gpu_load_percent`` -> ``edgefleet_board_gpu_load_ratio``."""
    for unit in _UNITS:
        if field_name.endswith(unit.suffix) and len(field_name) > len(unit.suffix):
            stem = field_name[: -len(unit.suffix)]
            return FieldMetric(f"{PREFIX}{stem}{unit.metric_suffix}", f"telemetry field {field_name} ({unit.words})",
                               unit.scale, label="name")
    return FieldMetric(f"{PREFIX}{field_name}", f"telemetry field {field_name}", label="name")


def metric_for(field_name: str) -> FieldMetric:
    """How the telemetry field ``field_name`` is exported."""
    return NAMED_FIELDS.get(field_name) or derived_metric(field_name)


@dataclass(frozen=True, slots=True)
class FieldValue:
    """One value a sample gives one metric: a scalar (``key`` None) or one entry of a dict field."""

    metric: FieldMetric
    value: float
    key: str | None = None


def _number(value: object) -> float | None:
    """``value`` as a float: bools as 0/1; None, text, lists and non-finite numbers as None."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)):
        number = float(value)
        return number if math.isfinite(number) else None
    return None


def sample_values(sample: DataclassInstance) -> Iterator[FieldValue]:
    """Every exported value of a telemetry sample (any dataclass instance), in field order.

    Scalars (int, float, bool) give one value; a ``dict[str, number]`` gives one per key; None,
    text and lists are skipped, so an optional field a board does not report costs nothing.
    """
    for f in dataclasses.fields(sample):
        if f.name in SKIPPED_FIELDS or f.name.endswith(RATE_SUFFIX):
            continue
        raw = getattr(sample, f.name)
        if isinstance(raw, dict):
            metric = metric_for(f.name)
            for key, item in raw.items():
                number = _number(item)
                if number is not None:
                    yield FieldValue(metric, number * metric.scale, str(key))
            continue
        number = _number(raw)
        if number is not None:
            metric = metric_for(f.name)
            yield FieldValue(metric, number * metric.scale)


__all__ = ["NAMED_FIELDS", "PREFIX", "RATE_SUFFIX", "SKIPPED_FIELDS", "FieldMetric", "FieldValue", "derived_metric", "metric_for",
           "sample_values"]
