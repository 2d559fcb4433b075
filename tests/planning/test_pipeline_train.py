"""``plan --pipeline``'s plan as ``train --pipeline`` flags (``planning.pipeline_train``)."""

from __future__ import annotations

from edgefleet.coordinator.planning.pipeline_cost import evaluate_plan
from edgefleet.coordinator.planning.pipeline_model import LayerCost, PipelineBoard, PipelineProblem, StageSpec
from edgefleet.coordinator.planning.pipeline_train import train_flags
from tests.planning import MB

LAYERS = tuple(LayerCost(name=name, forward_s_per_sample=0.01, backward_s_per_sample=0.02, param_bytes=int(MB),
                         activation_bytes_per_sample=1000, held_bytes_per_sample=int(MB))
               for name in ("net.2", "net.6", "output"))  # a layer is named by the cut that ends it
BOARDS = tuple(PipelineBoard(board_id=b, speed=1.0, memory_limit_bytes=int(500 * MB), link_up_bytes_per_s=MB,
                             link_down_bytes_per_s=MB, active_power_w=5.0, idle_power_w=2.0,
                             base_memory_bytes=int(10 * MB)) for b in ("p1", "p2", "p3", "p4"))
PROBLEM = PipelineProblem(layers=LAYERS, boards=BOARDS, global_batch=16, dataset_len=160, micro_batches=(2,))


def test_a_plan_with_one_board_a_later_stage_becomes_trains_pipeline_flags() -> None:
    plan = evaluate_plan(PROBLEM, (StageSpec(0, 1, ("p1", "p2")), StageSpec(1, 2, ("p3",)), StageSpec(2, 3, ("p4",))),
                         micro_batches=2, schedule="gpipe")
    flags = train_flags(PROBLEM, plan)
    sizes = plan.stages[0].micro_batch_sizes
    assert flags.flags == ("--pipeline", "p1+p2,net.2@p3,net.6@p4", "--batch", f"{sizes[0] * 2},{sizes[1] * 2}",
                           "--micro-batches", "2", "--stage-sync", "checkpoint")
    assert sum(sizes) * 2 == 16
    assert flags.line().startswith("train it with: edge-coordinator train ... --pipeline p1+p2,net.2@p3,net.6@p4")


def test_a_later_group_becomes_cut_at_its_boards() -> None:
    grouped = evaluate_plan(PROBLEM, (StageSpec(0, 2, ("p1",)), StageSpec(2, 3, ("p3", "p4"))), micro_batches=2,
                            schedule="gpipe")
    assert grouped.feasible
    assert train_flags(PROBLEM, grouped).flags == ("--pipeline", "p1,net.6@p3+p4", "--batch", "16", "--micro-batches",
                                                   "2", "--stage-sync", "checkpoint")


def test_1f1b_cannot_be_trained_yet_and_says_why() -> None:
    one_f_one_b = evaluate_plan(PROBLEM, (StageSpec(0, 2, ("p1",)), StageSpec(2, 3, ("p3",))), micro_batches=2,
                                schedule="1f1b")
    assert train_flags(PROBLEM, one_f_one_b).flags == ()
    assert "train runs GPipe only" in train_flags(PROBLEM, one_f_one_b).why_not
