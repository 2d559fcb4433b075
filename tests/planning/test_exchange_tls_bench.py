"""The TLS exchange benchmark's pure parts (bench/exchange_tls.py): rounds per turn, turn order, link floor,
namespace names and the stale ones, and the cell's verdict. No namespace, process or socket is made."""

from __future__ import annotations

import pytest

from tests.planning import load_bench

et = load_bench("exchange_tls.py", "exchange_tls_bench", helpers=True)


def test_the_link_floor_is_both_frames_at_the_rate_less_the_bucket() -> None:
    # 4.6 MB at 100 Mbit/s: 4.6 MB of payload, Ethernet framing, less tbf's 62.5 kB burst, both ways.
    wire = (1_150_000 * 4 + et.FRAME_OVERHEAD_BYTES) * 1514 / 1448
    assert et.link_floor_s(1_150_000, 100e6) == pytest.approx(2 * (wire - 62_500) * 8 / 100e6)
    assert 0.75 < et.link_floor_s(1_150_000, 100e6) < 0.77
    assert et.link_floor_s(61_706, 20e6) > 5 * et.link_floor_s(61_706, 100e6)  # the burst counts for more at 100
    assert et.link_floor_s(100, 100e6) == 0.0  # all of it fits the bucket


def test_rounds_per_turn_fill_about_the_turn_time_and_stay_within_bounds() -> None:
    assert et.timed_rounds("0.25 MB", 100e6) == et.MAX_ROUNDS  # 1.5 s / ~33 ms is more than the cap
    assert et.timed_rounds("4.6 MB", 100e6) == 7                 # 5 s / 0.76 s
    assert et.timed_rounds("4.6 MB", 20e6) == et.MIN_ROUNDS      # 5 s / 3.8 s: the floor
    assert et.timed_rounds("0.25 MB", 20e6) == 8                 # 1.5 s / 0.2 s
    assert et.timed_rounds("4.6 MB", 100e6, scale=3.0) == 20
    assert et.timed_rounds("0.25 MB", None) == et.LOOPBACK_ROUNDS["0.25 MB"]
    assert et.timed_rounds("0.25 MB", None, scale=0.001) == et.MIN_ROUNDS


def test_plain_and_tls_alternate_and_so_does_who_goes_first() -> None:
    assert et.turn_order(0, 3) == ["plain", "tls", "tls", "plain", "plain", "tls"]
    assert et.turn_order(1, 3) == ["tls", "plain", "plain", "tls", "tls", "plain"]
    assert et.turn_order(0, 1) == ["plain", "tls"] and et.turn_order(1, 1) == ["tls", "plain"]
    for p in range(4):  # each pass runs both equally often
        order = et.turn_order(p, 2)
        assert order.count("plain") == order.count("tls") == 2


def test_namespaces_are_the_bench_s_own_and_only_dead_runs_are_stale() -> None:
    coordinator, boards = et.namespace_names(4242, 3)
    assert coordinator == "eft-4242-c" and boards == ["eft-4242-b0", "eft-4242-b1", "eft-4242-b2"]
    names = ["eft-4242-c", "eft-4242-b0", "eft-77-c", "eft-77-b1", "efl-pi4-1", "eft-x-c", "eft-77-b1-extra", "efb-gloo-77"]
    assert et.stale_namespaces(names, alive=lambda pid: pid == 4242) == ["eft-77-c", "eft-77-b1"]
    assert et.stale_namespaces(names, alive=lambda pid: True) == []
    assert et.link_addresses(0) == ("10.241.1.1", "10.241.1.2")


def test_a_cell_passes_on_the_median_ratio_and_loopback_never_fails() -> None:
    cell = et.Cell("100 Mbit/s", 3, "0.25 MB")
    cell.add("plain", [0.030, 0.031, 0.100], 0.004, 0.003)
    cell.add("tls", [0.034, 0.035, 0.036], 0.006, 0.004)
    assert cell.median("plain") == pytest.approx(0.031) and cell.ratio() == pytest.approx(0.035 / 0.031)
    assert cell.passes()  # 1.13x
    cell.add("plain", [0.030, 0.030, 0.030], 0.004, 0.003)
    cell.add("tls", [0.040, 0.040, 0.040], 0.006, 0.004)
    assert cell.ratio() == pytest.approx(0.038 / 0.030) and not cell.passes()  # medians of all rounds pooled
    assert cell.turn_ratios() == pytest.approx([0.035 / 0.031, 0.040 / 0.030])
    assert cell.cpu("tls", "server") == pytest.approx(0.006)
    loopback = et.Cell(et.LOOPBACK, 2, "4.6 MB")
    loopback.add("plain", [0.01], 0.0, 0.0)
    loopback.add("tls", [0.05], 0.0, 0.0)
    assert loopback.ratio() == pytest.approx(5.0) and loopback.passes() and not loopback.shaped


def test_bad_options_are_refused_with_the_option_named(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, word in ((["--boards", "0"], "--boards"), (["--rate-mbit", "0"], "--rate-mbit"),
                       (["--warmup", "0"], "--warmup")):
        with pytest.raises(SystemExit) as exit_info:
            et.parse_args(argv)
        assert exit_info.value.code == 2 and word in capsys.readouterr().err
    args = et.parse_args(["--boards", "3", "2", "3", "--sizes", "4.6 MB", "0.25 MB"])
    assert args.boards == [2, 3] and args.sizes == ["0.25 MB", "4.6 MB"] and args.rate_mbit == [100.0]
