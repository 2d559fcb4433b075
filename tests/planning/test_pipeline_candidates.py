"""The plans the pipeline picks benchmark measures (bench/pipeline_candidates.py): every plan train runs today,
costed, and which of them a case measures."""

from __future__ import annotations

from edgefleet.coordinator.planning.pipeline_cost import evaluate_plan
from edgefleet.coordinator.planning.pipeline_model import LayerCost, PipelineBoard, PipelineProblem, StageSpec
from tests.planning import load_bench

MB = 1_000_000


pc = load_bench("pipeline_candidates.py", "pipeline_candidates")


def _problem() -> PipelineProblem:
    layers = tuple(LayerCost(name=f"net.{k}", forward_s_per_sample=0.01 * (k + 1), backward_s_per_sample=0.02,
                             param_bytes=(4 * MB if k == 2 else 10_000), activation_bytes_per_sample=2_000,
                             held_bytes_per_sample=10_000) for k in range(3))
    boards = tuple(PipelineBoard(board_id=name, speed=speed, memory_limit_bytes=500 * MB, link_up_bytes_per_s=2 * MB,
                                 link_down_bytes_per_s=2 * MB, active_power_w=5.0, idle_power_w=2.0,
                                 overhead_s=0.01) for name, speed in (("a", 1.0), ("b", 2.0), ("c", 1.5)))
    return PipelineProblem(layers=layers, boards=boards, global_batch=8, dataset_len=80)


def test_every_trainable_plan_is_costed_cheapest_first_later_groups_included() -> None:
    problem = _problem()
    plans = pc.trainable_plans(problem)
    grouped = [c for c in plans if any("+" in boards for _, boards in c.later)]
    assert grouped and all(c.micro_batches % 2 == 0 for c in grouped)  # a group of 2 takes whole micro-batches in turn
    assert all(len(c.boards) == len(set(c.boards)) <= 3 for c in plans)
    assert [c.predicted_step_s for c in plans] == sorted(c.predicted_step_s for c in plans)
    assert {c.stages for c in plans} == {1, 2, 3}
    assert all(c.micro_batches == 1 for c in plans if c.stages == 1)  # data-parallel has no micro-batches
    assert all(sum(c.batch_sizes) == problem.global_batch and len(c.batch_sizes) == len(c.stage0) for c in plans)
    # the figures are the cost model's own for the plan as train would be told it
    pick = plans[0]
    names = [layer.name for layer in problem.layers]
    stops = [names.index(cut) + 1 for cut, _ in pick.later]
    edges = [0, *stops, len(names)]
    groups = [pick.stage0, *(tuple(b.split("+")) for _, b in pick.later)]
    plan = evaluate_plan(problem, [StageSpec(edges[k], edges[k + 1], g) for k, g in enumerate(groups)],
                         micro_batches=pick.micro_batches, schedule="gpipe")
    assert plan.step_time_s == pick.predicted_step_s


def test_a_case_measures_the_pick_then_other_families_each_once() -> None:
    plans = pc.trainable_plans(_problem())
    runs = pc.runs_to_measure(plans)
    assert runs[0] == plans[0] and len(runs) == len(set(runs)) <= pc.MAX_RUNS
    assert runs[1].boards != runs[0].boards
    assert {c.stages for c in runs} == {1, 2, 3}
    assert pc.runs_to_measure([]) == []


def test_the_planner_s_train_flags_read_back_as_the_plan_the_bench_measures() -> None:
    """``plan --pipeline --verify``'s choice reaches the bench as train flags (``planning.pipeline_train``): read back,
    every trainable plan is the one the bench costed."""
    from edgefleet.coordinator.planning.pipeline_train import train_flags

    problem = _problem()
    names = [layer.name for layer in problem.layers]
    for cand in pc.trainable_plans(problem):
        stops = [names.index(cut) + 1 for cut, _ in cand.later]
        edges = [0, *stops, len(names)]
        groups = [cand.stage0, *(tuple(b.split("+")) for _, b in cand.later)]
        plan = evaluate_plan(problem, [StageSpec(edges[k], edges[k + 1], g) for k, g in enumerate(groups)],
                             micro_batches=cand.micro_batches, schedule="gpipe")
        back = pc.candidate_of_flags(list(train_flags(problem, plan).flags), plan.step_time_s)
        assert pc.same_plan(back, cand) and back.batch_sizes == cand.batch_sizes and back.label == cand.label
    first = pc.trainable_plans(problem)[0]
    assert pc.same_plan(first, pc.Candidate(stage0=tuple(reversed(first.stage0)), later=first.later,
                                            micro_batches=first.micro_batches, batch_sizes=first.batch_sizes,
                                            predicted_step_s=0.0))
