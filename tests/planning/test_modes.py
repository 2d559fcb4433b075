"""The planner's training modes: exact, and local SGD when the user allows modes that change the mathematics.

Fleets are four equal boards built from the planner's lines (tests/planning builders), so the
chosen configuration and its figures can be worked out by hand from the cost model's formulas:
step = a + c * b (compute) + W / up (the board's upload) + max(W / down, N * W / L) (the average
back), epoch = D / B * step, with W the bytes each way per step: G in the exact mode, G / H + 64
in local SGD every H steps (``planning.modes``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from edgefleet.coordinator.cli.auto import planner_flags_given
from edgefleet.coordinator.cli.plan import add_plan_parser, cmd_plan
from edgefleet.coordinator.cli.train import add_train_parser
from edgefleet.coordinator.planning import (
    EXACT,
    INEXACT_MARGIN,
    LOCAL_SGD_EVERY,
    Candidate,
    Estimate,
    FleetProfile,
    TrainingMode,
    candidate_modes,
    estimate,
    local_sgd,
    plan,
    save_profiles,
)
from edgefleet.coordinator.planning.modes import ROUND_BYTES
from edgefleet.coordinator.planning.plan_job import INEXACT_MARGIN_PCT, mode_job_options
from edgefleet.coordinator.planning.plan_summary import estimate_json, mode_lines, summary_of
from edgefleet.coordinator.planning.profiles import ProfileMeta
from edgefleet.coordinator.planning.verify import Trial, choose_measured, measure
from edgefleet.protocol.errors import ConfigError, EdgeTrainError, PlanError
from tests.planning import MB, board, fleet

G = 250_000          # LeNet-5's gradient in fp32, bytes
D = 6000             # samples per epoch
B = 128              # the global batch both plans choose (the largest offered: fewest steps per epoch)
LENET = "lenet5{}[1,32,32]"


def _fleet(*, a: float, c: float, link: float) -> FleetProfile:
    return fleet(*(board(f"w{i}", a=a, c=c, link=link, key=LENET) for i in range(4)), grad_bytes=G, dataset_len=D,
                 key=LENET)


def _links_bound() -> FleetProfile:
    """LeNet-5-like: 1 ms per sample, 20 Mbit/s Wi-Fi both ways: an exact step is 83% exchange."""
    return _fleet(a=0.01, c=0.001, link=2.5 * MB)


def _compute_bound() -> FleetProfile:
    """20 ms per sample over 100 Mbit/s: an exact step is 6% exchange."""
    return _fleet(a=0.02, c=0.02, link=12.5 * MB)


def _epoch_by_hand(*, a: float, c: float, link: float, wire: float) -> float:
    """Four boards at 32 samples each (B = 128), every link ``link`` bytes/s, the coordinator's 125 MB/s."""
    step = a + c * (B // 4) + wire / link + max(wire / link, 4 * wire / (125 * MB))
    return D / B * step


def test_without_the_flag_only_exact_modes_are_candidates_and_the_plan_says_inexact_ones_exist() -> None:
    result = plan({"default": _links_bound()}, objective="time")

    assert result.modes == (EXACT,) and not result.inexact_allowed
    assert all(e.mode.exact for e in (*result.ranked, *result.front))
    assert result.declined_inexact is None and result.best_exact is None
    assert result.chosen.epoch_time_s == pytest.approx(_epoch_by_hand(a=0.01, c=0.001, link=2.5 * MB, wire=G), rel=1e-9)
    [hint] = mode_lines(result)
    assert hint.startswith("the exchange takes 83% of the chosen step: --allow-inexact lets the planner consider local SGD")
    assert "local-sgd" not in summary_of(result.chosen, "chosen")


def test_with_the_flag_links_bound_training_picks_local_sgd_and_gains_what_the_formulas_say() -> None:
    exact_epoch = _epoch_by_hand(a=0.01, c=0.001, link=2.5 * MB, wire=G)
    local_epoch = _epoch_by_hand(a=0.01, c=0.001, link=2.5 * MB, wire=G / 8 + ROUND_BYTES)   # 3.143 s against 11.34 s

    result = plan({"default": _links_bound()}, objective="time", modes=candidate_modes(allow_inexact=True))
    heuristic = plan({"default": _links_bound()}, objective="time", modes=candidate_modes(allow_inexact=True),
                     method="heuristic")

    chosen = result.chosen
    assert chosen.mode == local_sgd(8) and chosen.mode.job_options == {"sync_every": 8}
    assert chosen.candidate.batch_sizes == (32, 32, 32, 32)
    assert chosen.epoch_time_s == pytest.approx(local_epoch, rel=1e-9)
    assert result.best_exact is not None and result.best_exact.mode.exact
    assert result.best_exact.epoch_time_s == pytest.approx(exact_epoch, rel=1e-9)
    assert 1 - chosen.epoch_time_s / result.best_exact.epoch_time_s == pytest.approx(1 - local_epoch / exact_epoch)
    assert {e.mode.name for e in result.ranked} >= {"local-sgd-8"}
    assert heuristic.chosen.mode == chosen.mode and heuristic.chosen.epoch_time_s == pytest.approx(local_epoch, rel=1e-9)
    # estimate() of the same candidate gives the search's figures.
    again = estimate(Candidate(boards=chosen.candidate.boards, batch_sizes=chosen.candidate.batch_sizes, variant={},
                               mode=local_sgd(8)), _links_bound())
    assert again.epoch_time_s == pytest.approx(local_epoch, rel=1e-9)
    lines = mode_lines(result)
    assert lines[0] == "mode: local SGD, averaging every 8 steps: changes the mathematics (train --sync-every 8)"
    assert lines[1].startswith("it is 72% better by estimate (time per epoch) than the best exact configuration")
    assert lines[2].startswith("note: the figures are per epoch in the mode's steady state")


def test_a_compute_bound_fleet_gains_little_and_the_near_tie_goes_to_exact() -> None:
    exact_epoch = _epoch_by_hand(a=0.02, c=0.02, link=12.5 * MB, wire=G)
    every8 = _epoch_by_hand(a=0.02, c=0.02, link=12.5 * MB, wire=G / 8 + ROUND_BYTES)
    every4 = _epoch_by_hand(a=0.02, c=0.02, link=12.5 * MB, wire=G / 4 + ROUND_BYTES)
    gain = 1 - every8 / exact_epoch                                         # 5%: under the 10% margin

    result = plan({"default": _compute_bound()}, objective="time", modes=candidate_modes(allow_inexact=True))
    # A smaller margin lets local SGD in; of the inexact near ties (every 4 steps is 0.75% slower than
    # every 8, within the 2% of --fewer-boards-within) the mode that strays least from exact is chosen.
    lower = plan({"default": _compute_bound()}, objective="time", modes=candidate_modes(allow_inexact=True),
                 inexact_margin=0.04)
    # The heuristic search applies the same rule.
    lower_heuristic = plan({"default": _compute_bound()}, objective="time", modes=candidate_modes(allow_inexact=True),
                           inexact_margin=0.04, method="heuristic")

    assert 0.04 < gain < INEXACT_MARGIN
    assert result.chosen.mode.exact and result.chosen.epoch_time_s == pytest.approx(exact_epoch, rel=1e-9)
    declined = result.declined_inexact
    assert declined is not None and declined.mode == local_sgd(8)
    assert declined.epoch_time_s == pytest.approx(every8, rel=1e-9)
    assert mode_lines(result) == [
        f"inexact modes considered (--allow-inexact): the best, w0:32 w1:32 w2:32 w3:32 in local SGD, averaging every "
        f"8 steps, is {gain:.1%} better by estimate (time per epoch), under the 10% an inexact mode must gain: the "
        f"exact mode is chosen"]
    assert lower.chosen.mode == local_sgd(4) and lower.chosen.epoch_time_s == pytest.approx(every4, rel=1e-9)
    assert lower.passed_over is not None and lower.passed_over.mode == local_sgd(8)
    assert lower_heuristic.chosen == lower.chosen


def test_plan_json_and_table_carry_the_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "edgefleet-profile.json"
    save_profiles(path, {"default": _links_bound()}, meta=ProfileMeta(model="lenet5", dataset="digits", batch_sizes=[8, 32]))
    parser = argparse.ArgumentParser(prog="edge-coordinator")
    add_plan_parser(parser.add_subparsers(dest="command"))

    def run(*flags: str) -> str:
        args = parser.parse_args(["plan", "--profile", str(path), "--no-fleet-check", "--objective", "time",
                                  "--png", str(tmp_path / "front.png"), *flags])
        assert cmd_plan(args) == 0
        return capsys.readouterr().out

    allowed = json.loads(run("--json", "--allow-inexact"))
    shown = " ".join(run("--allow-inexact").split())
    exact = estimate_json(plan({"default": _links_bound()}, objective="time").chosen)  # as plan --json prints it

    assert exact["mode"]["name"] == "exact" and exact["mode"]["exact"] is True and exact["mode"]["train_flags"] == []
    assert allowed["modes"] == ["exact", "local-sgd-2", "local-sgd-4", "local-sgd-8"]
    mode = allowed["chosen"]["mode"]
    assert mode["name"] == "local-sgd-8" and mode["exact"] is False and mode["wire_fraction"] == 1 / 8
    assert mode["train_flags"] == ["--sync-every", "8"] and mode["job_options"] == {"sync_every": 8}
    assert mode["headline"] == "local SGD, averaging every 8 steps: changes the mathematics"
    assert allowed["best_exact"]["mode"]["name"] == "exact"
    assert "mode: local SGD, averaging every 8 steps: changes the mathematics (train --sync-every 8)" in shown
    assert "(global batch 128, default, local-sgd-8)" in shown and "inexact modes allowed" in shown


def test_help_of_plan_and_train_says_what_inexact_means() -> None:
    parser = argparse.ArgumentParser(prog="edge-coordinator")
    sub = parser.add_subparsers(dest="command")
    add_plan_parser(sub)
    add_train_parser(sub)

    for command in ("plan", "train"):
        text = " ".join(sub.choices[command].format_help().split())
        assert "--allow-inexact" in text
        assert "the boards step on their own gradients and average their parameters every H steps" in text
        assert "Accuracy per epoch may differ from single-process training" in text
        assert f"at least {INEXACT_MARGIN_PCT:g}% better by estimate" in text
    assert INEXACT_MARGIN_PCT == INEXACT_MARGIN * 100 and LOCAL_SGD_EVERY == (2, 4, 8)  # the help's figures
    train = parser.parse_args(["train", "--model", "lenet5", "--dataset", "digits", "--allow-inexact"])
    assert "--allow-inexact" in planner_flags_given(train)   # without --auto, train refuses it


@pytest.mark.parametrize("every", [1, 0, -2, 2.5, True, "4"])
def test_bad_local_sgd_periods_are_refused(every: object) -> None:
    with pytest.raises(PlanError, match="local SGD averages every H steps with H a whole number >= 2"):
        local_sgd(every)  # type: ignore[arg-type]  # wrong types on purpose: the refusal is what is tested


def test_bad_mode_requests_are_refused() -> None:
    one = {"default": _links_bound()}
    with pytest.raises(PlanError, match="plan with the exact mode too"):
        plan(one, objective="time", modes=(local_sgd(4),))
    with pytest.raises(PlanError, match="each training mode once"):
        plan(one, objective="time", modes=(EXACT, local_sgd(4), local_sgd(4)))
    with pytest.raises(PlanError, match=r"inexact_margin 1\.5 must be a fraction in \[0, 1\)"):
        plan(one, objective="time", modes=candidate_modes(allow_inexact=True), inexact_margin=1.5)
    with pytest.raises(PlanError, match="wire_fraction 0 must be in"):
        TrainingMode(name="none", description="nothing sent", exact=False, wire_fraction=0.0)
    with pytest.raises(ConfigError, match="no JobSpec no_such_option"):
        mode_job_options({"no_such_option": 1})


def test_a_local_sgd_step_is_timed_over_whole_periods() -> None:
    intervals = [0.1, 0.1, 0.1, 0.5] * 3 + [0.1]   # one step in four carries the exchange; a partial period at the end

    every4 = measure(intervals, {}, boards=("a",), global_batch=64, dataset_len=640, period=4)
    every1 = measure(intervals, {}, boards=("a",), global_batch=64, dataset_len=640)

    assert every4.step_time_s == pytest.approx(0.2) and every4.steps == 12
    assert every4.epoch_time_s == pytest.approx(2.0)
    assert every1.step_time_s == pytest.approx(0.1)
    with pytest.raises(EdgeTrainError, match="fewer than one period of 8 steps"):
        measure(intervals[:5], {}, boards=("a",), global_batch=64, dataset_len=640, period=8)


def test_pretraining_chooses_an_inexact_candidate_only_when_measured_clearly_faster() -> None:
    result = plan({"default": _links_bound()}, objective="time", modes=candidate_modes(allow_inexact=True))
    assert result.best_exact is not None
    exact, local = result.best_exact, result.chosen

    def trial(estimate: Estimate, step_s: float) -> Trial:
        return Trial(estimate=estimate, measured=measure([step_s] * 8, {}, boards=estimate.candidate.boards,
                                                         global_batch=B, dataset_len=D))

    assert choose_measured([trial(exact, 0.25), trial(local, 0.20)], "time").estimate is local       # 20% faster
    assert choose_measured([trial(exact, 0.25), trial(local, 0.24)], "time").estimate is exact       # 4%: exact
    assert choose_measured([trial(local, 0.24)], "time").estimate is local                           # no exact one


def test_train_auto_runs_the_chosen_mode_and_pretraining_measures_its_steady_state() -> None:
    from edgefleet.coordinator.planning.plan_job import PlanRequest
    from edgefleet.coordinator.planning.verify import pretraining_job
    from edgefleet.coordinator.run.auto_train import check_auto_job, job_for, mode_warmup_steps
    from edgefleet.coordinator.run.job_spec import JobSpec

    result = plan({"default": _links_bound()}, objective="time", modes=candidate_modes(allow_inexact=True))
    spec = JobSpec(model="lenet5", dataset="digits", epochs=2.0)
    request = PlanRequest(objective="time", max_power_w=None, deadline_s=None, global_batches=(B,), count_idle=False,
                          max_memory_fraction=0.9, top=5, allow_inexact=True)

    job = job_for(spec, result.chosen, D)
    assert result.best_exact is not None
    exact_job = job_for(spec, result.best_exact, D)
    trial = pretraining_job(spec, result.chosen, 25)

    assert job.boards == ("w0", "w1", "w2", "w3") and job.sync_every == 8
    assert mode_warmup_steps(job) == job.steps_per_epoch == D // B   # the exact warm-up: the first epoch
    assert exact_job.sync_every == 1 and mode_warmup_steps(exact_job) == 0
    assert trial.sync_every == 8 and trial.sync_warmup == 0
    check_auto_job(spec, request)
    with pytest.raises(ConfigError, match="--sync-every 4 with --auto: the planner chooses the training mode"):
        check_auto_job(JobSpec(model="lenet5", dataset="digits", sync_every=4), request)
