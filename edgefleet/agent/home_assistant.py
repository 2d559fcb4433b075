"""Home Assistant MQTT discovery: the board as one device with a sensor per telemetry field.

With ``telemetry.home_assistant = true`` the agent publishes, retained, one discovery config per
sensor on ``<discovery_prefix>/<component>/<node_id>/<object_id>/config`` (Home Assistant's
documented format; ``node_id`` and ``object_id`` may hold only ``[a-zA-Z0-9_-]``). Home Assistant
then reads the board's JSON telemetry itself: each config points ``state_topic`` at the telemetry
topic with a ``value_template`` that picks one field, and ties availability to the retained status
topic (``online`` and ``busy`` are available; ``offline``, also the last will, is not). No extra
telemetry is published for it. The exceptions: the board's state sensor (offline / idle / training
/ profiling) reads the retained status topic itself and is never unavailable; the energy sensor
(``energy_wh``, ``total_increasing``, for the Energy dashboard) and the training progress read
telemetry fields the agent adds to the sensors' own (``agent.energy``, ``JobRunner.progress``).

A sensor is announced once its field has held a value (so a board without a GPU gets no GPU
sensor, and the network rates, which need two samples, appear a second later); every announced
config is published again after each reconnect, so a broker restart without persistence loses
nothing. Units and device classes follow Home Assistant's ``SensorDeviceClass`` table: bytes are
``data_size`` in ``B``, rates ``data_rate`` in ``B/s``, each with a ``suggested_unit_of_measurement``
(GiB, MiB, GB, kB/s) for a Home Assistant that honours it; the native unit stays the byte.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any

from edgefleet.protocol.messages import BoardCaps, TelemetrySample
from edgefleet.protocol.topics import discovery_device_id, discovery_node_id, discovery_topic, status_topic, telemetry_topic

log = logging.getLogger(__name__)

AVAILABILITY_TEMPLATE = "{{ 'online' if value_json.state in ('online', 'busy') else 'offline' }}"
MIN_EXPIRE_AFTER_S = 10


@dataclass(frozen=True, slots=True)
class HaEntity:
    """One Home Assistant entity of a board.

    Attributes:
        object_id: its id within the device (the topic's object_id, the unique_id's end).
        name: shown after the device's name ("pi-1 CPU").
        fields: the TelemetrySample fields it needs, all of which must have held a value.
        template: the value_template; None picks ``fields[0]``.
        component: ``sensor`` or ``binary_sensor`` (``ON``/``OFF``).
        unit, device_class: as Home Assistant's sensor table pairs them.
        numeric: a number with a ``state_class`` rather than text.
        diagnostic: shown under the device's diagnostics, not its sensors.
        state_class: of a numeric sensor: ``measurement``, or ``total_increasing`` for a meter.
        suggested_unit: the unit Home Assistant shows by default (``unit`` stays the native one).
        precision: ``suggested_display_precision``, decimals shown.
        source: the topic it reads, ``telemetry`` or ``status`` (the retained status: no ``expire_after``).
        availability: tied to the status (a sensor that shows the status itself is never unavailable).
        options: an ``enum`` sensor's possible states.
        attributes: a ``json_attributes_template`` over the same topic (extra attributes in Home Assistant).
    """

    object_id: str
    name: str
    fields: tuple[str, ...]
    template: str | None = None
    component: str = "sensor"
    unit: str | None = None
    device_class: str | None = None
    numeric: bool = True
    diagnostic: bool = False
    state_class: str = "measurement"
    suggested_unit: str | None = None
    precision: int | None = None
    source: str = "telemetry"
    availability: bool = True
    options: tuple[str, ...] = ()
    attributes: str | None = None


def _percent_of(used: str, total: str) -> str:
    return (f"{{{{ (100 * value_json.{used} / value_json.{total}) | round(1) "
            f"if value_json.{total} else None }}}}")


def _flag(field: str) -> str:
    return f"{{{{ 'ON' if value_json.{field} else 'OFF' }}}}"


# The board's state from its retained status: "busy" names its activity (an older agent's busy reads as training).
STATE_TEMPLATE = ("{{ 'offline' if value_json.state == 'offline' else 'idle' if value_json.state == 'online' "
                  "else value_json.activity | default('training', true) }}")
STATES = ("offline", "idle", "training", "profiling")
# The training job's steps as a percentage; None (Home Assistant: unknown) while no training job runs.
# ``get``: the fields are absent when idle, and Home Assistant warns about every undefined attribute it reads.
PROGRESS_TEMPLATE = ("{% set total = value_json.get('job_total_steps') %}"
                     "{{ ([100 * (value_json.get('job_steps_done') or 0) / total, 100] | min) | round(1) if total else None }}")
PROGRESS_ATTRIBUTES = "{{ {'steps_done': value_json.get('job_steps_done'), 'total_steps': value_json.get('job_total_steps')} | tojson }}"
ENERGY_ATTRIBUTES = ("{{ {'power_source': value_json.power_source, "
                     "'measured': value_json.power_source not in ('estimated', 'none')} | tojson }}")
STATUS_ATTRIBUTES = "{{ {'reason': value_json.get('reason', '')} | tojson }}"


ENTITIES: tuple[HaEntity, ...] = (
    HaEntity("state", "State", (), template=STATE_TEMPLATE, device_class="enum", numeric=False, source="status",
             availability=False, options=STATES, attributes=STATUS_ATTRIBUTES),
    HaEntity("job_progress_percent", "Training progress", (), template=PROGRESS_TEMPLATE, unit="%", precision=1,
             attributes=PROGRESS_ATTRIBUTES),
    HaEntity("energy_wh", "Energy", ("energy_wh",), unit="Wh", device_class="energy", state_class="total_increasing",
             precision=1, attributes=ENERGY_ATTRIBUTES),
    HaEntity("cpu_percent", "CPU", ("cpu_percent",), unit="%"),
    HaEntity("cpu_freq_mhz", "CPU frequency", ("cpu_freq_mhz",), unit="MHz", device_class="frequency"),
    HaEntity("load_avg_1m", "Load (1 min)", ("load_avg_1m",)),
    HaEntity("mem_used_bytes", "Memory used", ("mem_used_bytes",), unit="B", device_class="data_size", suggested_unit="GiB",
             precision=2),
    HaEntity("mem_percent", "Memory", ("mem_percent",), unit="%"),
    HaEntity("swap_used_bytes", "Swap used", ("swap_used_bytes",), unit="B", device_class="data_size", suggested_unit="MiB",
             precision=0),
    HaEntity("net_rx_bytes_per_s", "Network received", ("net_rx_bytes_per_s",), unit="B/s", device_class="data_rate",
             suggested_unit="kB/s", precision=1),
    HaEntity("net_tx_bytes_per_s", "Network sent", ("net_tx_bytes_per_s",), unit="B/s", device_class="data_rate",
             suggested_unit="kB/s", precision=1),
    HaEntity("temp_c", "Temperature", ("temp_c",), unit="°C", device_class="temperature"),
    HaEntity("power_w", "Power", ("power_w",), unit="W", device_class="power"),
    HaEntity("power_source", "Power source", ("power_source",), numeric=False, diagnostic=True),
    HaEntity("gpu_load_percent", "GPU load", ("gpu_load_percent",), unit="%"),
    HaEntity("gpu_mem_used_bytes", "GPU memory used", ("gpu_mem_used_bytes",), unit="B", device_class="data_size",
             suggested_unit="MiB", precision=0),
    HaEntity("disk_data_used_bytes", "Data disk used", ("disk_data_used_bytes",), unit="B", device_class="data_size",
             suggested_unit="GB", precision=1),
    HaEntity("disk_data_used_percent", "Data disk", ("disk_data_used_bytes", "disk_data_total_bytes"),
             template=_percent_of("disk_data_used_bytes", "disk_data_total_bytes"), unit="%"),
    HaEntity("disk_run_used_bytes", "Run disk used", ("disk_run_used_bytes",), unit="B", device_class="data_size",
             suggested_unit="GB", precision=1),
    HaEntity("disk_run_used_percent", "Run disk", ("disk_run_used_bytes", "disk_run_total_bytes"),
             template=_percent_of("disk_run_used_bytes", "disk_run_total_bytes"), unit="%"),
    HaEntity("under_voltage_now", "Under-voltage", ("under_voltage_now",), template=_flag("under_voltage_now"),
             component="binary_sensor", device_class="problem", numeric=False),
    HaEntity("throttled_now", "Throttled", ("throttled_now",), template=_flag("throttled_now"),
             component="binary_sensor", device_class="problem", numeric=False),
    HaEntity("under_voltage_since_boot", "Under-voltage since boot", ("under_voltage_since_boot",),
             template=_flag("under_voltage_since_boot"), component="binary_sensor", device_class="problem",
             numeric=False, diagnostic=True),
    HaEntity("throttled_since_boot", "Throttled since boot", ("throttled_since_boot",),
             template=_flag("throttled_since_boot"), component="binary_sensor", device_class="problem",
             numeric=False, diagnostic=True),
)


def node_id_for(board_id: str) -> str:
    """The board's discovery node_id: its id, or (ids with a '.') the id made valid plus a short hash, so two boards
    never share one (``protocol.topics.discovery_node_id``, which ``edge-coordinator forget`` clears too)."""
    return discovery_node_id(board_id)


def manufacturer_of(model: str) -> str:
    """The maker named by a board model string, or "" when the model does not say."""
    lowered = model.lower()
    if lowered.startswith("raspberry pi"):
        return "Raspberry Pi Ltd"
    if "jetson" in lowered or "nvidia" in lowered:
        return "NVIDIA"
    return ""


def device_info(caps: BoardCaps, node_id: str) -> dict[str, Any]:
    """The ``device`` map shared by every entity of the board (one device per board)."""
    device: dict[str, Any] = {"identifiers": [discovery_device_id(node_id)], "name": caps.board_id,
                              "sw_version": f"edgefleet {caps.agent_version}" if caps.agent_version else "edgefleet"}
    maker = manufacturer_of(caps.model)
    if maker:
        device["manufacturer"] = maker
    if caps.model:
        device["model"] = caps.model
    return device


def entity_config(entity: HaEntity, *, caps: BoardCaps, topic_prefix: str, interval_s: float,
                  power_source: str = "") -> dict[str, Any]:
    """The discovery payload of one entity of the board described by ``caps``."""
    node = node_id_for(caps.board_id)
    name = entity.name
    if entity.object_id in ("power_w", "energy_wh") and power_source == "estimated":
        name = f"{name} (estimated)"  # an estimate is never shown as a measurement
    state_topic = (status_topic if entity.source == "status" else telemetry_topic)(topic_prefix, caps.board_id)
    config: dict[str, Any] = {
        "name": name,
        "unique_id": f"edgefleet_{node}_{entity.object_id}",
        "state_topic": state_topic,
        "value_template": entity.template or f"{{{{ value_json.{entity.fields[0]} }}}}",
    }
    if entity.availability:
        config.update(availability_topic=status_topic(topic_prefix, caps.board_id), availability_template=AVAILABILITY_TEMPLATE,
                      payload_available="online", payload_not_available="offline")
    if entity.source == "telemetry":
        config["expire_after"] = max(MIN_EXPIRE_AFTER_S, math.ceil(3 * interval_s))  # three missed samples: unknown
    config.update(device=device_info(caps, node), origin={"name": "edgefleet", "sw_version": caps.agent_version or "unknown"})
    if entity.attributes is not None:
        config.update(json_attributes_topic=state_topic, json_attributes_template=entity.attributes)
    if entity.options:
        config["options"] = list(entity.options)
    if entity.component == "binary_sensor":
        config.update(payload_on="ON", payload_off="OFF")
    if entity.unit is not None:
        config["unit_of_measurement"] = entity.unit
    if entity.device_class is not None:
        config["device_class"] = entity.device_class
    if entity.suggested_unit is not None:
        config["suggested_unit_of_measurement"] = entity.suggested_unit
    if entity.precision is not None:
        config["suggested_display_precision"] = entity.precision
    if entity.numeric:
        config["state_class"] = entity.state_class
    if entity.diagnostic:
        config["entity_category"] = "diagnostic"
    return config


class HomeAssistantDiscovery:
    """The discovery configs of one board, announced as its fields start to hold values.

    ``observe`` is called with each sample on the sampling thread and ``configs`` after each
    (re)connect on the MQTT thread, hence the lock.
    """

    def __init__(self, *, caps: BoardCaps, topic_prefix: str, discovery_prefix: str, interval_s: float) -> None:
        self.caps = caps
        self.topic_prefix = topic_prefix
        self.discovery_prefix = discovery_prefix
        self.interval_s = interval_s
        self.node_id = node_id_for(caps.board_id)
        self._lock = threading.Lock()
        self._announced: dict[str, tuple[str, bytes]] = {}  # object_id -> (topic, payload)

    def _message(self, entity: HaEntity, power_source: str) -> tuple[str, bytes]:
        config = entity_config(entity, caps=self.caps, topic_prefix=self.topic_prefix, interval_s=self.interval_s,
                               power_source=power_source)
        topic = discovery_topic(self.discovery_prefix, entity.component, self.node_id, entity.object_id)
        return topic, json.dumps(config, separators=(",", ":"), ensure_ascii=False).encode()

    def observe(self, sample: TelemetrySample) -> list[tuple[str, bytes]]:
        """The (topic, payload) configs of the entities whose fields ``sample`` is the first to fill."""
        new: list[tuple[str, bytes]] = []
        with self._lock:
            for entity in ENTITIES:
                if entity.object_id in self._announced:
                    continue
                if all(getattr(sample, f) is not None for f in entity.fields):
                    self._announced[entity.object_id] = message = self._message(entity, sample.power_source)
                    new.append(message)
        if new:
            log.info("home assistant: announcing %d sensor(s) of %s under %s/", len(new), self.caps.board_id,
                     self.discovery_prefix)
        return new

    def configs(self) -> list[tuple[str, bytes]]:
        """Every config announced so far, to publish again after a reconnect."""
        with self._lock:
            return list(self._announced.values())


__all__ = ["ENTITIES", "STATES", "HaEntity", "HomeAssistantDiscovery", "device_info", "entity_config", "manufacturer_of",
           "node_id_for"]
