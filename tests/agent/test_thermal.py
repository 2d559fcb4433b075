from __future__ import annotations

from pathlib import Path

from edgefleet.agent.sensors.thermal import ThermalSource, parse_millidegrees, read_thermal_zones

# A Raspberry Pi 5 and a Jetson Orin Nano as the kernel shows them (type, temp in m°C).
PI5 = [("cpu-thermal", "51350\n")]
ORIN = [("cpu-thermal", "47531\n"), ("gpu-thermal", "46187\n"), ("soc0-thermal", "46843\n"),
        ("tj-thermal", "47531\n"), ("cv0-thermal", "-256000\n")]  # an offline zone reads -256 °C


def _tree(root: Path, zones: list[tuple[str, str]]) -> Path:
    for i, (kind, temp) in enumerate(zones):
        zone = root / "class" / "thermal" / f"thermal_zone{i}"
        zone.mkdir(parents=True)
        (zone / "type").write_text(kind + "\n")
        (zone / "temp").write_text(temp)
    return root


def test_parse_millidegrees() -> None:
    assert parse_millidegrees("48312\n") == 48.312
    assert parse_millidegrees("-256000") is None
    assert parse_millidegrees("garbage") is None


def test_orin_zones_drop_the_offline_one(tmp_path: Path) -> None:
    temps = read_thermal_zones(_tree(tmp_path, ORIN))
    assert set(temps) == {"cpu-thermal", "gpu-thermal", "soc0-thermal", "tj-thermal"}
    assert ThermalSource(tmp_path).read()["temp_c"] == 47.531


def test_pi5(tmp_path: Path) -> None:
    source = ThermalSource(_tree(tmp_path, PI5))
    assert source.available()
    assert source.read() == {"temp_c": 51.35, "temps_c": {"cpu-thermal": 51.35}}


def test_no_zones_is_not_available(tmp_path: Path) -> None:
    assert not ThermalSource(tmp_path).available()
    assert ThermalSource(tmp_path).read() == {"temp_c": None, "temps_c": {}}
