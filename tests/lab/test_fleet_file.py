"""Fleet files: the shipped ones are sound, and bad ones are refused naming the board and the key.

No root needed: these run everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgefleet.lab.fixtures import FLEET8, MIXED4
from edgefleet.lab.fleet_file import FleetError, load_fleet, parse_fleet
from edgefleet.lab.links import tbf_parameters
from edgefleet.lab.units import UnitError, parse_rate, parse_size

pytestmark = pytest.mark.untimed  # it times nothing: it runs beside the other worker's tests (tests/conftest.py)

THIS_MACHINE_CORES = 2  # the lab machine the shipped fleets are sized for

GOOD_BOARD = """
[[board]]
id = "{id}"
cpu = {cpu}
memory = "512MiB"
rate_up = "20mbit"
rate_down = "30mbit"
idle_w = 2.7
max_w = 6.4
"""


def _fleet(*boards: str, head: str = "") -> str:
    return head + "".join(boards)


def _board(board_id: str = "a", cpu: float = 0.2, replace: dict[str, str] | None = None) -> str:
    """A valid board, with ``replace``'s substrings swapped in to break it."""
    text = GOOD_BOARD.format(id=board_id, cpu=cpu)
    for old, new in (replace or {}).items():
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize("path, boards", [(MIXED4, 4), (FLEET8, 8)])
def test_shipped_fleets_fit_this_machine_with_room_for_the_broker(path: Path, boards: int) -> None:
    fleet = load_fleet(path, host_cores=THIS_MACHINE_CORES)
    assert len(fleet.boards) == boards
    assert fleet.cpu_total <= 1.5 + 1e-9
    assert fleet.lab.reserved_cpus >= 0.5
    for board in fleet.boards:
        assert board.model, board.id
        assert 0 < board.idle_w < board.max_w, board.id
        assert board.rate_up_bps <= 100e6 and board.rate_down_bps <= 100e6, "boards are on 100 Mbit/s or Wi-Fi rates"


def test_mixed4_has_four_kinds_of_board_that_differ() -> None:
    fleet = load_fleet(MIXED4, host_cores=THIS_MACHINE_CORES)
    models = " ".join(b.model for b in fleet.boards)
    for kind in ("Raspberry Pi 4", "Raspberry Pi 5", "Jetson Nano", "N100"):
        assert kind in models
    assert len({b.cpu for b in fleet.boards}) == 4
    assert len({b.memory_bytes for b in fleet.boards}) >= 3
    assert len({(b.rate_up_bps, b.rate_down_bps) for b in fleet.boards}) >= 3


def test_fleet8_puts_the_server_on_gigabit() -> None:
    fleet = load_fleet(FLEET8, host_cores=THIS_MACHINE_CORES)
    assert fleet.server is not None
    assert fleet.server.rate_up_bps == fleet.server.rate_down_bps == 10**9


@pytest.mark.parametrize("text, fragments", [
    # quotas that add up to more than the machine gives the boards: names the board that tips it
    (_fleet(_board("a", 0.6), _board("b", 0.6), _board("c", 0.6)),
     ["board 'c'", "cpu = 0.6", "1.80 CPUs", "1.50", "2 cores", "reserved_cpus"]),
    (_fleet(_board("a", 2.5)), ["board 'a'", "cpu = 2.5", "this machine's cores"]),
    (_fleet(_board("a", 0.0)), ["board 'a'", "cpu = 0"]),
    # an unknown key, with the close match
    (_fleet(_board("a", replace={"cpu =": "cpus ="})), ["board 'a'", "unknown key 'cpus'", "Did you mean 'cpu'"]),
    (_fleet(_board("a"), head='[lab]\nreserved_cpu = 0.5\n'), ["[lab]", "unknown key 'reserved_cpu'", "reserved_cpus"]),
    (_fleet(_board("a"), head='[server]\nrate_up = "1gbit"\nrate_down = "1gbit"\nlatency = 3\n'), ["[server]", "unknown key 'latency'"]),
    ('[[boards]]\nid = "a"\n', ["unknown key 'boards'", "Did you mean 'board'"]),
    # rates with a wrong unit
    (_fleet(_board("a", replace={'rate_up = "20mbit"': 'rate_up = "100mbps"'})), ["board 'a'", "rate_up", "'100mbps'", "BYTES per second"]),
    (_fleet(_board("a", replace={'rate_down = "30mbit"': 'rate_down = "100mb"'})), ["board 'a'", "rate_down", "'mb'", "not a rate unit"]),
    (_fleet(_board("a", replace={'rate_down = "30mbit"': 'rate_down = "100"'})), ["board 'a'", "rate_down", "no unit"]),
    (_fleet(_board("a", replace={'rate_up = "20mbit"': 'rate_up = 20'})), ["board 'a'", "rate_up", "not a string"]),
    (_fleet(_board("a"), head='[server]\nrate_up = "1 GB/s"\nrate_down = "1gbit"\n'), ["[server]", "rate_up", "BYTES"]),
    # a board id used twice
    (_fleet(_board("pi4-1"), _board("pi5-1"), _board("pi4-1")), ["board 'pi4-1'", "id = 'pi4-1'", "used twice", "#1 and #3"]),
    # other mistakes, each naming board and key
    (_fleet(_board("a", replace={'"512MiB"': '"2GB"'})), ["board 'a'", "memory", "'2GB'", "binary size unit"]),
    (_fleet(_board("a", replace={'"512MiB"': '"16MiB"'})), ["board 'a'", "memory", "too little"]),
    (_fleet(_board("a", replace={"max_w = 6.4\n": ""})), ["board 'a'", "missing key 'max_w'"]),
    (_fleet(_board("a", replace={"idle_w = 2.7": "idle_w = 9.0"})), ["board 'a'", "idle_w = 9", "max_w = 6.4"]),
    (_fleet(_board("a/b")), ["board 'a/b'", "not a valid board id"]),
    (_fleet(_board("a", replace={"cpu = 0.2": 'cpu = "0.2"'})), ["board 'a'", "cpu = '0.2'", "should be a number"]),
    (_fleet(_board("a"), head='[lab]\ncpu_period_ms = 0.5\n'), ["[lab]", "cpu_period_ms = 0.5", "outside 1-100 ms"]),
    ("[lab]\nname = \"x\"\n", ["no boards"]),
    ("[[board]\n", ["not valid TOML"]),
])
def test_bad_fleet_files_are_refused_naming_board_and_key(text: str, fragments: list[str]) -> None:
    with pytest.raises(FleetError) as info:
        parse_fleet(text, source="bad.toml", host_cores=THIS_MACHINE_CORES, host_memory_bytes=24 * 2**30)
    message = str(info.value)
    assert message.startswith("bad.toml: ")
    for fragment in fragments:
        assert fragment in message, message


def test_reserved_cpus_is_what_makes_room_for_the_broker() -> None:
    two = _fleet(_board("a", 0.9), _board("b", 0.9))
    with pytest.raises(FleetError, match="1.80 CPUs"):
        parse_fleet(two, host_cores=2)
    assert parse_fleet('[lab]\nreserved_cpus = 0.2\n' + two, host_cores=2).cpu_total == pytest.approx(1.8)


def test_the_cpu_period_is_ten_ms_unless_the_fleet_file_says() -> None:
    one = _fleet(_board("a", 0.2))
    assert parse_fleet(one, host_cores=2).lab.cpu_period_ms == 10
    assert parse_fleet('[lab]\ncpu_period_ms = 1\n' + one, host_cores=2).lab.cpu_period_ms == 1


def test_a_board_larger_than_this_machine_is_refused() -> None:
    with pytest.raises(FleetError, match="board 'a': memory = 512 MiB is more than"):
        parse_fleet(_fleet(_board("a")), host_cores=2, host_memory_bytes=256 * 2**20)


def test_the_cli_check_refuses_with_the_same_words(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(_fleet(_board("pi4-1"), _board("pi4-1")))
    done = subprocess.run([sys.executable, "-m", "edgefleet.lab", "check", str(bad)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 78
    assert "board 'pi4-1'" in done.stderr and "used twice" in done.stderr and "Traceback" not in done.stderr
    good = subprocess.run([sys.executable, "-m", "edgefleet.lab", "check", str(MIXED4)],
                          capture_output=True, text=True, timeout=60, check=False)
    if (os.cpu_count() or 1) >= THIS_MACHINE_CORES:
        assert good.returncode == 0, good.stderr
        assert "4 boards" in good.stdout and "pi4-1" in good.stdout


@pytest.mark.parametrize("text, bps", [("100mbit", 10**8), ("20 Mbit/s", 2 * 10**7), ("1gbit", 10**9), ("512kbit", 512_000),
                                       ("2.5Mbit", 2_500_000)])
def test_rates(text: str, bps: int) -> None:
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["100", "100mbps", "100 MB/s", "fast", "50bit", "20 gbit"])
def test_bad_rates(text: str) -> None:
    with pytest.raises(UnitError):
        parse_rate(text)


@pytest.mark.parametrize("value, size", [("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5GiB", 3 * 2**29), (2**30, 2**30)])
def test_sizes(value: object, size: int) -> None:
    assert parse_size(value) == size


@pytest.mark.parametrize("rate", [20 * 10**6, 30 * 10**6, 100 * 10**6, 10**9])
def test_tbf_bucket_holds_a_timer_tick_and_the_queue_a_tcp_burst(rate: int) -> None:
    burst, limit = tbf_parameters(rate)
    assert burst >= rate / 8 / 250          # one tick at HZ=250: below this tbf can't reach its rate
    assert burst >= 4 * 1514
    assert burst <= rate / 8 * 0.01         # at most 10 ms of line rate in one go
    assert limit - burst >= 128 * 1024      # a TSQ's worth of one TCP socket: no drop-tail storms


def test_a_shipped_fleet_is_found_by_its_name_from_any_folder(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "edgefleet.lab", "check", "fleet8"], capture_output=True, text=True,
                          timeout=60, check=False, cwd=tmp_path)
    assert done.returncode == 0 and "8 boards" in done.stdout, done.stdout + done.stderr
    missing = subprocess.run([sys.executable, "-m", "edgefleet.lab", "check", "fleet9"], capture_output=True, text=True,
                             timeout=60, check=False, cwd=tmp_path)
    assert missing.returncode != 0 and "fleet8, mixed4" in missing.stderr and "Traceback" not in missing.stderr
