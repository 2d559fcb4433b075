"""Power telemetry sources against recorded real outputs (see tests/fixtures/power/SOURCES.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from edgefleet.agent.sensors import power_rapl, power_rpi5_pmic
from edgefleet.agent.sensors.power import AUTO_ORDER, KINDS, NoPower, select_power_source
from edgefleet.agent.sensors.power_estimated import EstimatedPower
from edgefleet.agent.sensors.power_hwmon import HwmonPower
from edgefleet.agent.sensors.power_ina3221 import Ina3221Power
from edgefleet.agent.sensors.power_jtop import JtopPower, parse_jtop_power
from edgefleet.agent.sensors.power_rapl import RaplPower, energy_delta_uj
from edgefleet.agent.sensors.power_rpi5_pmic import Rpi5PmicPower, parse_pmic, parse_throttled, run_vcgencmd
from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.messages import POWER_SOURCES, is_measured

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "power"
PMIC_PI5 = (FIXTURES / "rpi5_pmic_read_adc.txt").read_text()
PMIC_NOT_REGISTERED = (FIXTURES / "rpi_pmic_read_adc_not_registered.txt").read_text()
JTOP_ORIN_NANO = json.loads((FIXTURES / "jtop_power_orin_nano.json").read_text())
KEYS = {"power_w", "power_source", "power_rails_w"}

# Jetson Orin Nano INA3221 hwmon: values = volt/curr of the jtop capture (jtop reads these files).
ORIN_NANO_HWMON = {
    "class/hwmon/hwmon0/name": "pwmfan\n",
    "class/hwmon/hwmon1/name": "ina3221\n",
    "class/hwmon/hwmon1/in1_label": "VDD_IN\n",
    "class/hwmon/hwmon1/in1_input": "4936\n",
    "class/hwmon/hwmon1/curr1_input": "1040\n",
    "class/hwmon/hwmon1/curr1_max": "5232\n",
    "class/hwmon/hwmon1/curr1_crit": "5232\n",
    "class/hwmon/hwmon1/in2_label": "VDD_CPU_GPU_CV\n",
    "class/hwmon/hwmon1/in2_input": "4928\n",
    "class/hwmon/hwmon1/curr2_input": "216\n",
    "class/hwmon/hwmon1/in3_label": "VDD_SOC\n",
    "class/hwmon/hwmon1/in3_input": "4936\n",
    "class/hwmon/hwmon1/curr3_input": "312\n",
    "class/hwmon/hwmon1/in7_label": "sum of shunt voltages\n",
    "class/hwmon/hwmon1/in7_input": "1000\n",
}
# Jetson Nano, L4T R32: mW from a real tegrastats line (POM_5V_IN 3129, GPU 160, CPU 922).
_IIO = "bus/i2c/drivers/ina3221x/6-0040/iio:device0"
NANO_R32_IIO = {
    f"{_IIO}/name": "ina3221x\n",
    f"{_IIO}/rail_name_0": "POM_5V_IN\n",
    f"{_IIO}/in_power0_input": "3129\n",
    f"{_IIO}/rail_name_1": "POM_5V_GPU\n",
    f"{_IIO}/in_power1_input": "160\n",
    f"{_IIO}/rail_name_2": "POM_5V_CPU\n",
    f"{_IIO}/in_power2_input": "922\n",
}
# INA219 on i2c-1 0x40 (tutorial transcript): 5.023 V, 124 mA, power1_input 622000 µW.
INA219_HWMON = {
    "class/hwmon/hwmon2/name": "ina219\n",
    "class/hwmon/hwmon2/in0_input": "1\n",
    "class/hwmon/hwmon2/in1_input": "5023\n",
    "class/hwmon/hwmon2/curr1_input": "124\n",
    "class/hwmon/hwmon2/power1_input": "622000\n",
    "class/hwmon/hwmon2/shunt_resistor": "100000\n",
}
# Intel i5-13500 powercap-info (package-0 and its core sub-zone) plus a psys zone to ignore.
RAPL_I5_13500 = {
    "class/powercap/intel-rapl:0/name": "package-0\n",
    "class/powercap/intel-rapl:0/max_energy_range_uj": "262143328850\n",
    "class/powercap/intel-rapl:0/energy_uj": "65997277274\n",
    "class/powercap/intel-rapl:0:0/name": "core\n",
    "class/powercap/intel-rapl:0:0/max_energy_range_uj": "262143328850\n",
    "class/powercap/intel-rapl:0:0/energy_uj": "48265700414\n",
    "class/powercap/intel-rapl:1/name": "psys\n",
    "class/powercap/intel-rapl:1/max_energy_range_uj": "262143328850\n",
    "class/powercap/intel-rapl:1/energy_uj": "1000000\n",
}


def make_tree(root: Path, *tables: dict[str, str]) -> Path:
    """Write sysfs files (path relative to root -> exact content) and return root."""
    for table in tables:
        for rel, content in table.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
    return root


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def no_jtop_no_pmic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make jtop unimportable and vcgencmd absent, whatever this machine has."""
    monkeypatch.setitem(sys.modules, "jtop", None)
    monkeypatch.setattr(power_rpi5_pmic, "run_vcgencmd", lambda *args: None)


def jtop_stub(power: object = None, start_error: str | None = None) -> types.ModuleType:
    """A stand-in ``jtop`` module with the attributes JtopPower uses."""
    mod = types.ModuleType("jtop")

    class JtopException(Exception):
        pass

    class FakeJtop:
        closed = False

        def __init__(self, interval: float = 1.0) -> None:
            self.interval = interval
            self.power = power

        def start(self) -> None:
            if start_error:
                raise JtopException(start_error)

        def close(self) -> None:
            FakeJtop.closed = True

    mod.jtop = FakeJtop
    mod.JtopException = JtopException
    return mod


# --- Raspberry Pi 5 PMIC ---------------------------------------------------------------


def test_pmic_capture_sums_paired_rails() -> None:
    total, rails, ext5v = parse_pmic(PMIC_PI5)
    assert len(rails) == 12
    assert "EXT5V" not in rails and "BATT" not in rails  # voltage only
    assert rails["VDD_CORE"] == pytest.approx(5.03652 * 0.8936988)
    assert rails["VDD_CORE"] == pytest.approx(4.5011, abs=1e-4)
    assert total == pytest.approx(5.9216, abs=1e-4)
    assert ext5v == pytest.approx(4.9245)


def test_pmic_pairs_by_name_not_by_line_order() -> None:
    shuffled = "\n".join(reversed(PMIC_PI5.splitlines()))
    assert parse_pmic(shuffled)[0] == pytest.approx(parse_pmic(PMIC_PI5)[0])


def test_pmic_rail_without_current_line_is_left_out() -> None:
    text = "\n".join(ln for ln in PMIC_PI5.splitlines() if "VDD_CORE_A" not in ln)
    total, rails, _ = parse_pmic(text)
    assert "VDD_CORE" not in rails and len(rails) == 11
    assert total == pytest.approx(5.9216 - 4.5011, abs=1e-4)


@pytest.mark.parametrize(
    "text",
    [
        PMIC_NOT_REGISTERED,
        "",
        "VDD_CORE_A current(7)=fastA\nVDD_CORE_V volt(15)=0.9V",
        "\x00\xff garbage",
    ],
)
def test_pmic_garbage_gives_none(text: str) -> None:
    assert parse_pmic(text) == (None, {}, None)


def test_pmic_source_reads_capture() -> None:
    src = Rpi5PmicPower(run=lambda *args: PMIC_PI5 if args == ("pmic_read_adc",) else None)
    assert src.available()
    out = src.read()
    assert set(out) == KEYS
    assert out["power_source"] == "rpi5-pmic"
    assert out["power_w"] == pytest.approx(5.9216, abs=1e-4)
    assert out["power_rails_w"]["VDD_CORE"] == pytest.approx(4.5011, abs=1e-4)


@pytest.mark.parametrize("answer", [None, PMIC_NOT_REGISTERED])
def test_pmic_unavailable_on_older_pi_or_without_vcgencmd(answer: str | None) -> None:
    src = Rpi5PmicPower(run=lambda *args: answer)
    assert not src.available()
    assert src.read() == {"power_w": None, "power_source": "rpi5-pmic", "power_rails_w": {}}


def test_run_vcgencmd_uses_a_2s_timeout_and_survives_it(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def hang(cmd: list[str], **kw: object) -> None:
        seen.update(kw, cmd=cmd)
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(power_rpi5_pmic.shutil, "which", lambda name: "/usr/bin/vcgencmd")
    monkeypatch.setattr(power_rpi5_pmic.subprocess, "run", hang)
    assert run_vcgencmd("pmic_read_adc") is None
    assert seen["timeout"] == 2.0 and seen["cmd"] == ["/usr/bin/vcgencmd", "pmic_read_adc"]
    monkeypatch.setattr(power_rpi5_pmic.shutil, "which", lambda name: None)
    assert run_vcgencmd("pmic_read_adc") is None


def test_get_throttled() -> None:
    t = parse_throttled("throttled=0x50000\n")
    assert t is not None and t.raw == 0x50000
    assert t.now == () and t.since_boot == ("under-voltage", "throttled")
    assert parse_throttled("throttled=0x5").now == ("under-voltage", "throttled")
    assert parse_throttled("throttled=0x0").since_boot == ()
    assert parse_throttled("error=1 error_msg=\"Command not registered\"") is None
    assert parse_throttled("") is None


# --- jetson-stats ----------------------------------------------------------------------


def test_jtop_capture_milliwatts_to_watts() -> None:
    total, rails = parse_jtop_power(JTOP_ORIN_NANO)
    assert total == pytest.approx(5.133)
    assert rails == pytest.approx({"VDD_IN": 5.133, "VDD_CPU_GPU_CV": 1.064, "VDD_SOC": 1.54})


@pytest.mark.parametrize("power", [{}, None, (5133, {"VDD_SOC": {"cur": 1540}}), "x"])
def test_jtop_no_sensor_or_old_shape(power: object) -> None:
    assert parse_jtop_power(power) == (None, {})


def test_jtop_without_input_rail_sums_and_skips_bad_rails() -> None:
    power = {
        "rail": {
            "VDD_CPU": {"power": 1500, "avg": 1400, "online": True},
            "VDD_GPU": {"power": 500},
            "VDD_OFF": {"power": 900, "online": False},
            "VDD_BROKEN": {"volt": 5000},
        },
        "tot": {"power": 2000, "avg": 1900},  # the sum shape: no name, no volt/curr
    }
    total, rails = parse_jtop_power(power)
    assert total == pytest.approx(2.0)
    assert rails == pytest.approx({"VDD_CPU": 1.5, "VDD_GPU": 0.5})
    del power["tot"]
    assert parse_jtop_power(power)[0] == pytest.approx(2.0)


def test_jtop_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jtop", None)
    src = JtopPower()
    assert not src.available()
    assert "not installed" in src.looked_for()
    with pytest.raises(OSError):
        src.read()


def test_jtop_service_down(monkeypatch: pytest.MonkeyPatch) -> None:
    msg = "The jtop.service is not active. Please run:\nsudo systemctl restart jtop.service"
    monkeypatch.setitem(sys.modules, "jtop", jtop_stub(start_error=msg))
    src = JtopPower()
    assert not src.available()
    assert "jtop.service is not active" in src.looked_for()


def test_jtop_reads_through_client(monkeypatch: pytest.MonkeyPatch) -> None:
    stub = jtop_stub(power=JTOP_ORIN_NANO)
    monkeypatch.setitem(sys.modules, "jtop", stub)
    src = JtopPower()
    assert src.available()
    out = src.read()
    assert set(out) == KEYS and out["power_source"] == "jtop"
    assert out["power_w"] == pytest.approx(5.133)
    src.close()
    assert stub.jtop.closed


# --- Jetson INA3221 from sysfs ---------------------------------------------------------


def test_ina3221_hwmon_orin_nano(tmp_path: Path) -> None:
    src = Ina3221Power(make_tree(tmp_path, ORIN_NANO_HWMON))
    assert src.available()
    out = src.read()
    assert set(out) == KEYS and out["power_source"] == "ina3221"
    assert out["power_w"] == pytest.approx(4.936 * 1.040, abs=1e-4)  # VDD_IN, not the sum
    assert out["power_rails_w"] == pytest.approx(
        {"VDD_IN": 5.1334, "VDD_CPU_GPU_CV": 1.0644, "VDD_SOC": 1.54}, abs=1e-4
    )


def test_ina3221_missing_and_garbage_channels(tmp_path: Path) -> None:
    make_tree(tmp_path, ORIN_NANO_HWMON, {"class/hwmon/hwmon1/curr2_input": "garbage\n"})
    (tmp_path / "class/hwmon/hwmon1/curr3_input").unlink()
    out = Ina3221Power(tmp_path).read()
    assert out["power_rails_w"] == pytest.approx({"VDD_IN": 5.1334}, abs=1e-4)
    assert out["power_w"] == pytest.approx(5.1334, abs=1e-4)


def test_ina3221_without_input_rail_sums_and_skips_nc(tmp_path: Path) -> None:
    make_tree(tmp_path, ORIN_NANO_HWMON, {"class/hwmon/hwmon1/in1_label": "NC\n"})
    out = Ina3221Power(tmp_path).read()
    assert set(out["power_rails_w"]) == {"VDD_CPU_GPU_CV", "VDD_SOC"}
    assert out["power_w"] == pytest.approx(1.064448 + 1.540032, abs=1e-4)


def test_ina3221_l4t_r32_iio_milliwatts(tmp_path: Path) -> None:
    src = Ina3221Power(make_tree(tmp_path, NANO_R32_IIO))
    assert src.available()
    out = src.read()
    assert out["power_w"] == pytest.approx(3.129)  # POM_5V_IN, mW -> W
    assert out["power_rails_w"] == pytest.approx(
        {"POM_5V_IN": 3.129, "POM_5V_GPU": 0.16, "POM_5V_CPU": 0.922}
    )


def test_ina3221_absent(tmp_path: Path) -> None:
    src = Ina3221Power(make_tree(tmp_path, INA219_HWMON))
    assert not src.available()
    assert src.read()["power_w"] is None


# --- INA2xx add-on meters --------------------------------------------------------------


def test_ina219_power1_input_is_microwatts(tmp_path: Path) -> None:
    make_tree(tmp_path, INA219_HWMON)
    device = tmp_path / "devices/platform/soc/i2c-1/1-0040"
    device.mkdir(parents=True)
    (tmp_path / "class/hwmon/hwmon2/device").symlink_to(device)
    src = HwmonPower(tmp_path)
    assert src.available()
    out = src.read()
    assert out == {
        "power_w": pytest.approx(0.622),
        "power_source": "hwmon:ina219",
        "power_rails_w": {"ina219:1-0040": pytest.approx(0.622)},
    }
    assert out["power_source"].split(":")[0] in POWER_SOURCES and is_measured(out["power_source"])


def test_ina219_without_power1_input_multiplies_bus_mv_by_ma(tmp_path: Path) -> None:
    make_tree(tmp_path, INA219_HWMON)
    (tmp_path / "class/hwmon/hwmon2/power1_input").unlink()
    out = HwmonPower(tmp_path).read()
    assert out["power_w"] == pytest.approx(5.023 * 0.124, abs=1e-4)
    assert out["power_rails_w"] == pytest.approx({"ina219:hwmon2": 0.6229}, abs=1e-4)


def test_ina219_garbage_gives_none(tmp_path: Path) -> None:
    make_tree(tmp_path, INA219_HWMON, {"class/hwmon/hwmon2/power1_input": "\n"})
    src = HwmonPower(tmp_path)
    assert not src.available()
    assert src.read() == {"power_w": None, "power_source": "hwmon:ina219", "power_rails_w": {}}


def test_hwmon_ignores_other_chips(tmp_path: Path) -> None:
    assert not HwmonPower(make_tree(tmp_path, ORIN_NANO_HWMON)).available()


# --- Intel RAPL ------------------------------------------------------------------------


def test_rapl_first_read_has_no_delta_then_watts(tmp_path: Path) -> None:
    make_tree(tmp_path, RAPL_I5_13500)
    clock = Clock()
    src = RaplPower(tmp_path, clock=clock)
    assert src.available()
    assert src.read() == {"power_w": None, "power_source": "rapl", "power_rails_w": {}}
    clock.t += 1.0
    make_tree(tmp_path, {
        "class/powercap/intel-rapl:0/energy_uj": f"{65997277274 + 30_000_000}\n",
        "class/powercap/intel-rapl:0:0/energy_uj": "1\n",  # sub-zone: must not count
        "class/powercap/intel-rapl:1/energy_uj": "999000000\n",  # psys: must not count
    })
    out = src.read()
    assert out["power_w"] == pytest.approx(30.0)
    assert out["power_rails_w"] == pytest.approx({"package-0": 30.0})


def test_rapl_counter_wrap(tmp_path: Path) -> None:
    max_range = 262143328850
    make_tree(tmp_path, RAPL_I5_13500, {
        "class/powercap/intel-rapl:0/energy_uj": f"{max_range - 5_000_000}\n",
    })
    clock = Clock()
    src = RaplPower(tmp_path, clock=clock)
    src.read()
    clock.t += 0.5
    make_tree(tmp_path, {"class/powercap/intel-rapl:0/energy_uj": "10000000\n"})
    assert src.read()["power_w"] == pytest.approx(30.0)  # 15 J in 0.5 s
    assert energy_delta_uj(max_range - 1, 1, max_range) == 2
    assert energy_delta_uj(10, 5, None) is None


def test_rapl_no_time_passed_gives_none(tmp_path: Path) -> None:
    src = RaplPower(make_tree(tmp_path, RAPL_I5_13500), clock=Clock())
    src.read()
    assert src.read()["power_w"] is None


def test_rapl_root_only_since_5_10(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_tree(tmp_path, RAPL_I5_13500)
    real = power_rapl._read_text

    def eacces(path: Path) -> str:
        if path.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(power_rapl, "_read_text", eacces)
    src = RaplPower(tmp_path)
    assert not src.available()
    assert "permission denied" in src.looked_for()


def test_rapl_absent(tmp_path: Path) -> None:
    assert not RaplPower(tmp_path).available()


# --- estimate --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpu", "watts"), [(0.0, 2.5), (40.0, 4.5), (100.0, 7.5), (150.0, 7.5), (None, None)]
)
def test_estimated(cpu: float | None, watts: float | None) -> None:
    out = EstimatedPower(2.5, 7.5, lambda: cpu).read()
    assert out == {"power_w": watts, "power_source": "estimated", "power_rails_w": {}}
    assert not is_measured(out["power_source"])


def test_estimated_rejects_idle_above_max() -> None:
    with pytest.raises(ValueError):
        EstimatedPower(8.0, 5.0, lambda: 0.0)


# --- selection -------------------------------------------------------------------------


def select(kind: str, root: Path) -> object:
    return select_power_source(
        kind, sysfs_root=root, idle_w=2.5, max_w=7.5, cpu_percent=lambda: 40.0
    )


@pytest.mark.usefixtures("no_jtop_no_pmic")
@pytest.mark.parametrize(
    ("tables", "expected"),
    [
        ((ORIN_NANO_HWMON, INA219_HWMON, RAPL_I5_13500), Ina3221Power),
        ((NANO_R32_IIO, RAPL_I5_13500), Ina3221Power),
        ((INA219_HWMON, RAPL_I5_13500), HwmonPower),
        ((RAPL_I5_13500,), RaplPower),
        ((), EstimatedPower),
    ],
)
def test_auto_order_without_jtop_or_pmic(tmp_path: Path, tables: tuple, expected: type) -> None:
    source = select("auto", make_tree(tmp_path, *tables))
    assert type(source) is expected
    assert set(source.read()) == KEYS


def test_auto_prefers_jtop_then_ina3221_then_pmic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(power_rpi5_pmic, "run_vcgencmd", lambda *args: PMIC_PI5)
    monkeypatch.setitem(sys.modules, "jtop", None)
    assert type(select("auto", make_tree(tmp_path, INA219_HWMON))) is Rpi5PmicPower
    assert type(select("auto", make_tree(tmp_path, ORIN_NANO_HWMON))) is Ina3221Power
    monkeypatch.setitem(sys.modules, "jtop", jtop_stub(power=JTOP_ORIN_NANO))
    assert type(select("auto", tmp_path)) is JtopPower
    assert AUTO_ORDER == ("jtop", "ina3221", "rpi5-pmic", "hwmon", "rapl")


@pytest.mark.usefixtures("no_jtop_no_pmic")
def test_named_sources(tmp_path: Path) -> None:
    make_tree(tmp_path, INA219_HWMON, RAPL_I5_13500)
    assert type(select("hwmon", tmp_path)) is HwmonPower
    assert type(select("RAPL", tmp_path)) is RaplPower
    assert type(select("estimated", tmp_path)) is EstimatedPower
    none = select("none", tmp_path)
    assert isinstance(none, NoPower)
    assert none.read() == {"power_w": None, "power_source": "none", "power_rails_w": {}}
    assert set(KINDS) == {
        "auto", "jtop", "ina3221", "rpi5-pmic", "hwmon", "rapl", "estimated", "none"
    }


@pytest.mark.usefixtures("no_jtop_no_pmic")
@pytest.mark.parametrize(
    ("kind", "looked_for"),
    [
        ("ina3221", '/class/hwmon/hwmon*/name == "ina3221"'),
        ("rpi5-pmic", "vcgencmd pmic_read_adc"),
        ("hwmon", "/class/hwmon/hwmon*/name in ina219"),
        ("rapl", "/class/powercap/intel-rapl:N/energy_uj"),
        ("jtop", "jetson-stats"),
    ],
)
def test_named_source_missing_is_a_config_error(tmp_path: Path, kind: str, looked_for: str) -> None:
    with pytest.raises(ConfigError) as err:
        select(kind, tmp_path)
    text = str(err.value)
    assert f'power.source = "{kind}"' in text
    assert looked_for in text
    assert 'set power.source = "auto" or "estimated"' in text


def test_config_errors_for_unknown_kind_and_bad_estimate(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"power.source = 'bogus'.*auto, jtop, ina3221"):
        select("bogus", tmp_path)
    with pytest.raises(ConfigError, match=r"power.idle_w"):
        select_power_source(
            "estimated", sysfs_root=tmp_path, idle_w=9, max_w=5, cpu_percent=lambda: 1.0
        )
