"""``edge-coordinator report``: the page from a real run directory, drawn by a real browser.

tests/fixtures/run_dir is a real ``train --auto`` run of the demo fleet (see its SOURCES.md), from
before runs recorded learning rates, CPU and temperature. The page is built once per module with one
board renamed to a hostile id, checked as HTML, then opened in headless Chromium: each plot's place on
the page is read back from the browser's own layout, and that region of the screenshot must hold a
drawn plot. tests/fixtures/run_pair holds two newer real runs (learning rates in metrics.jsonl, CPU
and temperature in power.jsonl) for the hyperparameters, the learning-rate and board-load plots, and
``report A B``'s page that overlays runs.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edgefleet.coordinator.cli.main import main
from edgefleet.coordinator.control.fleet import FleetView
from edgefleet.coordinator.report import POWER_FILE, PowerLog, write_comparison, write_report
from edgefleet.coordinator.report.figure_kit import line_styles
from edgefleet.coordinator.report.plots import PLOTS
from edgefleet.protocol.messages import TelemetrySample
from edgefleet.protocol.topics import telemetry_topic

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "run_dir"
PAIR = Path(__file__).resolve().parents[1] / "fixtures" / "run_pair"
PLOT_KEYS = ("loss", "validation", "step_time", "batch", "power", "plan")   # what the older fixture run can show
NEW_KEYS = ("lr", "board_load")                                            # what it cannot: recorded since
COMPARE_KEYS = ("compare_loss", "compare_validation", "compare_samples", "compare_lr")
HOSTILE = '<script>alert("pi4 $x")</script>&\'b'   # replaces demo-pi4 everywhere in the run
WINDOW = (1200, 4600)                               # tall enough for the whole page at 1200 px wide
CHROMIUM_TIMEOUT_S = 60
# Appended (by the test only) to a copy of the page: the browser writes where each plot landed.
LAYOUT_PROBE = """<script>
window.addEventListener("load", () => {
  const out = [...document.querySelectorAll("img.plot")].map(img => {
    const r = img.getBoundingClientRect();
    return {id: img.id, x: r.left + scrollX, y: r.top + scrollY, w: r.width, h: r.height, natural: img.naturalWidth};
  });
  const pre = document.createElement("pre"); pre.id = "layout"; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def copy_run(tmp: Path, rename: dict[str, str] | None = None) -> Path:
    """A copy of the fixture run; ``rename`` swaps board ids in its JSON files (JSON-escaped)."""
    run = tmp / "run"
    shutil.copytree(FIXTURE, run)
    for path in [*run.glob("*.json"), *run.glob("*.jsonl")]:
        text = path.read_text()
        for old, new in (rename or {}).items():
            text = text.replace(old, json.dumps(new)[1:-1])
        path.write_text(text)
    return run


@pytest.fixture(scope="module")
def hostile_page(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    run = copy_run(tmp_path_factory.mktemp("report"), {"demo-pi4": HOSTILE})
    page = write_report(run)
    return page, page.read_text()


def rgb_pixels(png: Path | io.BytesIO) -> np.ndarray:
    """A PNG as rows x columns x RGB bytes (Pillow comes with matplotlib)."""
    with Image.open(png) as picture:
        return np.asarray(picture.convert("RGB"))


def distinct_colours(rgb: np.ndarray) -> int:
    """Distinct colours among rows of RGB bytes."""
    return len(np.unique(rgb.astype(np.uint32) @ np.array([1 << 16, 1 << 8, 1], dtype=np.uint32)))


def chromium(*args: str, height: int = WINDOW[1]) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("chromium is not installed: apt-get install chromium (or run .ci/run)")
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={WINDOW[0]},{height}",
                           "--hide-scrollbars", *args], capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S, check=False)


def test_page_holds_every_plot_as_an_embedded_png(hostile_page: tuple[Path, str]) -> None:
    page, text = hostile_page

    assert page.name == "report.html"
    for key in PLOT_KEYS:
        found = re.search(rf'<img class="plot" id="plot-{key}" alt="[^"]*" src="data:image/png;base64,([^"]+)">', text)
        assert found, f"plot {key} is not on the page"
        picture = rgb_pixels(io.BytesIO(base64.b64decode(found[1])))
        assert picture.shape[1] >= 1000 and distinct_colours(picture.reshape(-1, 3)) > 20
    assert len(PLOTS) == len(PLOT_KEYS) + len(NEW_KEYS)
    assert all(f'id="none-{key}"' in text for key in NEW_KEYS)  # an older run: the page says what it lacks
    assert 'id="missing"' not in text  # the fixture run is complete: nothing to report missing
    assert "forced re-split (test hook)" in text and "decided at step" in text  # the re-balance is listed
    assert "0.75\u00d7" in text  # step time measured/predicted, from plan.json: 0.018 / 0.02403


def test_board_ids_are_escaped(hostile_page: tuple[Path, str]) -> None:
    _, text = hostile_page

    assert HOSTILE not in text
    assert "<script" not in text
    assert text.count(html.escape(HOSTILE, quote=True)) >= 3  # the summary, the boards table, the re-balance


def drawn_in_chromium(text: str, tmp_path: Path, keys: tuple[str, ...], height: int = WINDOW[1]) -> None:
    """Open the page in headless Chromium and check that each plot of ``keys`` is laid out on screen and drawn."""
    probe = tmp_path / "probe.html"
    probe.write_text(text.replace("</body>", LAYOUT_PROBE + "</body>"))
    shot = tmp_path / "shot.png"

    done = chromium(f"--screenshot={shot}", "--dump-dom", probe.as_uri(), height=height)  # one start: picture and layout

    assert done.returncode == 0 and shot.exists(), done.stderr[-3000:]
    layout = json.loads(html.unescape(re.search(r'<pre id="layout">(.*?)</pre>', done.stdout, re.S)[1]))  # type: ignore[index]
    assert sorted(p["id"] for p in layout) == sorted(f"plot-{k}" for k in keys)
    pixels = rgb_pixels(shot)
    assert pixels.shape[:2] == (height, WINDOW[0])
    for place in layout:
        assert place["natural"] > 0, f"{place['id']}: the browser could not decode the image"
        x, y, w, h = (round(place[k]) for k in ("x", "y", "w", "h"))
        assert w > 500 and h > 150 and y + h <= height, f"{place['id']} is not laid out on screen: {place}"
        region = pixels[y:y + h, x:x + w].reshape(-1, 3)
        inked = float(np.mean(region.min(axis=1) < 230))   # pixels that are not white
        colours = distinct_colours(region)
        assert 0.03 < inked < 0.9 and colours > 20, f"{place['id']}: {inked:.1%} inked, {colours} colours"
    margin = pixels[:, -15:].reshape(-1, 3)  # the body is 1150 px wide, centred: a blank strip, where the check fails
    assert float(np.mean(margin.min(axis=1) < 230)) < 0.01


def test_chromium_draws_every_plot(hostile_page: tuple[Path, str], tmp_path: Path) -> None:
    drawn_in_chromium(hostile_page[1], tmp_path, PLOT_KEYS)


def test_a_crashed_unplanned_run_gets_a_page_saying_what_is_missing(tmp_path: Path) -> None:
    run = copy_run(tmp_path)
    for name in ("result.json", "plan.json", POWER_FILE):
        (run / name).unlink()
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 58, "loss": 0.1, "compu')  # the crash cut the last line short

    text = write_report(run, tmp_path / "out.html").read_text()

    missing = re.search(r'<div class="missing" id="missing">(.*?)</div>', text, re.S)
    assert missing, "the page does not say what is missing"
    for words in ("result.json is missing", "1 line not whole JSON", "No power readings"):
        assert words in missing[1]
    assert "did not finish: 58 steps logged" in text
    assert 'id="none-plan"' in text and "not planned" in text
    assert 'id="none-power"' in text
    assert 'id="plot-loss"' in text and 'id="plot-step_time"' in text


def test_an_almost_empty_run_dir_still_gets_a_page(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"run_id": "x", "boards": "not a list"}')

    text = write_report(tmp_path).read_text()

    assert "metrics.jsonl is missing" in text
    assert all(f'id="none-{key}"' in text for key in PLOT_KEYS + NEW_KEYS)


@pytest.mark.parametrize("make", [lambda p: p, lambda p: p / "nope", lambda p: p / "file.txt"])
def test_a_folder_that_is_not_a_run_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         make: Callable[[Path], Path]) -> None:
    (tmp_path / "file.txt").write_text("hello")

    code = main(["report", str(make(tmp_path))])

    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "run directory" in err and "Traceback" not in err
    assert not (tmp_path / "report.html").exists()


def test_power_log_writes_each_new_sample_of_the_followed_boards(tmp_path: Path) -> None:
    view, path, ticks = FleetView("edgefleet/v1"), tmp_path / POWER_FILE, iter(range(1000))

    def publish(board: str, seq: int, power_w: float) -> None:
        sample = TelemetrySample(board_id=board, ts=1e9 + seq, seq=seq, interval_s=1.0, power_w=power_w,
                                 power_source="hwmon:ina219")
        view.ingest(telemetry_topic("edgefleet/v1", board), sample.to_json())

    def wait_for_lines(n: int) -> list[dict[str, object]]:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            lines = [json.loads(line) for line in path.read_text().splitlines()]
            if len(lines) >= n:
                return lines
            time.sleep(0.01)
        raise AssertionError(f"{path} did not reach {n} lines: {path.read_text()!r}")

    with PowerLog(view, ["pi-1"], path, poll_s=0.01, clock=lambda: float(next(ticks))):
        publish("pi-1", 7, 5.5)
        publish("other", 7, 9.0)
        wait_for_lines(1)
        publish("pi-1", 8, 6.5)
        wait_for_lines(2)

    with PowerLog(view, ["pi-1"], path, poll_s=0.01, clock=lambda: 0.0):  # a resumed run: its log continues
        publish("pi-1", 0, 4.0)
        wait_for_lines(3)

    lines = wait_for_lines(3)
    assert [(r["board_id"], r["seq"], r["power_w"], r["power_source"]) for r in lines] == [
        ("pi-1", 7, 5.5, "hwmon:ina219"), ("pi-1", 8, 6.5, "hwmon:ina219"), ("pi-1", 0, 4.0, "hwmon:ina219")]
    seen = [float(r["seen_s"]) for r in lines]  # type: ignore[arg-type]
    assert seen[0] < seen[1] == seen[2]  # the clock of the second log stands still at its start


@pytest.fixture(scope="module")
def pair_page(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_report(PAIR / "a", tmp_path_factory.mktemp("pair") / "a.html").read_text()


def test_page_shows_the_runs_hyperparameters(pair_page: str) -> None:
    section = re.search(r'<section id="sec-hyperparameters">(.*?)</section>', pair_page, re.S)

    assert section, "no hyperparameters table"
    rows = dict(re.findall(r"<tr><td>([^<]*)</td><td>([^<]*)</td></tr>", section[1].split("<details>")[0]))
    assert rows["model"] == "examples.my_fleet_job.model:LitClassifier"
    assert rows["model options"] == "hidden=16,lr=0.05"
    assert rows["seed"] == "5"
    assert rows["boards"] == "3: pi5-a, pi5-b, orin"
    assert rows["global batch (per board)"] == "64 (pi5-a 16, pi5-b 16, orin 32)"
    assert rows["length"] == "3 epochs, 24 steps in all, 8 per epoch"
    assert rows["precision"] == "32-true" and rows["gradient accumulation"] == "1"
    assert rows["mode"].startswith("exact")
    assert "every setting in config.json" in section[1] and "<td>rebalance_threshold</td>" in section[1]


def test_page_draws_the_learning_rate_and_each_boards_cpu_and_temperature(pair_page: str, tmp_path: Path) -> None:
    for key in NEW_KEYS:
        found = re.search(rf'<img class="plot" id="plot-{key}" alt="[^"]*" src="data:image/png;base64,([^"]+)">', pair_page)
        assert found, f"plot {key} is not on the page"
        assert distinct_colours(rgb_pixels(io.BytesIO(base64.b64decode(found[1]))).reshape(-1, 3)) > 20
    boards = re.search(r"<h2>Boards</h2>(.*?)</table>", pair_page, re.S)
    assert boards and "mean CPU (%)" in boards[1] and "max temp (°C)" in boards[1]
    head, *rows = [re.findall(r"<t[hd][^>]*>([^<]*)</t[hd]>", row) for row in boards[1].split("<tr>")[1:]]
    cpu, temp = head.index("mean CPU (%)"), head.index("max temp (°C)")
    assert {row[0]: row[temp] for row in rows} == {"pi5-a": "51.35", "pi5-b": "51.35", "orin": "47.53"}
    assert all(50 < float(row[cpu]) <= 100 for row in rows)  # busy training

    drawn_in_chromium(pair_page, tmp_path, PLOT_KEYS[:-1] + NEW_KEYS, height=6400)  # not planned: no plan plot


def test_boards_with_equal_values_get_lines_of_their_own_style() -> None:
    boards = [f"pi-{i}" for i in range(12)]

    styles = line_styles(boards)

    looks = [(s["color"], s["linestyle"], s["marker"]) for s in styles.values()]
    assert len(set(looks)) == len(boards)  # a board past the palette's ten colours is still told apart
    assert len({(s["linestyle"], s["marker"]) for s in list(styles.values())[:4]}) == 4
    assert len({s["markevery"] for s in list(styles.values())[:3]}) == 3  # markers of equal lines do not coincide


def test_report_of_two_runs_overlays_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "both.html"

    code = main(["report", str(PAIR / "a"), str(PAIR / "b"), "-o", str(out)])

    assert code == 0 and str(out) in capsys.readouterr().out
    text = out.read_text()
    ids = [json.loads((PAIR / run / "config.json").read_text())["run_id"] for run in ("a", "b")]
    assert all(text.count(run_id) >= 3 for run_id in ids)  # the title, the runs table, the hyperparameters
    for key in COMPARE_KEYS:
        assert re.search(rf'<img class="plot" id="plot-{key}" alt="[^"]*" src="data:image/png;base64,', text), key
    assert re.search(r'<tr class="differs"><td>model options</td><td>hidden=16,lr=0.05</td><td>hidden=16,lr=0.2</td>', text)
    assert re.search(r"<tr><td>model</td>", text)  # the same in both: not marked
    assert not (PAIR / "a" / "report.html").exists() and not (PAIR / "b" / "report.html").exists()
    drawn_in_chromium(text, tmp_path, COMPARE_KEYS)


def test_an_older_run_is_left_out_of_what_it_did_not_record(tmp_path: Path) -> None:
    text = write_comparison([FIXTURE, PAIR / "a"], tmp_path / "mixed.html").read_text()

    older = json.loads((FIXTURE / "config.json").read_text())["run_id"]
    lr = re.search(r'<section id="sec-compare_lr">(.*?)</section>', text, re.S)
    assert lr and 'id="plot-compare_lr"' in lr[1] and f"Not in this plot (no such figure logged): {older}" in lr[1]
    assert 'id="plot-compare_loss"' in text and "Not in this plot" not in text.split('id="sec-compare_loss"')[1][:3000]
