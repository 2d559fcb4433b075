"""Home Assistant MQTT discovery: the configs checked against the schema Home Assistant documents, and
published retained by a real agent through a real Mosquitto."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from edgefleet.agent.home_assistant import ENTITIES, HomeAssistantDiscovery, entity_config, manufacturer_of, node_id_for
from edgefleet.agent.sensors.power_rpi5_pmic import parse_throttled
from edgefleet.agent.sensors.throttling import throttle_fields
from edgefleet.brokers.local_broker import LocalBroker
from edgefleet.protocol.messages import BoardCaps, BoardStatus, TelemetrySample
from edgefleet.protocol.topics import caps_topic, status_topic, telemetry_topic
from tests.board_watch import PREFIX, BoardWatch
from tests.conftest import AgentFactory
from tests.helpers import wait_until

# What Home Assistant documents and enforces, copied from its sources (home-assistant/core):
# - the topic: <discovery_prefix>/<component>/[<node_id>/]<object_id>/config, ids of [a-zA-Z0-9_-]
#   (docs/mqtt discovery "Discovery topic"; mqtt/discovery.py's topic regex);
# - sensor and binary_sensor need state_topic (MQTT_RO_SCHEMA); a device needs "identifiers" or
#   "connections" (mqtt/schemas.py validate_device_has_at_least_one_identifier); availability_topic,
#   availability_template, payload_available/payload_not_available (MQTT_AVAILABILITY_SINGLE_SCHEMA);
# - a sensor device class's allowed units and state classes (sensor/const.py DEVICE_CLASS_UNITS and
#   DEVICE_CLASS_STATE_CLASSES; UnitOfInformation / UnitOfDataRate in const.py);
# - binary sensor device classes (binary_sensor/__init__.py BinarySensorDeviceClass);
# - entity_category is "config" or "diagnostic", and a sensor cannot be "config" (helpers/entity.py);
# - an "enum" sensor has options and neither unit nor state_class (mqtt/sensor.py
#   validate_sensor_state_and_device_class_config); json_attributes_template reads json_attributes_topic;
# - suggested_unit_of_measurement is a unit the device class converts to (sensor/__init__.py; an MQTT
#   discovery schema that does not list it drops it, extra=REMOVE_EXTRA, so the native unit still stands);
# - the Energy dashboard takes a sensor of device_class energy, state_class total or total_increasing,
#   in an energy unit (energy/validate.py).
TOPIC = re.compile(r"^(?P<prefix>.+)/(?P<component>sensor|binary_sensor)/(?P<node>[a-zA-Z0-9_-]+)/(?P<object>[a-zA-Z0-9_-]+)/config$")
COMMON_KEYS = {"name", "unique_id", "state_topic", "value_template", "availability_topic", "availability_template",
               "payload_available", "payload_not_available", "availability", "availability_mode", "device", "origin",
               "entity_category", "icon", "qos", "expire_after", "force_update", "json_attributes_topic",
               "json_attributes_template", "enabled_by_default", "object_id", "encoding", "device_class"}
COMPONENT_KEYS = {"sensor": COMMON_KEYS | {"unit_of_measurement", "state_class", "suggested_display_precision",
                                           "suggested_unit_of_measurement", "last_reset_value_template", "options"},
                  "binary_sensor": COMMON_KEYS | {"payload_on", "payload_off", "off_delay"}}
DEVICE_KEYS = {"identifiers", "connections", "manufacturer", "model", "model_id", "name", "hw_version", "serial_number",
               "sw_version", "via_device", "suggested_area", "configuration_url"}
INFORMATION = {"bit", "kbit", "Mbit", "Gbit", "B", "kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB",
               "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"}
DATA_RATE = {"bit/s", "kbit/s", "Mbit/s", "Gbit/s", "B/s", "kB/s", "MB/s", "GB/s", "KiB/s", "MiB/s", "GiB/s"}
SENSOR_DEVICE_CLASS_UNITS: dict[str, set[str]] = {  # the numeric classes an edge board can use
    "temperature": {"°C", "°F", "K"}, "power": {"W", "kW", "MW", "GW", "TW"}, "data_size": INFORMATION,
    "data_rate": DATA_RATE, "frequency": {"Hz", "kHz", "MHz", "GHz"}, "voltage": {"V", "mV", "µV", "kV", "MV"},
    "current": {"A", "mA"}, "energy": {"J", "kJ", "MJ", "GJ", "mWh", "Wh", "kWh", "MWh", "GWh", "TWh"},
    "duration": {"d", "h", "min", "s", "ms"}, "battery": {"%"}, "humidity": {"%"}}
STATE_CLASSES = {"measurement", "total", "total_increasing"}
DEVICE_CLASS_STATE_CLASSES: dict[str, set[str]] = {
    "temperature": {"measurement"}, "power": {"measurement"}, "data_size": STATE_CLASSES, "data_rate": {"measurement"},
    "frequency": {"measurement"}, "voltage": {"measurement"}, "current": {"measurement"}, "energy": {"total", "total_increasing"},
    "duration": STATE_CLASSES, "battery": {"measurement"}, "humidity": {"measurement"}}
BINARY_DEVICE_CLASSES = {"battery", "battery_charging", "carbon_monoxide", "cold", "connectivity", "door", "garage_door", "gas",
                         "heat", "light", "lock", "moisture", "motion", "moving", "occupancy", "opening", "plug", "power",
                         "presence", "problem", "running", "safety", "smoke", "sound", "tamper", "update", "vibration", "window"}


def schema_problems(topic: str, config: Any, discovery_prefix: str = "homeassistant") -> list[str]:
    """Everything in one discovery message that Home Assistant's documented schema would refuse or misread."""
    m = TOPIC.match(topic)
    if m is None or m["prefix"] != discovery_prefix:
        return [f"topic {topic!r} is not {discovery_prefix}/<component>/<node_id>/<object_id>/config"]
    if not isinstance(config, dict):
        return ["payload is not a JSON object"]
    component, problems = m["component"], []
    problems += [f"unknown key {k!r}" for k in sorted(set(config) - COMPONENT_KEYS[component])]
    for key in ("state_topic", "unique_id", "device"):
        if not config.get(key):
            problems.append(f"{key} missing")
    if "json_attributes_template" in config and not config.get("json_attributes_topic"):
        problems.append("json_attributes_template without json_attributes_topic")
    device = config.get("device") or {}
    problems += [f"unknown device key {k!r}" for k in sorted(set(device) - DEVICE_KEYS)]
    ids = device.get("identifiers")
    if not (isinstance(ids, list) and ids and all(isinstance(i, str) and i for i in ids)):
        problems.append("device has no identifiers")
    cls, unit, state_class = config.get("device_class"), config.get("unit_of_measurement"), config.get("state_class")
    if component == "sensor":
        options = config.get("options")
        if cls == "enum" or options is not None:
            if cls != "enum" or unit is not None or state_class is not None:
                problems.append(f"options with device_class {cls!r}, unit {unit!r}, state_class {state_class!r}")
            if not (isinstance(options, list) and options and all(isinstance(o, str) for o in options)):
                problems.append(f"enum options {options!r}")
        elif cls is not None and (cls not in SENSOR_DEVICE_CLASS_UNITS or unit not in SENSOR_DEVICE_CLASS_UNITS[cls]):
            problems.append(f"device_class {cls!r} with unit {unit!r}")
        suggested = config.get("suggested_unit_of_measurement")
        if suggested is not None and (unit is None or suggested not in SENSOR_DEVICE_CLASS_UNITS.get(cls or "", set())):
            problems.append(f"suggested unit {suggested!r} for device_class {cls!r} in {unit!r}")
        precision = config.get("suggested_display_precision")
        if precision is not None and (not isinstance(precision, int) or precision < 0):
            problems.append(f"suggested_display_precision {precision!r}")
        if state_class is not None and (state_class not in STATE_CLASSES or
                                        (cls is not None and state_class not in DEVICE_CLASS_STATE_CLASSES.get(cls, set()))):
            problems.append(f"state_class {state_class!r} with device_class {cls!r}")
        if config.get("entity_category") not in (None, "diagnostic"):
            problems.append(f"entity_category {config.get('entity_category')!r}")
    elif cls not in (None, *BINARY_DEVICE_CLASSES):
        problems.append(f"binary_sensor device_class {cls!r}")
    if not isinstance(config.get("expire_after", 1), int) or config.get("expire_after", 1) <= 0:
        problems.append("expire_after is not a positive integer")
    return problems


def render(template: str, payload: bytes) -> str:
    """A value/availability template applied to a payload as Home Assistant does (Jinja2, ``value_json`` = the JSON)."""
    jinja2 = pytest.importorskip("jinja2")
    return str(jinja2.Environment().from_string(template).render(value_json=json.loads(payload), value=payload.decode()))


CAPS = BoardCaps(board_id="pi-5", hostname="pi-5", model="Raspberry Pi 5 Model B Rev 1.0", machine="aarch64", cores=4,
                 ram_bytes=8 << 30, power_source="rpi5-pmic", agent_version="0.1.0")
RICH = TelemetrySample(
    board_id="pi-5", ts=1.7e9, seq=2, interval_s=1.0, cpu_percent=31.5, cpu_freq_mhz=2400.0, load_avg_1m=0.5,
    mem_total_bytes=8 << 30, mem_used_bytes=2 << 30, mem_available_bytes=6 << 30, mem_percent=25.0, swap_total_bytes=1 << 29,
    swap_used_bytes=0, net_rx_bytes_per_s=812.0, net_tx_bytes_per_s=960.0, temp_c=51.3, power_w=3.05, power_source="rpi5-pmic",
    gpu_load_percent=4.8, gpu_mem_used_bytes=36904 * 1024, gpu_mem_total_bytes=3688892 * 1024,
    disk_data_used_bytes=3 << 30, disk_data_total_bytes=12 << 30, disk_run_used_bytes=3 << 30, disk_run_total_bytes=12 << 30,
    energy_wh=12.3456, job_steps_done=13, job_total_steps=40, **throttle_fields(parse_throttled("throttled=0x50000")))


def _messages(discovery: HomeAssistantDiscovery, samples: Iterable[TelemetrySample]) -> dict[str, dict[str, Any]]:
    return {topic: json.loads(payload) for sample in samples for topic, payload in discovery.observe(sample)}


def test_every_config_of_a_rich_board_passes_the_documented_schema() -> None:
    discovery = HomeAssistantDiscovery(caps=CAPS, topic_prefix=PREFIX, discovery_prefix="homeassistant", interval_s=1.0)
    configs = _messages(discovery, [RICH])
    assert len(configs) == len(ENTITIES)  # every field held a value
    for topic, config in configs.items():
        assert schema_problems(topic, config) == [], topic
    unique_ids = [c["unique_id"] for c in configs.values()]
    assert len(set(unique_ids)) == len(unique_ids)
    assert {json.dumps(c["device"], sort_keys=True) for c in configs.values()} == {json.dumps(
        {"identifiers": ["edgefleet_pi-5"], "name": "pi-5", "manufacturer": "Raspberry Pi Ltd",
         "model": "Raspberry Pi 5 Model B Rev 1.0", "sw_version": "edgefleet 0.1.0"}, sort_keys=True)}  # one device
    state = configs.pop("homeassistant/sensor/pi-5/state/config")  # the one entity that reads the status itself
    assert {c["state_topic"] for c in configs.values()} == {telemetry_topic(PREFIX, "pi-5")}
    assert {c["availability_topic"] for c in configs.values()} == {status_topic(PREFIX, "pi-5")}
    assert configs["homeassistant/sensor/pi-5/power_w/config"]["device_class"] == "power"
    assert configs["homeassistant/binary_sensor/pi-5/under_voltage_now/config"]["device_class"] == "problem"
    # The Energy dashboard's requirements (energy/validate.py): energy, total_increasing, an energy unit.
    energy = configs["homeassistant/sensor/pi-5/energy_wh/config"]
    assert (energy["device_class"], energy["state_class"], energy["unit_of_measurement"]) == ("energy", "total_increasing", "Wh")
    assert energy["name"] == "Energy" and energy["json_attributes_topic"] == telemetry_topic(PREFIX, "pi-5")
    # The board's state: from the retained status, an enum, never unavailable (offline is a state) and never expired.
    assert state["state_topic"] == status_topic(PREFIX, "pi-5") and state["device_class"] == "enum"
    assert state["options"] == ["offline", "idle", "training", "profiling"]
    assert not {"availability_topic", "expire_after", "state_class", "unit_of_measurement"} & set(state)
    progress = configs["homeassistant/sensor/pi-5/job_progress_percent/config"]
    assert (progress["unit_of_measurement"], progress["state_class"]) == ("%", "measurement")
    # Bytes stay the native unit; Home Assistant is told which unit to show.
    shown = {t.split("/")[-2]: (c["unit_of_measurement"], c.get("suggested_unit_of_measurement")) for t, c in configs.items()
             if c.get("device_class") in ("data_size", "data_rate")}
    assert shown == {"mem_used_bytes": ("B", "GiB"), "swap_used_bytes": ("B", "MiB"), "gpu_mem_used_bytes": ("B", "MiB"),
                     "disk_data_used_bytes": ("B", "GB"), "disk_run_used_bytes": ("B", "GB"),
                     "net_rx_bytes_per_s": ("B/s", "kB/s"), "net_tx_bytes_per_s": ("B/s", "kB/s")}


def test_the_schema_check_itself_catches_what_home_assistant_refuses() -> None:
    good = entity_config(ENTITIES[0], caps=CAPS, topic_prefix=PREFIX, interval_s=1.0)
    assert schema_problems("homeassistant/sensor/pi-5/cpu_percent/config", good) == []
    assert schema_problems("homeassistant/sensor/pi.5/cpu_percent/config", good)           # '.' in node_id
    assert schema_problems("homeassistant/sensor/pi-5/cpu_percent/config", good | {"device_class": "power"})  # unit %
    assert schema_problems("homeassistant/sensor/pi-5/cpu_percent/config", good | {"device": {"name": "x"}})
    assert schema_problems("homeassistant/sensor/pi-5/cpu_percent/config", good | {"state_klass": "measurement"})
    bytes_used = entity_config(next(e for e in ENTITIES if e.object_id == "mem_used_bytes"), caps=CAPS, topic_prefix=PREFIX,
                               interval_s=1.0)
    assert schema_problems("homeassistant/sensor/pi-5/mem_used_bytes/config", bytes_used) == []
    assert schema_problems("homeassistant/sensor/pi-5/mem_used_bytes/config", bytes_used | {"suggested_unit_of_measurement": "W"})
    energy = entity_config(next(e for e in ENTITIES if e.object_id == "energy_wh"), caps=CAPS, topic_prefix=PREFIX,
                           interval_s=1.0)
    assert schema_problems("homeassistant/sensor/pi-5/energy_wh/config", energy) == []
    assert schema_problems("homeassistant/sensor/pi-5/energy_wh/config", energy | {"state_class": "measurement"})
    assert schema_problems("homeassistant/sensor/pi-5/energy_wh/config", energy | {"unit_of_measurement": "W"})
    state = entity_config(ENTITIES[0], caps=CAPS, topic_prefix=PREFIX, interval_s=1.0)
    assert schema_problems("homeassistant/sensor/pi-5/state/config", state) == []
    assert schema_problems("homeassistant/sensor/pi-5/state/config", state | {"state_class": "measurement"})
    assert schema_problems("homeassistant/sensor/pi-5/state/config", state | {"options": []})


def test_templates_pick_the_field_and_availability_follows_the_status() -> None:
    discovery = HomeAssistantDiscovery(caps=CAPS, topic_prefix=PREFIX, discovery_prefix="homeassistant", interval_s=1.0)
    configs = {t.split("/")[-2]: c for t, c in _messages(discovery, [RICH]).items()}
    payload = RICH.to_json()
    assert float(render(configs["cpu_percent"]["value_template"], payload)) == 31.5
    assert float(render(configs["gpu_mem_used_bytes"]["value_template"], payload)) == 36904 * 1024
    assert float(render(configs["disk_data_used_percent"]["value_template"], payload)) == 25.0
    assert render(configs["under_voltage_now"]["value_template"], payload) == "OFF"     # 0x50000: not now...
    assert render(configs["under_voltage_since_boot"]["value_template"], payload) == "ON"  # ...but since boot
    availability = configs["cpu_percent"]["availability_template"]
    for state, expected in (("online", "payload_available"), ("busy", "payload_available"), ("offline", "payload_not_available")):
        assert render(availability, BoardStatus(state=state).to_json()) == configs["cpu_percent"][expected]
    assert float(render(configs["energy_wh"]["value_template"], payload)) == 12.3456
    assert json.loads(render(configs["energy_wh"]["json_attributes_template"], payload)) == {"power_source": "rpi5-pmic",
                                                                                          "measured": True}
    assert float(render(configs["job_progress_percent"]["value_template"], payload)) == 32.5  # 13 of 40 steps
    assert json.loads(render(configs["job_progress_percent"]["json_attributes_template"], payload)) == {"steps_done": 13,
                                                                                                     "total_steps": 40}
    idle = TelemetrySample(board_id="pi-5", ts=1.7e9, seq=3, interval_s=1.0, cpu_percent=3.0).to_json()
    assert render(configs["job_progress_percent"]["value_template"], idle) == "None"  # Home Assistant: unknown
    board_state = configs["state"]
    for status, shown in ((BoardStatus(state="online"), "idle"), (BoardStatus(state="busy", activity="training"), "training"),
                          (BoardStatus(state="busy", activity="profiling"), "profiling"),
                          (BoardStatus(state="busy"), "training"),  # an older agent's busy
                          (BoardStatus(state="offline", reason="connection lost"), "offline")):
        assert render(board_state["value_template"], status.to_json()) == shown
        assert shown in board_state["options"]
    assert json.loads(render(board_state["json_attributes_template"], BoardStatus(state="offline", reason="stopped").to_json())) == {
        "reason": "stopped"}


def test_sensors_appear_as_their_fields_get_values_and_estimates_say_so() -> None:
    caps = BoardCaps(board_id="x86.lab", hostname="h", model="PowerEdge R640", machine="x86_64", cores=8, ram_bytes=1 << 34)
    discovery = HomeAssistantDiscovery(caps=caps, topic_prefix=PREFIX, discovery_prefix="ha", interval_s=0.2)
    first = TelemetrySample(board_id="x86.lab", ts=1.0, seq=1, interval_s=0.2, cpu_percent=5.0, power_w=20.0, power_source="estimated")
    objects = {t.split("/")[-2] for t in _messages(discovery, [first])}
    # no GPU, no throttling, no network rate and no energy total yet; the state and progress from the start
    assert objects == {"cpu_percent", "power_w", "power_source", "state", "job_progress_percent"}
    second = TelemetrySample(board_id="x86.lab", ts=2.0, seq=2, interval_s=0.2, cpu_percent=5.0, net_rx_bytes_per_s=1.0,
                             power_w=20.0, power_source="estimated", energy_wh=0.0)
    assert {t.split("/")[-2] for t in _messages(discovery, [second])} == {"net_rx_bytes_per_s", "energy_wh"}  # only what is new
    configs = {t: json.loads(p) for t, p in discovery.configs()}
    assert len(configs) == 7 and all(schema_problems(t, c, "ha") == [] for t, c in configs.items())
    power = next(c for t, c in configs.items() if t.endswith("/power_w/config"))
    assert power["name"] == "Power (estimated)" and power["expire_after"] == 10
    assert "manufacturer" not in power["device"] and power["device"]["model"] == "PowerEdge R640"
    energy = next(c for t, c in configs.items() if t.endswith("/energy_wh/config"))
    assert energy["name"] == "Energy (estimated)"  # integrated from an estimate: said so, as for the power


def test_node_ids_are_valid_and_never_shared() -> None:
    assert node_id_for("pi-1") == "pi-1"
    dotted = {node_id_for(b) for b in ("pi.1", "pi_1", "pi-1.a", "pi-1_a")}
    assert len(dotted) == 4 and all(re.fullmatch(r"[A-Za-z0-9_-]+", n) for n in dotted)
    assert manufacturer_of("NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super") == "NVIDIA"


def test_a_real_agent_publishes_retained_discovery_configs(mosquitto: LocalBroker, agents: AgentFactory) -> None:
    board = "ha-board-1"
    agents.start(board, mosquitto.address,
                 config=f'board_id = "{board}"\n[telemetry]\ninterval_s = 0.2\nhome_assistant = true\n')
    watch = BoardWatch(mosquitto, board)
    live = _Collector(mosquitto, f"homeassistant/+/{board}/+/config")
    expected = {"cpu_percent", "mem_used_bytes", "net_rx_bytes_per_s", "power_source", "disk_run_used_bytes", "disk_data_used_percent",
                "state", "energy_wh", "job_progress_percent"}
    try:
        watch.wait_state("online")
        # Its caps say where other boards reach it (pipeline stages): the local end of its broker connection.
        assert BoardCaps.from_json(late_message(mosquitto, caps_topic(PREFIX, board))).address == "127.0.0.1"
        wait_until(lambda: expected <= {t.split("/")[-2] for t in live.snapshot()}, timeout_s=15, what="discovery configs")
        # A client that connects later (Home Assistant starting) still gets every config: they are retained.
        late = _Collector(mosquitto, f"homeassistant/+/{board}/+/config")
        announced = live.snapshot()
        wait_until(lambda: set(late.snapshot()) >= set(announced), timeout_s=10, what="retained configs")
        assert all(late.retained[t] for t in announced)
        for topic, payload in announced.items():
            config = json.loads(payload)
            assert schema_problems(topic, config) == [], topic
            assert config["state_topic"] == (status_topic if topic.endswith("/state/config") else telemetry_topic)(PREFIX, board)
        # What Home Assistant would show from the board's own messages: idle, a growing energy total, no job.
        configs = {t.split("/")[-2]: json.loads(p) for t, p in announced.items()}
        status = late_message(mosquitto, status_topic(PREFIX, board))
        assert render(configs["state"]["value_template"], status) == "idle"
        first = late_message(mosquitto, telemetry_topic(PREFIX, board))
        later = wait_until(lambda: (m := late_message(mosquitto, telemetry_topic(PREFIX, board)))
                           and json.loads(m)["seq"] > json.loads(first)["seq"] + 2 and m, timeout_s=10, what="later samples")
        energy = [float(render(configs["energy_wh"]["value_template"], m)) for m in (first, later)]
        assert 0 <= energy[0] < energy[1]  # an estimated power above 0 W, integrated
        assert render(configs["job_progress_percent"]["value_template"], later) == "None"
        late.close()
    finally:
        watch.close()
        for topic in live.snapshot():  # leave the session's broker as we found it
            live.client.publish(topic, b"", qos=1, retain=True).wait_for_publish(5)
        live.close()


def late_message(broker: LocalBroker, topic: str) -> bytes:
    """The next message on ``topic`` (the retained one at once, else the next published)."""
    collector = _Collector(broker, topic)
    try:
        return wait_until(lambda: collector.snapshot().get(topic, b""), timeout_s=10, what=f"a message on {topic}")
    finally:
        collector.close()


class _Collector:
    """A paho client that keeps the last payload (and its retain flag) per topic under ``topic_filter``."""

    def __init__(self, broker: LocalBroker, topic_filter: str) -> None:
        self._lock = threading.Lock()
        self.payloads: dict[str, bytes] = {}
        self.retained: dict[str, bool] = {}
        ready = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"test-ha-{id(self)}")
        self.client.on_connect = lambda c, *_: (c.subscribe(topic_filter, qos=1), ready.set())
        self.client.on_message = self._message
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        assert ready.wait(10)

    def _message(self, client: mqtt.Client, userdata: object, m: mqtt.MQTTMessage) -> None:
        if m.payload:
            with self._lock:
                self.payloads[m.topic] = bytes(m.payload)
                self.retained[m.topic] = bool(m.retain)

    def snapshot(self) -> dict[str, bytes]:
        with self._lock:
            return dict(self.payloads)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
