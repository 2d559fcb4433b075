"""Plans in words and JSON: one-line summaries of a configuration, the ruled-out lines, ``estimate_json``.

Plain strings and dicts (no terminal library), for the services' notes and ``plan.json`` as
much as for the command line's output.
"""

from __future__ import annotations

from typing import Any

from edgefleet.coordinator.objectives import OBJECTIVE_TEXT
from edgefleet.coordinator.planning import Estimate, PlanResult, format_duration


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


def summary_of(estimate: Estimate, what: str) -> str:
    """One line: ``chosen: pi-1:16 pi-2:48 (global batch 64, default): 12.3 s per epoch, …``."""
    c = estimate.candidate
    return (f"{what}: {batches_text(estimate)} (global batch {c.global_batch}, {estimate.variant_label}): "
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
    """The lines under the table: what each constraint ruled out, and why a near tie went to fewer boards."""
    fewer = fewer_boards_line(result)
    return [*ruled_out_lines(result), *([fewer] if fewer else [])]


def fewer_boards_line(result: PlanResult) -> str:
    """Why the chosen candidate is not the best estimate (a near tie went to fewer boards), or ""."""
    best = result.passed_over
    if best is None:
        return ""
    chosen, objective = result.chosen, result.objective
    gain = 1.0 - best.objective_value(objective) / chosen.objective_value(objective)
    return (f"fewer boards chosen: {batches_text(best)} is {gain:.1%} better by estimate "
            f"({OBJECTIVE_TEXT[objective]}) but takes {len(best.candidate.boards)} boards; within "
            f"--fewer-boards-within {result.fewer_boards_within * 100:g}% the {len(chosen.candidate.boards)}-board "
            f"configuration is chosen, with fewer links and stragglers to wait for (0 takes the best estimate)")


def estimate_json(e: Estimate) -> dict[str, Any]:
    """An estimate as ``plan --json`` and ``plan.json`` hold it."""
    c = e.candidate
    return {"boards": list(c.boards), "batch_sizes": list(c.batch_sizes), "global_batch": c.global_batch,
            "variant": dict(c.variant), "variant_label": e.variant_label, "compute_s": list(e.compute_s),
            "exchange_s": e.exchange_s, "step_time_s": e.step_time_s, "samples_per_s": e.samples_per_s,
            "epoch_time_s": e.epoch_time_s, "power_w": e.power_w, "energy_per_epoch_j": e.energy_per_epoch_j,
            "edp_j_s": e.edp_j_s, "peak_memory_bytes": list(e.peak_memory_bytes),
            "memory_headroom": list(e.memory_headroom), "power_estimated": e.power_estimated}


__all__ = ["batches_text", "estimate_json", "fewer_boards_line", "fmt_power", "fmt_si", "fmt_step", "plan_notes",
           "ruled_out_lines", "summary_of"]
