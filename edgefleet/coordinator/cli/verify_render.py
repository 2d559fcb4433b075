"""Predicted against measured on the terminal: the pre-training's table and choice, and a run's comparison.

Labels (which name boards) go into cells as plain :class:`Text`, and lines are printed with markup off.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from edgefleet.coordinator.planning import Estimate, format_duration
from edgefleet.coordinator.planning.plan_summary import candidate_text, fmt_power, fmt_step
from edgefleet.coordinator.planning.verify import DISAGREEMENT, FIGURES, Measurement, VerifyResult, differences, disagreement_line


def comparison_table(rows: Sequence[tuple[str, Estimate, Measurement | None]], *, title: str,
                     tolerance: float = DISAGREEMENT) -> Table:
    """Predicted against measured, one block of figures per configuration; differences over ``tolerance`` marked."""
    table = Table(title=Text(title, style="table.title"), title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("configuration", "figure", "predicted", "measured", "difference"):
        table.add_column(name, justify="left" if name in ("configuration", "figure") else "right")
    fmt = {label: f for label, _, f in FIGURES}
    for n, (label, estimate, measured) in enumerate(rows):
        if n:
            table.add_section()
        figures = differences(estimate, measured) if measured is not None else [
            (name, float(getattr(estimate, attr)), None, None) for name, attr, _ in FIGURES]
        for i, (figure, predicted, actual, rel) in enumerate(figures):
            off = rel is not None and abs(rel) > tolerance
            table.add_row(Text(label if i == 0 else ""), figure, fmt[figure](predicted),
                          "-" if actual is None else fmt[figure](actual) + (
                              "*" if figure == "power" and measured is not None and not measured.power_measured else ""),
                          "-" if rel is None else f"{rel:+.0%}" + (" !" if off else ""),
                          style="yellow" if off else None)
    table.caption = Text(f"! measured differs from the estimate by more than {tolerance:.0%}; "
                         "* power estimated by the agents from CPU load, not measured", style="table.caption")
    table.caption_justify = "left"
    return table


def verify_report(console: Console, result: VerifyResult) -> None:
    """The pre-training's table, its disagreements and its choice, printed on ``console``."""
    rows = [(f"{'▶ ' if t is result.chosen else ''}#{i} {candidate_text(t.estimate)}", t.estimate, t.measured)
            for i, t in enumerate(result.trials, 1)]
    console.print(comparison_table(rows, title=f"pre-training: predicted vs measured "
                                               f"({format_duration(result.elapsed_s)} of pre-training)"))
    for i, t in enumerate(result.trials, 1):
        if t.measured is None:
            console.print(f"#{i}: not measured: {t.error}", markup=False, soft_wrap=True)
            continue
        console.print(disagreement_line(f"#{i}", t.estimate, t.measured), markup=False, soft_wrap=True)
    rank = result.trials.index(result.chosen) + 1
    m = result.chosen.measured
    assert m is not None
    console.print(f"chosen on measurement: #{rank} {candidate_text(result.chosen.estimate)} "
                  f"({result.chosen.estimate.variant_label}): {fmt_step(m.step_time_s)} per step, "
                  f"{format_duration(m.epoch_time_s)} per epoch"
                  + ("" if m.power_w is None else f", {fmt_power(m.power_w, not m.power_measured)}")
                  + ("; the estimates ranked it first too" if result.agrees
                     else f"; the estimates ranked #1 {candidate_text(result.trials[0].estimate)}"), markup=False, soft_wrap=True)


__all__ = ["comparison_table", "verify_report"]
