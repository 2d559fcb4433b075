"""A pipelined run's coordinator side before any board starts (issue 35): ``--pipeline`` read, the replica's model
cut and checked on a sample batch, and the exchange's layout (stage 0's group sharing its slots)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

from edgefleet.agent.stage_worker import BoardStage, load_stage_weights, release_other_stages
from edgefleet.coordinator.cli.main import build_parser
from edgefleet.coordinator.cli.train_args import job_from_args
from edgefleet.coordinator.pipeline.piped_run import prepare
from edgefleet.coordinator.pipeline.replan import Comeback, replan
from edgefleet.coordinator.pipeline.stage_plan import parse_stage_plan
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.coordinator.run.train_job import _replanned, repipeline
from edgefleet.protocol.codec import decode_value, encode_value
from edgefleet.protocol.errors import ConfigError, EdgeTrainError
from edgefleet.protocol.exchange_frames import Welcome
from edgefleet.protocol.stage_routes import stage_routes
from edgefleet.workloads.models import LeNet5
from edgefleet.workloads.params import to_numpy_tree, to_torch_tree
from edgefleet.workloads.stage_cut import cut_stages
from tests.helpers import train_args


def _lenet() -> LeNet5:
    torch.manual_seed(0)
    return LeNet5((1, 32, 32), 10)


def _sample() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 1, 32, 32), torch.tensor([1, 2])


def test_the_pipeline_flag_names_stage_0s_boards_then_each_cut_and_its_board() -> None:
    plan = parse_stage_plan("p1+p2, net.6@p3")
    assert plan.boards == ("p1", "p2", "p3") and plan.group == 2 and plan.cuts == ("net.6",) and plan.hosts == ("p3",)
    assert plan.text() == "p1+p2,net.6@p3"
    assert parse_stage_plan("a,net.2@b,net.8@c").group == 1


@pytest.mark.parametrize(("text", "fragment"), [
    ("p1", "give stage 0's board, then CUT@BOARD"),
    ("net.2@p1,net.6@p2", "the first item is stage 0's board"),
    ("p1,net.2", "'net.2' is not CUT@BOARD"),
    ("p1,net.2@p1", "board p1 holds two stages"),
    ("p1+,net.2@p2", "joined by + with no empty name"),
])
def test_a_malformed_pipeline_flag_is_refused_saying_what_it_takes(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace("+", r"\+")):
        parse_stage_plan(text)


def test_the_layout_puts_each_stage_in_the_replicas_order_and_stage_0s_boards_share_their_slots() -> None:
    model = _lenet()
    params = list(model.parameters())
    run = prepare(model, parse_stage_plan("p1+p2,net.6@p3"), 2, params, _sample(), [6, 10, 0])
    layout = run.layout
    conv = sum(p.numel() for p in params[:4])
    assert layout.group == 2 and layout.elements == [conv, conv, sum(p.numel() for p in params) - conv]
    assert layout.slots[0] == layout.slots[1] == [(0, 0, conv)] and layout.slots[2] == [(0, conv, layout.elements[2])]
    assert layout.global_batch == 16 and run.shapes == [(400,), (10,)]
    spec = run.spec({"p1": "10.0.0.1", "p2": "10.0.0.2", "p3": "10.0.0.3"}, {b: "ab" * 32 for b in ("p1", "p2", "p3")},
                    {"p1": 47310, "p2": 47311, "p3": 47314})
    assert spec.group == 2 and [p.port for p in spec.stages] == [47310, 47311, 47314] and spec.max_rows == 10


def test_a_later_stage_may_be_a_group_whose_boards_share_its_slots_and_each_runs_its_micro_batches() -> None:
    model = _lenet()
    params = list(model.parameters())
    plan = parse_stage_plan("p1,net.6@p2+p3")
    assert plan.sizes == (1, 2) and plan.stage_boards(1) == ("p2", "p3") and plan.text() == "p1,net.6@p2+p3"
    run = prepare(model, plan, 4, params, _sample(), [16, 0, 0])
    layout = run.layout
    assert layout.sizes == (1, 2) and layout.slots[1] == layout.slots[2] and layout.rows == (16, 8, 8)
    assert layout.averaged(1) and layout.averaged(2) and layout.stage_of(2) == 1
    spec = run.spec({b: "10.0.0.1" for b in plan.boards}, {b: "ab" * 32 for b in plan.boards},
                    {"p1": 47310, "p2": 47311, "p3": 47312})
    assert spec.groups == [1, 2] and spec.stage_count == 2 and "stage 1 on p2+p3" in run.describe()
    with pytest.raises(ConfigError, match=r"stage 1's 2 boards share 1 micro-batch\(es\) a step, so one would have none: "
                                          "give --micro-batches 2 or more"):
        prepare(_lenet(), plan, 1, list(model.parameters()), _sample(), [16, 0, 0])


class _Twice(LeNet5):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x) + self(x), y)


def test_what_a_pipeline_cannot_train_exactly_is_refused_before_any_board_starts() -> None:
    torch.manual_seed(0)
    twice = _Twice((1, 32, 32), 10)
    with pytest.raises(ConfigError, match="ran the model's forward 2 times on one batch"):
        prepare(twice, parse_stage_plan("p1,net.6@p2"), 1, list(twice.parameters()), _sample(), [4, 0])
    model = _lenet()
    model.net[1] = nn.BatchNorm2d(6)  # a layer with running statistics
    with pytest.raises(ConfigError, match=r"holds buffers \(net\.1\.running_mean"):
        prepare(model, parse_stage_plan("p1,net.6@p2"), 1, list(model.parameters()), _sample(), [4, 0])
    with pytest.raises(ConfigError, match="no layer named 'net.99'"):
        prepare(_lenet(), parse_stage_plan("p1,net.99@p2"), 1, list(_lenet().parameters()), _sample(), [4, 0])


def _job(*flags: str) -> Any:
    return job_from_args(build_parser().parse_args(train_args(*flags, model="lenet5", dataset="digits", batch="8")))


def test_placement_with_the_tail_on_a_board_is_a_two_stage_pipeline() -> None:
    spec = _job("--boards", "p1,p2", "--placement", "net.6@p3")
    assert spec.pipeline == "p1+p2,net.6@p3" and spec.placement == "" and spec.boards == ()
    assert _job("--boards", "p1,p3", "--placement", "net.6@p3").pipeline == "p1,net.6@p3"  # the tail's board named too
    assert _job("--placement", "net.6@coordinator").placement == "net.6"  # the coordinator's tail, as before
    with pytest.raises(ConfigError, match="name the boards that train the layers up to net.6 with --boards"):
        _job("--placement", "net.6@p3")
    with pytest.raises(ConfigError, match="both place layers"):
        _job("--boards", "p1", "--placement", "net.6@p3", "--pipeline", "p1,net.6@p3")


def test_a_lost_later_stage_hands_its_layers_to_the_stage_before_and_a_lost_stage_0_board_its_samples() -> None:
    plan = parse_stage_plan("q1+q2,net.2@q3,net.8@q4")
    last = replan(plan, [6, 10, 0, 0], {"q4"})
    assert last is not None and last.pipeline == "q1+q2,net.2@q3" and last.batch_sizes == (6, 10, 0)
    middle = replan(plan, [6, 10, 0, 0], {"q3"})
    assert middle is not None and middle.pipeline == "q1+q2,net.8@q4"  # q3's layers go to stage 0
    member = replan(plan, [6, 11, 0, 0], {"q1"})
    assert member is not None and member.pipeline == "q2,net.2@q3,net.8@q4" and member.batch_sizes == (17, 0, 0)
    alone = replan(parse_stage_plan("q1+q2,net.6@q3"), [6, 10, 0], {"q3"})
    assert alone is not None and alone.pipeline == "" and alone.boards == ("q1", "q2") and alone.batch_sizes == (6, 10)
    assert replan(plan, [6, 10, 0, 0], {"q1", "q2"}) is None  # no board holds the data any more


def test_a_later_group_keeps_no_more_boards_than_the_step_has_micro_batches_after_a_stage_0_board_is_lost() -> None:
    plan = parse_stage_plan("q1+q2,net.2@q3+q4+q5")
    one_each = replan(plan, [6, 10, 0, 0, 0], {"q1"}, micro_batches=2)  # q2 alone: 2 micro-batches for 3 boards
    assert one_each is not None and one_each.pipeline == "q2,net.2@q3+q4" and one_each.batch_sizes == (16, 0, 0)
    assert "q5 left out (after net.2): a step has 2 micro-batch(es)" in one_each.why
    routes = stage_routes([1, 2], [16], 2)
    assert all(routes.rows_of(1, member) for member in range(2))  # every kept board has work: train runs it
    kept = replan(plan, [6, 10, 0, 0, 0], {"q1"}, micro_batches=4)
    assert kept is not None and kept.pipeline == "q2,net.2@q3+q4+q5" and "left out" not in kept.why
    comeback = Comeback("q1+q2,net.2@q3+q4+q5", (6, 10, 0, 0, 0), frozenset({"q1", "q4"}), micro_batches=1)
    back, still = comeback.back({"q4"})  # q4 is back, q1 still away: one micro-batch a step, one board of the group
    assert back.pipeline == "q2,net.2@q3" and "q4, q5 left out" in back.why and still is not None


def test_a_pipelined_run_resumes_on_other_boards_with_stage_0s_slices_kept() -> None:
    spec = _job("--pipeline", "p1+p2,net.2@p3,net.8@p4", "--batch", "6,10")
    resolved = replace(spec, boards=("p1", "p2", "p3", "p4"), batch_sizes=(6, 10, 0, 0))
    moved = repipeline(resolved, "p1+p2,net.6@p5", 4)
    assert moved.pipeline == "p1+p2,net.6@p5" and moved.boards == ("p1", "p2", "p5")
    assert moved.batch_sizes == (6, 10, 0) and moved.micro_batches == 4
    with pytest.raises(ConfigError, match="stage 0 had 2 board"):
        repipeline(resolved, "p1,net.6@p5", None)


def test_stage_sync_is_a_pipelines_flag_its_state_travels_in_float32_and_a_replan_to_data_parallel_drops_it() -> None:
    assert _job("--pipeline", "p1,net.6@p2").stage_sync == "step"
    assert _job("--pipeline", "p1,net.6@p2", "--stage-sync", "checkpoint").stage_sync == "checkpoint"
    with pytest.raises(ConfigError, match="--stage-sync checkpoint says when a pipeline's later stages send their state: "
                                          "add --pipeline"):
        _job("--stage-sync", "checkpoint")
    with pytest.raises(ConfigError, match="which --wire-dtype bfloat16 would round"):
        _job("--pipeline", "p1,net.6@p2", "--stage-sync", "checkpoint", "--wire-dtype", "bfloat16")
    with pytest.raises(SystemExit):
        _job("--pipeline", "p1,net.6@p2", "--stage-sync", "sometimes")
    spec = replace(_job("--pipeline", "q1+q2,net.6@q3", "--batch", "6,10", "--stage-sync", "checkpoint"),
                   boards=("q1", "q2", "q3"), batch_sizes=(6, 10, 0))
    alone = replan(parse_stage_plan(spec.pipeline), list(spec.batch_sizes), {"q3"})
    assert alone is not None and _replanned(spec, alone).stage_sync == "step"


def test_each_board_is_welcomed_with_its_own_stages_weights_and_optimizer_state_and_holds_no_other() -> None:
    """The coordinator cuts the welcome to the board's stage; the board releases the other stages' weights and loads
    its own: each board holds one stage, so a model bigger than any board can train."""
    model = _lenet()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(_sample()[0]).sum().backward()
    optimizer.step()  # an Adam state for every weight
    run = prepare(model, parse_stage_plan("p1+p2,net.6@p3"), 2, list(model.parameters()), _sample(), [6, 10, 0])
    whole = Welcome(step=3, model=encode_value(to_numpy_tree(model.state_dict())),
                    optimizer=encode_value(to_numpy_tree(optimizer.state_dict())))
    head = [n for n, _ in model.named_parameters()][:4]  # the convolutions: stage 0
    tail = [n for n, _ in model.named_parameters()][4:]
    for index, stage, kept in ((1, 0, head), (2, 1, tail)):
        welcome = run.stage_welcome(index, whole, optimizer)
        assert sorted(decode_value(welcome.model)) == sorted(kept)
        state = decode_value(welcome.optimizer)
        assert sorted(int(k) for k in state["state"]) == sorted(
            i for i, (n, _) in enumerate(model.named_parameters()) if n in kept)
        assert len(state["param_groups"][0]["params"]) == len(list(model.parameters()))  # the groups stay whole

        board_model = _lenet()
        staged = cut_stages(board_model, ["net.6"], micro_batches=2)
        board = BoardStage(spec=None, stage=stage, member=0, staged=staged, params=list(staged.params[stage]),
                           stage0_elements=0)
        release_other_stages(board, board_model)
        assert sorted(board.released) == sorted(head if stage else tail)
        assert all(p.numel() == 0 for n, p in board_model.named_parameters() if n not in kept)
        load_stage_weights(board, board_model, to_torch_tree(decode_value(welcome.model)))
        for name, p in board_model.named_parameters():
            if name in kept:
                torch.testing.assert_close(p, dict(model.named_parameters())[name], rtol=0, atol=0)
        with pytest.raises(EdgeTrainError, match=f"does not hold stage {stage}'s weights"):
            load_stage_weights(board, board_model, {})


def test_a_lost_board_that_comes_back_is_planned_in_again_and_one_still_away_is_not() -> None:
    planned = Comeback("q1+q2,net.2@q3,net.8@q4", (6, 10, 0, 0), frozenset(), micro_batches=4, stage_sync="checkpoint")
    away = planned.losing({"q4"}).losing({"q3"})
    assert away.lost == {"q3", "q4"}
    partly, still = away.back({"q4"})
    assert partly.pipeline == "q1+q2,net.8@q4"  # q3's layers stay with stage 0
    assert partly.micro_batches == 4 and partly.stage_sync == "checkpoint"
    assert still is not None and still.lost == {"q3"} and "q4 back" in partly.why
    whole, none = still.back({"q3"})
    assert whole.pipeline == "q1+q2,net.2@q3,net.8@q4" and whole.batch_sizes == (6, 10, 0, 0) and none is None
    # a run re-planned to data-parallel goes back to the pipeline with its M and stage sync
    dp = Comeback("q1+q2,net.6@q3", (6, 10, 0), frozenset({"q3"}), micro_batches=2, stage_sync="checkpoint")
    spec = replace(_job("--boards", "q1,q2", "--batch", "6,10"), boards=("q1", "q2"), batch_sizes=(6, 10))
    back = _replanned(spec, dp.back({"q3"})[0])
    assert back.pipeline == "q1+q2,net.6@q3" and back.micro_batches == 2 and back.stage_sync == "checkpoint"
    assert back.boards == ("q1", "q2", "q3") and back.batch_sizes == (6, 10, 0)


def test_a_board_keeps_its_pipeline_port_in_every_run_of_the_job() -> None:
    """A re-planned run's board listens where it did: the port of a board the re-plan left out may still be held by
    its worker (slowed, it takes its time), which on one host (the tests) a board moved onto it would find taken."""
    spec = replace(_job("--pipeline", "q1,net.2@q2,net.8@q3", "--pipeline-port", "30000"), boards=("q1", "q2", "q3"),
                   batch_sizes=(64, 0, 0))
    assert spec.pipeline_ports() == {"q1": 30000, "q2": 30001, "q3": 30002}
    revised = replace(spec, pipeline="q1,net.2@q3", boards=("q1", "q3"), batch_sizes=(64, 0))
    assert revised.pipeline_ports() == {"q1": 30000, "q3": 30002}  # not q2's 30001
    alone = replace(revised, pipeline="", boards=("q1",), batch_sizes=(64,))
    back = replace(alone, pipeline="q1,net.2@q4", boards=("q1", "q4"), batch_sizes=(64, 0))
    assert back.pipeline_ports() == {"q1": 30000, "q4": 30003}  # a board new to the job: the next port
    assert JobSpec.from_json(json.loads(json.dumps(revised.to_json()))).pipeline_ports() == revised.pipeline_ports()
    with pytest.raises(ConfigError, match="pipeline_slots 'q1' in config.json is not a list of board ids"):
        JobSpec.from_json({**revised.to_json(), "pipeline_slots": "q1"})
