"""Plans in words and JSON: one-line summaries of a configuration, the ruled-out lines, ``estimate_json``.

Plain strings and dicts (no terminal library), for the services' notes and ``plan.json`` as
much as for the command line's output.
"""

from __future__ import annotations

from typing import Any

from edgefleet.coordinator.planning import LOCAL_SGD_EVERY, Estimate, PlanResult, format_duration
from edgefleet.coordinator.planning.modes import EXACT
from edgefleet.coordinator.planning.objectives import OBJECTIVE_TEXT

# Below this share of the chosen step spent outside compute, an inexact mode cannot gain the margin
# it must (search module doc): no hint about --allow-inexact.
HINT_EXCHANGE_SHARE = 0.15


def fmt_step(seconds: float) -> str:
    """A step time: ``"45.0 ms"``, or a duration from 10 s on."""
    return f"{seconds * 1000:.1f} ms" if seconds < 10 else format_duration(seconds)


def fmt_si(value: float, unit: str) -> str:
    """``1234.5, "J"`` -> ``"1.23 kJ"``; three significant figures."""
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def fmt_power(watts: float, estimated: bool) -> str:
    """``"12.3 W"``, starred when some board's power is estimated rather than measured."""
    return f"{watts:.1f} W" + ("*" if estimated else "")


def batches_text(estimate: Estimate) -> str:
    """``"pi-1:16 pi-2:48"``: each taking-part board and its batch size."""
    c = estimate.candidate
    return " ".join(f"{b}:{n}" for b, n in zip(c.boards, c.batch_sizes))


def candidate_text(estimate: Estimate) -> str:
    """``"pi-1:16 pi-2:48"``, followed by the mode unless it is data-parallel exact (``… local-sgd-4``, ``… placed-net.6``)."""
    mode = estimate.mode
    return batches_text(estimate) + ("" if mode == EXACT else f" {mode.name}")


def summary_of(estimate: Estimate, what: str) -> str:
    """One line: ``chosen: pi-1:16 pi-2:48 (global batch 64, default): 12.3 s per epoch, …``.

    An inexact mode is named after the variant (``default, local-sgd-4``).
    """
    c = estimate.candidate
    mode = "" if c.mode == EXACT else f", {c.mode.name}"
    return (f"{what}: {batches_text(estimate)} (global batch {c.global_batch}, {estimate.variant_label}{mode}): "
            f"{fmt_step(estimate.step_time_s)} per step, {estimate.samples_per_s:.0f} samples/s, "
            f"{format_duration(estimate.epoch_time_s)} per epoch, {fmt_power(estimate.power_w, estimate.power_estimated)}, "
            f"{fmt_si(estimate.energy_per_epoch_j, 'J')} per epoch")


def ruled_out_lines(result: PlanResult) -> list[str]:
    """One line per group of candidates a constraint ruled out, with an example."""
    lines = []
    for x in result.ruled_out:
        where = f" on board {x.board_id}" if x.board_id else ""
        lines.append(f"ruled out by {x.constraint}{where}: {x.count} candidate{'s' if x.count != 1 else ''}, "
                     f"e.g. {x.example}")
    return lines


def plan_notes(result: PlanResult) -> list[str]:
    """The lines under the table: what each constraint ruled out, why a near tie went to fewer boards,
    and the training mode: the chosen one when it changes the mathematics, else why none was."""
    fewer = fewer_boards_line(result)
    return [*ruled_out_lines(result), *([fewer] if fewer else []), *placement_lines(result), *mode_lines(result)]


def placement_lines(result: PlanResult) -> list[str]:
    """What the plan says about layer placement when it weighed some cut (``planning.modes.placed``): the
    chosen cut and the bytes a board moves per step against data-parallel's, or why data-parallel won."""
    placed = [m for m in result.modes if m.placement]
    if not placed:
        return []
    chosen, objective = result.chosen, result.objective
    other = result.best_other_placement
    if chosen.mode.placement:
        b = max(chosen.candidate.batch_sizes)
        tail = chosen.mode.tail_board
        through = (f", and {tail}'s link carries the whole batch's, "
                   f"{fmt_si(chosen.mode.per_sample_bytes * sum(chosen.candidate.batch_sizes), 'B')} each way"
                   if tail else "")
        lines = [f"mode: {chosen.mode.description} (train {' '.join(chosen.mode.train_flags)}; the same mathematics): "
                 f"{chosen.mode.why}; the largest slice ({b} samples) adds "
                 f"{fmt_si(chosen.mode.per_sample_bytes * b, 'B')} each way per step{through}"]
        if other is not None:
            gain = 1.0 - chosen.objective_value(objective) / other.objective_value(objective)
            lines.append(f"it is {gain:.0%} better by estimate ({OBJECTIVE_TEXT[objective]}) than the best data-parallel "
                         f"configuration, {batches_text(other)}: {format_duration(other.epoch_time_s)} per epoch")
        return lines
    weighed = (f"{len({m.placement for m in placed})} cut(s) with the tail on "
               f"{len({m.tail_board or 'coordinator' for m in placed})} host(s)")
    if other is None:
        return [f"layer placement weighed at {weighed}: none is feasible"]
    loss = other.objective_value(objective) / chosen.objective_value(objective) - 1.0
    return [f"layer placement weighed at {weighed}: the best, {other.mode.description} with "
            f"{batches_text(other)}, is {loss:.0%} worse by estimate ({OBJECTIVE_TEXT[objective]}): "
            "data-parallel chosen"]


def fewer_boards_line(result: PlanResult) -> str:
    """Why the chosen candidate is not the best estimate (a near tie went to fewer boards, or to
    a mode closer to exact), or ""."""
    best = result.passed_over
    if best is None:
        return ""
    chosen, objective = result.chosen, result.objective
    gain = 1.0 - best.objective_value(objective) / chosen.objective_value(objective)
    within = f"within --fewer-boards-within {result.fewer_boards_within * 100:g}%"
    if len(best.candidate.boards) <= len(chosen.candidate.boards):  # the same boards' count: a mode closer to exact
        return (f"closer to exact chosen: {batches_text(best)} in {best.mode.description} is {gain:.1%} better by "
                f"estimate ({OBJECTIVE_TEXT[objective]}); {within} the mode that strays least from exact is chosen, "
                f"{chosen.mode.description}")
    return (f"fewer boards chosen: {batches_text(best)} is {gain:.1%} better by estimate "
            f"({OBJECTIVE_TEXT[objective]}) but takes {len(best.candidate.boards)} boards; {within} the "
            f"{len(chosen.candidate.boards)}-board configuration is chosen, with fewer links and stragglers to wait "
            f"for (0 takes the best estimate)")


def mode_lines(result: PlanResult) -> list[str]:
    """What the plan says about training modes (``planning.modes``).

    An inexact mode chosen: what it is, the flag that runs it, what it gains over exact, and that
    the figures are per epoch in its steady state. Inexact modes considered but not chosen: the
    best one's gain, under the margin. Not considered: a hint about ``--allow-inexact`` when the
    chosen step spends :data:`HINT_EXCHANGE_SHARE` or more outside compute (else nothing: the
    output is as it always was).
    """
    chosen, objective = result.chosen, result.objective
    what = OBJECTIVE_TEXT[objective]
    if not result.inexact_allowed:
        share = chosen.exchange_s / chosen.step_time_s if chosen.step_time_s > 0 else 0.0
        if share < HINT_EXCHANGE_SHARE:
            return []
        return [f"the exchange takes {share:.0%} of the chosen step: --allow-inexact lets the planner consider local "
                f"SGD, which moves the full-size vector only every {_every()} steps (it changes the mathematics)"]
    if chosen.mode.exact:
        declined = result.declined_inexact
        if declined is None:
            return ["inexact modes considered (--allow-inexact): none is better than the exact mode by estimate"]
        gain = 1.0 - declined.objective_value(objective) / chosen.objective_value(objective)
        return [f"inexact modes considered (--allow-inexact): the best, {batches_text(declined)} in "
                f"{declined.mode.description}, is {gain:.1%} better by estimate ({what}), under the "
                f"{result.inexact_margin:.0%} an inexact mode must gain: the exact mode is chosen"]
    lines = [f"mode: {chosen.mode.headline} (train {' '.join(chosen.mode.train_flags)})"]
    exact = result.best_exact
    if exact is not None:
        gain = 1.0 - chosen.objective_value(objective) / exact.objective_value(objective)
        lines.append(f"it is {gain:.0%} better by estimate ({what}) than the best exact configuration, "
                     f"{batches_text(exact)} (global batch {exact.candidate.global_batch}, {exact.variant_label}): "
                     f"{format_duration(exact.epoch_time_s)} per epoch")
    lines.append("note: the figures are per epoch in the mode's steady state; its warm-up of exact steps (by default "
                 "the first epoch) runs at the exact mode's speed, and an inexact mode may need more epochs to reach "
                 "the same accuracy")
    return lines


def _every() -> str:
    """``"2, 4 or 8"``."""
    *head, last = map(str, LOCAL_SGD_EVERY)
    return f"{', '.join(head)} or {last}" if head else last


def estimate_json(e: Estimate) -> dict[str, Any]:
    """An estimate as ``plan --json`` and ``plan.json`` hold it."""
    c = e.candidate
    return {"boards": list(c.boards), "batch_sizes": list(c.batch_sizes), "global_batch": c.global_batch,
            "variant": dict(c.variant), "variant_label": e.variant_label, "compute_s": list(e.compute_s),
            "exchange_s": e.exchange_s, "step_time_s": e.step_time_s, "samples_per_s": e.samples_per_s,
            "epoch_time_s": e.epoch_time_s, "power_w": e.power_w, "energy_per_epoch_j": e.energy_per_epoch_j,
            "edp_j_s": e.edp_j_s, "peak_memory_bytes": list(e.peak_memory_bytes),
            "memory_headroom": list(e.memory_headroom), "power_estimated": e.power_estimated,
            "mode": {**e.mode.to_json(), "headline": e.mode.headline}}


__all__ = ["HINT_EXCHANGE_SHARE", "batches_text", "candidate_text", "estimate_json", "fewer_boards_line", "fmt_power", "fmt_si", "fmt_step",
           "mode_lines", "placement_lines", "plan_notes", "ruled_out_lines", "summary_of"]
