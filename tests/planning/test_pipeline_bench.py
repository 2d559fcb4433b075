"""bench/pipeline.py's parts free of the lab: the ratio against the best data-parallel run, the steps-once check
of a recovery run, and the refusals of its command line."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load() -> ModuleType:
    # bench/ is a folder of scripts: its modules import each other by name, from the script's folder
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("pipeline_bench", BENCH / "pipeline.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up by name
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


pb = _load()


def _row(kind: str, rate: float | None, target: float | None) -> Any:
    return pb.SpeedRow(kind=kind, boards="b", batch_sizes=[128], micro_batches=None, samples_per_s=rate,
                       median_step_ms=None, time_to_target_s=target, target_epoch=None, final_val_accuracy=None,
                       wire_kib_per_step_board=None, wire_kib_per_step_max=None, wire_kib_per_step={},
                       exchange_kib_per_step_board=None, steps=10, stolen=0.0, others_share=0.0)


def test_each_run_is_compared_with_the_fastest_data_parallel_run() -> None:
    rows = [_row("data-parallel", 200.0, 30.0), _row("data-parallel", 250.0, 24.0), _row("piped", 600.0, 8.0),
            _row("piped", None, None)]
    pb.with_ratios(rows)
    assert [r.ratio_rate for r in rows] == [0.8, 1.0, 2.4, None]
    assert rows[2].ratio_target == pytest.approx(3.0) and rows[3].ratio_target is None


def test_without_a_data_parallel_run_there_is_no_ratio() -> None:
    rows = pb.with_ratios([_row("piped", 600.0, 8.0)])
    assert rows[0].ratio_rate is None


def test_a_piped_run_is_the_head_on_the_tail_board_or_the_planners_whole_pipeline() -> None:
    hand = pb.PipedConfig("piped", ("pi5-1", "pi5-2"), (64, 64), 2, "planned")
    assert hand.pipeline == f"pi5-1+pi5-2,{pb.CUT}@{pb.TAIL_BOARD}" and hand.boards == ("pi5-1", "pi5-2", pb.TAIL_BOARD)
    planned = pb.PipedConfig("planned", ("x86-1",), (128,), 2, "planner", shape="x86-1,net.6@pi5-1+pi5-2",
                             flags=("--stage-sync", "checkpoint"))
    assert planned.pipeline == "x86-1,net.6@pi5-1+pi5-2" and planned.boards == ("x86-1", "pi5-1", "pi5-2")


def test_steps_once_names_the_missing_and_the_repeated_steps() -> None:
    assert pb.steps_once([0, 1, 2, 3], 4) == ([], [])
    assert pb.steps_once([0, 1, 2, 2, 3, 5], 6) == ([4], [2])


def test_the_victim_must_be_a_later_stage_board(capsys: pytest.CaptureFixture[str]) -> None:
    assert pb.parse_args(["--victim", "x86-1"]).victim == "x86-1"
    with pytest.raises(SystemExit):
        pb.parse_args(["--victim", "pi5-1"])  # stage 0's: the recovery run plans around later stages
    assert "not a later stage's board" in capsys.readouterr().err
    grouped = ["--recovery-pipeline", "pi5-1,net.2@pi4-3+pi4-2,net.6@x86-1", "--victim", "pi4-2"]
    assert pb.parse_args(grouped).victim == "pi4-2"  # a board of a later group is a later stage's board


def test_the_head_board_is_refused_in_stage_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        pb.parse_args(["--stage0", "pi5-1+x86-1"])
    assert "leave it out of stage 0" in capsys.readouterr().err


def test_steps_rolled_back_and_trained_again_are_read_from_the_coordinators_notes() -> None:
    rolled_back = ("step 9: board(s) q1 sent no gradient ...: stopping after step 8. Bring ...\n"
                   "board(s) q3 went offline: re-planning from step 6: q3's layers ...\n")
    kept = "stopping after step 9. Bring ...\nboard(s) q3 went offline: re-planning from step 10: ...\n"
    assert pb.trained_again(rolled_back) == [6, 7, 8]
    assert pb.trained_again(kept) == [] and pb.trained_again("") == []


def test_metric_steps_reads_whole_lines_of_a_file_rewritten_shorter(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert pb.metric_steps(path) == []
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2')  # the last line still being written
    assert pb.metric_steps(path) == [0, 1]
    path.write_text('{"step": 0}\n')  # a rollback rewrote it
    assert pb.metric_steps(path) == [0]
