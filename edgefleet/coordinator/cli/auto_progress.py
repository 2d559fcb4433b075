"""``train --auto`` on the terminal: the plan, the pre-training and the run as they come, then predicted against measured."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

from edgefleet.coordinator.cli.plan_render import plan_table
from edgefleet.coordinator.cli.train_progress import TrainProgress
from edgefleet.coordinator.cli.verify_render import comparison_table, verify_report
from edgefleet.coordinator.planning import PlanResult, format_duration
from edgefleet.coordinator.planning.plan_summary import candidate_text, plan_notes
from edgefleet.coordinator.planning.verify import VerifyResult, disagreement_line
from edgefleet.coordinator.run.auto_train import AutoTrainObserver, AutoTrainOutcome

if TYPE_CHECKING:
    from edgefleet.coordinator.planning.plan_job import PlanRequest


class AutoProgress(TrainProgress, AutoTrainObserver):
    """The plan's table and notes, the pre-training's comparison, then the run's progress bar."""

    def planned(self, result: PlanResult, request: PlanRequest) -> None:
        self.console.print(plan_table(result, request))
        for line in plan_notes(result):
            self.note(line)

    def verified(self, result: VerifyResult) -> None:
        verify_report(self.console, result)


def print_report(console: Console, outcome: AutoTrainOutcome) -> None:
    """The plan against the run, how it was measured, and the overheads of profiling and pre-training."""
    chosen, measured = outcome.chosen, outcome.measured
    console.print(comparison_table([(candidate_text(chosen), chosen, measured)],
                                   title="the plan against the run: predicted vs measured"))
    console.print(outcome.measure_note, markup=False, soft_wrap=True)
    if measured is not None:
        console.print(disagreement_line("this run", chosen, measured), markup=False, soft_wrap=True)
    train_s = float(outcome.training.result["elapsed_s"])
    overhead = outcome.profile_s + outcome.verify_s
    console.print(f"overhead: profiling {format_duration(outcome.profile_s)}, pre-training {format_duration(outcome.verify_s)}; "
                  f"training {format_duration(train_s)}"
                  + (f" (overhead = {overhead / train_s:.0%} of the training time)" if train_s > 0 else ""),
                  markup=False, soft_wrap=True)


__all__ = ["AutoProgress", "print_report"]
