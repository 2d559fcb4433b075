from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgefleet.agent.config import load_agent_config
from edgefleet.protocol.address import HostPort
from edgefleet.protocol.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: the base dependency tomli
    import tomli as tomllib


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


def test_defaults_then_file_then_env_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, 'board_id = "pi-7"\n[broker]\nhost = "file-host"\nport = 1000\n[telemetry]\ninterval_s = 2\n')
    cfg = load_agent_config(path)
    assert (cfg.board_id, cfg.broker.host, cfg.broker.port, cfg.telemetry.interval_s) == ("pi-7", "file-host", 1000, 2.0)
    assert cfg.broker.protocol == "3.1.1" and cfg.broker.topic_prefix == "edgefleet/v1"
    monkeypatch.setenv("EDGEFLEET_BROKER", "env-host:2000")
    assert load_agent_config(path).broker.address() == "env-host:2000"
    cfg = load_agent_config(path, board_id="pi-8", broker=HostPort("flag-host", 3000), interval_s=0.5)
    assert (cfg.board_id, cfg.broker.address(), cfg.telemetry.interval_s) == ("pi-8", "flag-host:3000", 0.5)


@pytest.mark.parametrize("text, fragments", [
    ('[broker]\nhots = "x"\n', ["unknown key 'broker.hots'", "Did you mean 'host'"]),
    ('bord_id = "x"\n', ["unknown key 'bord_id'", "board_id"]),
    ('[broker]\nport = "1883"\n', ["broker.port should be an integer", "'1883' (string)"]),
    ('[telemetry]\ninterval_s = 0\n', ["interval_s = 0", "0.05-3600"]),
    ('[power]\nsource = "magic"\n', ["source = 'magic'", "estimated"]),
    ('[telemetry]\nhome_assistant = "yes"\n', ["telemetry.home_assistant should be true or false"]),
    ('[telemetry]\nhome_assistant_prefix = "homeassistant/#"\n', ["home_assistant_prefix = 'homeassistant/#'", '"homeassistant"']),
    ('[broker]\nprotocol = "4"\n', ['"3.1.1" or "5"']),
    ('board_id = "a/b"\n', ["not a valid board id"]),
    ('[broker\n', ["not valid TOML"]),
    ('broker = 3\n', ["broker should be a table"]),
    ('[broker]\npassword_file = "/nonexistent/pw"\n', ["password_file", "cannot be read"]),
    ('[broker]\ntls_ca_file = "/nonexistent/ca.crt"\n', ["tls_ca_file", "does not exist"]),
])
def test_config_errors_name_key_file_and_fix(tmp_path: Path, text: str, fragments: list[str]) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_agent_config(path)
    message = str(info.value)
    assert str(path) in message or "board id" in message
    for fragment in fragments:
        assert fragment in message


def test_home_assistant_discovery_is_opt_in_with_its_prefix(tmp_path: Path) -> None:
    assert (load_agent_config(None).telemetry.home_assistant, load_agent_config(None).telemetry.home_assistant_prefix) == (
        False, "homeassistant")
    cfg = load_agent_config(_write(tmp_path, '[telemetry]\nhome_assistant = true\nhome_assistant_prefix = "ha/discovery"\n'))
    assert (cfg.telemetry.home_assistant, cfg.telemetry.home_assistant_prefix) == (True, "ha/discovery")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_agent_config(tmp_path / "nope.toml")


def test_password_file_is_read_and_never_printed(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("s3cret\n")
    path = _write(tmp_path, f'[broker]\nusername = "pi"\npassword_file = "{tmp_path / "pw"}"\n')
    assert load_agent_config(path).broker.password == "s3cret"
    out = subprocess.run([sys.executable, "-m", "edgefleet.agent", "--config", str(path), "--check-config"], capture_output=True, text=True)
    assert out.returncode == 0 and "config OK" in out.stdout and "s3cret" not in out.stdout


def test_check_config_exits_78_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    path = _write(tmp_path, '[broker]\nport = "x"\n')
    out = subprocess.run([sys.executable, "-m", "edgefleet.agent", "--config", str(path), "--check-config"], capture_output=True, text=True)
    assert out.returncode == 78
    assert "broker.port" in out.stderr and "Traceback" not in out.stderr


def test_the_configuration_page_documents_every_key() -> None:
    from dataclasses import fields

    from edgefleet.agent.config import PowerSettings, SecuritySettings, TelemetrySettings
    from edgefleet.transport.settings import BrokerSettings

    page = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for section, cls in (("broker", BrokerSettings), ("telemetry", TelemetrySettings), ("power", PowerSettings),
                         ("security", SecuritySettings)):
        for f in fields(cls):
            assert f"`{section}.{f.name}`" in page, f"docs/configuration.md lacks {section}.{f.name}"
    assert "`board_id`" in page and "`state_dir`" in page
    assert "docs/configuration.md" in (Path(__file__).parents[2] / "README.md").read_text()


def test_the_example_config_lists_every_key_and_loads(tmp_path: Path) -> None:
    import dataclasses

    import tomllib

    from edgefleet.agent.config import AgentConfig

    example = Path(__file__).resolve().parents[2] / "examples" / "agent.toml"
    data = tomllib.loads(example.read_text())
    defaults = AgentConfig(board_id="x")
    for section in dataclasses.fields(AgentConfig):
        value = getattr(defaults, section.name)
        if dataclasses.is_dataclass(value):
            keys = {f.name for f in dataclasses.fields(value) if f.init and not f.name.startswith("_")}
            missing = keys - set(data.get(section.name, {}))
            assert not missing, f"examples/agent.toml lacks [{section.name}] {sorted(missing)}"
    key = tmp_path / "fleet.key"
    key.write_text("ab" * 32 + "\n")
    key.chmod(0o600)
    text = example.read_text().replace('fleet_key_file = ""', f'fleet_key_file = "{key}"', 1)
    path = _write(tmp_path, text)
    assert load_agent_config(path).security.fleet_key_file == str(key)


def test_check_config_prints_toml_that_reads_back_to_the_same_configuration(tmp_path: Path) -> None:
    """--check-config's output is TOML (it was `board_id = vm`, `net_interfaces = ()`, `True`): tomllib reads it back
    to every value in effect, and edge-agent takes it as a config file giving the same configuration."""
    # Prepare: strings that need escaping, a list, booleans, floats and an inline password (never shown)
    (tmp_path / "pw").write_text("s3cret\n")
    path = _write(tmp_path, 'board_id = "pi-7"\nstate_dir = "/var/lib/a \\"quoted\\" dir\\\\x"\n'
                            f'[broker]\nhost = "10.0.0.2"\nport = 1884\nusername = "pi"\npassword_file = "{tmp_path / "pw"}"\n'
                            '[telemetry]\ninterval_s = 2.5\nnet_interfaces = ["eth0", "wlan0"]\nhome_assistant = true\n'
                            '[power]\nsource = "estimated"\nidle_w = 3\n[training]\nkeep_worker = true\n')
    env = {**os.environ, "EDGEFLEET_BROKER": ""}

    # Execute
    done = subprocess.run([sys.executable, "-m", "edgefleet.agent", "--config", str(path), "--check-config"],
                          capture_output=True, text=True, timeout=60, env=env)

    # Assert: valid TOML with the values in effect, the password left out
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# config OK") and "s3cret" not in done.stdout
    data = tomllib.loads(done.stdout)
    cfg = load_agent_config(path)
    assert (data["board_id"], data["state_dir"]) == (cfg.board_id, cfg.state_dir)
    for name in ("broker", "telemetry", "power", "security", "training"):
        section = dataclasses.asdict(getattr(cfg, name))
        section.pop("password", None)
        section = {k: list(v) if isinstance(v, tuple) else v for k, v in section.items()}
        assert data[name] == section, name
    assert data["telemetry"]["net_interfaces"] == ["eth0", "wlan0"] and data["training"]["keep_worker"] is True
    # ... and the output is a config file that gives the same configuration again
    (tmp_path / "again").mkdir()
    again = _write(tmp_path / "again", done.stdout)
    assert dataclasses.replace(load_agent_config(again), source="") == dataclasses.replace(cfg, source="")


@pytest.mark.parametrize("value", ["plain", 'a "quoted" \\ back\\slash', "tab\tnew\nline\r\x00\x1b\x7f", "ünïcødé 🐍",
                                   0, -7, 2**62, 1.0, 0.1, 1e-300, 1e16, -2.5, float("inf"), True, False, [],
                                   ["eth0", "wlan0"], [1, 2.5, "x"]])
def test_a_value_written_as_toml_reads_back_the_same(value: object) -> None:
    from edgefleet.transport.toml_text import toml_document

    text = toml_document({"key": value}, {"table": {"dotted.key": value}}, header="a header\nover two lines")
    assert tomllib.loads(text) == {"key": value, "table": {"dotted.key": value}}, text
