"""How a plan is shown on the terminal: the candidates table, the chosen row marked.

Board ids and variant labels go into cells as plain :class:`Text`, never markup.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.table import Table
from rich.text import Text

from edgefleet.coordinator.planning import PlanResult, format_duration
from edgefleet.coordinator.planning.objectives import OBJECTIVE_TEXT
from edgefleet.coordinator.planning.plan_summary import batches_text, fmt_power, fmt_si, fmt_step

if TYPE_CHECKING:
    from edgefleet.coordinator.planning.plan_job import PlanRequest

CHOSEN_MARK = "▶"


def _constraints(request: PlanRequest) -> str:
    parts = []
    if request.max_power_w is not None:
        parts.append(f"power <= {request.max_power_w:g} W")
    if request.deadline_s is not None:
        parts.append(f"epoch <= {format_duration(request.deadline_s)}")
    parts.append(f"memory <= {request.max_memory_fraction:.0%}")
    if request.count_idle:
        parts.append("idle boards counted")
    if request.allow_inexact:
        parts.append("inexact modes allowed")
    return ", ".join(parts)


def plan_table(result: PlanResult, request: PlanRequest) -> Table:
    """The chosen candidate first (marked), then the best others by estimate."""
    title = (f"plan: minimise {OBJECTIVE_TEXT[result.objective]} subject to {_constraints(request)} - "
             f"{result.evaluated} candidates, {result.feasible} feasible ({result.method})")
    table = Table(title=Text(title, style="table.title"), title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    variants = len({e.variant_label for e in result.ranked}) > 1
    modes = len(result.modes) > 1  # --allow-inexact, or layer placement weighed: every row says its training mode
    columns = ["", "#", "boards (batch each)", "batch", *(["variant"] if variants else []), *(["mode"] if modes else []),
               "step", "samples/s",
               "epoch", "power", "energy/epoch", "EDP", "headroom"]
    for name in columns:
        table.add_column(name, justify="left" if name in ("", "boards (batch each)", "variant", "mode") else "right")
    for rank, e in enumerate(result.ranked, 1):
        chosen = e is result.chosen or e == result.chosen
        table.add_row(CHOSEN_MARK if chosen else "", str(rank), Text(batches_text(e)), str(e.candidate.global_batch),
                      *([Text(e.variant_label)] if variants else []), *([e.mode.name] if modes else []),
                      fmt_step(e.step_time_s), f"{e.samples_per_s:.0f}",
                      format_duration(e.epoch_time_s), fmt_power(e.power_w, e.power_estimated),
                      fmt_si(e.energy_per_epoch_j, "J"), fmt_si(e.edp_j_s, "J·s"), f"{e.min_memory_headroom:.0%}",
                      style="bold green" if chosen else None)
    captions = [f"the chosen row is marked {CHOSEN_MARK}; headroom = the least memory left on any taking-part board at its peak"]
    if result.inexact_allowed:
        captions.append("local-sgd-H: local SGD averaging every H steps (train --sync-every H), which changes the "
                        "mathematics; its figures are its steady state per epoch (the exact warm-up is not in them)")
    if any(m.placement for m in result.modes):
        captions.append("placed-CUT: layer placement (train --placement CUT): the boards train the layers up to CUT, the "
                        "coordinator the rest over the whole global batch; the same mathematics as exact")
    if any(e.power_estimated for e in result.ranked):
        captions.append("* power estimated from CPU load on some boards (no sensor), not measured")
    table.caption = Text("\n".join(captions), style="table.caption")
    table.caption_justify = "left"
    return table


__all__ = ["CHOSEN_MARK", "plan_table"]
