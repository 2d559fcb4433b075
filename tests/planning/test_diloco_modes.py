"""The planner weighs DiLoCo (``--allow-inexact --outer-optimizer diloco``) at local SGD's bytes for the same period.

Four equal boards built from the planner's lines (tests/planning builders), as in test_modes: a step is
a + c * b + W / up + max(W / down, N * W / L), with W = G / H + 64 bytes for both local SGD and DiLoCo every H steps.
"""

from __future__ import annotations

import argparse

import pytest

from edgefleet.coordinator.cli.plan import add_plan_parser, request_from_args
from edgefleet.coordinator.planning import EXACT, FleetProfile, candidate_modes, local_sgd, plan
from edgefleet.coordinator.planning.modes import DILOCO_EVERY, LOCAL_SGD_EVERY, ROUND_BYTES, diloco
from edgefleet.coordinator.planning.plan_job import mode_job_options
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.protocol.errors import ConfigError, PlanError
from tests.planning import MB, board, fleet

G, D, B = 250_000, 6000, 128
LENET = "lenet5{}[1,32,32]"


def _links_bound() -> FleetProfile:
    return fleet(*(board(f"w{i}", a=0.01, c=0.001, link=2.5 * MB, key=LENET) for i in range(4)), grad_bytes=G, dataset_len=D,
                 key=LENET)


def _epoch_by_hand(wire: float) -> float:
    step = 0.01 + 0.001 * (B // 4) + wire / (2.5 * MB) + max(wire / (2.5 * MB), 4 * wire / (125 * MB))
    return D / B * step


def test_diloco_costs_what_local_sgd_costs_and_runs_with_its_train_flags() -> None:
    for every in (4, 8, 16):
        mode = diloco(every)
        assert mode.wire_bytes(G) == local_sgd(every).wire_bytes(G) == G / every + ROUND_BYTES
        assert not mode.exact and mode.departure == local_sgd(every).departure
        assert mode.train_flags == ("--sync-every", str(every), "--outer-optimizer", "diloco")
        spec = JobSpec(model="lenet5", dataset="digits", **mode_job_options(mode.job_options))
        assert (spec.sync_every, spec.outer_optimizer, spec.outer_lr, spec.outer_momentum) == (every, "diloco", 0.7, 0.5)
    assert diloco(8, lr=0.5, momentum=0.8).train_flags[-4:] == ("--outer-lr", "0.5", "--outer-momentum", "0.8")
    with pytest.raises(PlanError, match="--outer-momentum 1"):
        diloco(8, momentum=1.0)
    with pytest.raises(PlanError, match="H a whole number >= 2"):
        diloco(1)


def test_allow_inexact_weighs_diloco_only_when_asked() -> None:
    plain = candidate_modes(allow_inexact=True)
    assert plain == (EXACT, *(local_sgd(h) for h in LOCAL_SGD_EVERY))
    asked = candidate_modes(allow_inexact=True, outer_optimizer="diloco")
    assert asked == (*plain, *(diloco(h) for h in DILOCO_EVERY))
    assert candidate_modes(allow_inexact=False, outer_optimizer="diloco") == (EXACT,)


def test_links_bound_training_picks_diloco_at_its_longer_period_when_weighed() -> None:
    result = plan({"default": _links_bound()}, objective="time",
                  modes=candidate_modes(allow_inexact=True, outer_optimizer="diloco"))
    assert result.chosen.mode == diloco(16)
    assert result.chosen.epoch_time_s == pytest.approx(_epoch_by_hand(G / 16 + ROUND_BYTES), rel=1e-9)
    # at the same period the two cost the same; the tie goes to local SGD (listed first)
    tied = plan({"default": _links_bound()}, objective="time", modes=(EXACT, local_sgd(8), diloco(8)))
    assert tied.chosen.mode == local_sgd(8)


def test_plan_refuses_outer_optimizer_without_allow_inexact() -> None:
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", "--outer-optimizer", "diloco"])
    with pytest.raises(ConfigError, match="--outer-optimizer diloco asks the plan to weigh DiLoCo.*add --allow-inexact"):
        request_from_args(args, [128], 1.0)
    args = parser.parse_args(["plan", "--outer-optimizer", "diloco", "--allow-inexact"])
    assert request_from_args(args, [128], 1.0).outer_optimizer == "diloco"
