"""The report's PNG plots, drawn with matplotlib's Agg renderer (no display, no pyplot state).

Each plot is a :class:`Plot`: its PNG, or the reason there is nothing to draw (the page shows
that sentence instead). Every board keeps its colour, dash pattern and marker across the plots
(:mod:`.figure_kit`), and re-balances are drawn as dotted vertical lines where the new batch sizes take effect.
"""

from __future__ import annotations

import itertools
import logging
import statistics
from collections.abc import Callable

from edgefleet.coordinator.report.board_plots import board_load_plot, lr_plot
from edgefleet.coordinator.report.figure_kit import (
    Plot,
    colours,
    figure,
    label,
    legend,
    line_styles,
    mark_rebalances,
    png,
    series,
    two_axes,
)
from edgefleet.coordinator.report.power_stats import board_energy
from edgefleet.coordinator.report.run_data import RunData, StepRecord, number

log = logging.getLogger(__name__)

PLAN_KEYS = (("step_time_s", "step time (s)"), ("samples_per_s", "samples/s"), ("epoch_time_s", "epoch time (s)"),
             ("power_w", "power (W)"), ("energy_per_epoch_j", "energy per epoch (J)"), ("edp_j_s", "EDP (J·s)"))


def _list(value: object) -> list[object]:
    return value if isinstance(value, list) else []


def _val(key: str) -> Callable[[StepRecord], float | None]:
    return lambda s: s.val_metrics.get(key)


def _compute(board: str) -> Callable[[StepRecord], float | None]:
    return lambda s: s.compute_s.get(board)


def _batch(board: str) -> Callable[[StepRecord], float | None]:
    return lambda s: number(s.batch_sizes.get(board))


def loss_plot(run: RunData) -> Plot:
    """The fleet's training loss (and any validation loss) over steps and over time."""
    title, caption = "Loss", "The fleet's sample-weighted training loss at every step; validation losses at each epoch's end."
    if not any(s.loss is not None for s in run.steps):
        return Plot(key="loss", title=title, caption=caption, png=None, why_not="No step logged a loss (metrics.jsonl).")
    val_keys = sorted({k for s in run.steps for k in s.val_metrics if "loss" in k})
    fig, by_step, by_time = two_axes(title)
    for ax, by_t in ((by_step, False), (by_time, True)):
        ax.plot(*series(run.steps, lambda s: s.loss, by_time=by_t), color="C0", linewidth=1.2, label="training loss")
        for i, key in enumerate(val_keys):
            ax.plot(*series(run.steps, _val(key), by_time=by_t), marker="o", linestyle="--",
                    color=f"C{(i + 1) % 10}", label=label(key))
        mark_rebalances(ax, run, by_time=by_t)
        ax.set_ylabel("loss")
        if all(y > 0 for y in series(run.steps, lambda s: s.loss, by_time=False)[1]):
            ax.set_yscale("log")
        legend(ax)
    return Plot(key="loss", title=title, caption=caption, png=png(fig))


def validation_plot(run: RunData) -> Plot:
    """Every validation metric over steps and over time."""
    title, caption = "Validation metrics", "What the model's validation_step logged, at each epoch's end."
    keys = sorted({k for s in run.steps for k in s.val_metrics})
    if not keys:
        return Plot(key="validation", title=title, caption=caption, png=None,
                    why_not="No validation metrics were logged: no epoch ended, or the model has no validation_step.")
    fig, by_step, by_time = two_axes(title)
    for ax, by_t in ((by_step, False), (by_time, True)):
        for i, key in enumerate(keys):
            ax.plot(*series(run.steps, _val(key), by_time=by_t), marker="o",
                    color=f"C{i % 10}", label=label(key))
        mark_rebalances(ax, run, by_time=by_t)
        legend(ax)
    return Plot(key="validation", title=title, caption=caption, png=png(fig))


def step_time_plot(run: RunData) -> Plot:
    """Each board's compute time per step, the fleet's step interval, and the steps a board missed."""
    title = "Step time per board"
    caption = ("Each board's compute time per step; the grey line is the fleet's time from one step to the next; "
               "a red cross marks a step a board was late for or refused.")
    boards = run.boards
    if not any(s.compute_s for s in run.steps):
        return Plot(key="step_time", title=title, caption=caption, png=None, why_not="No step logged compute times.")
    style = line_styles(boards)
    fig = figure(title, 3.8)
    ax = fig.subplots()
    for board in boards:
        xs, ys = series(run.steps, _compute(board), by_time=False)
        if xs:
            ax.plot(xs, [y * 1000 for y in ys], linewidth=1.1, label=label(board), **style[board])
    timed = [(s.step, s.elapsed_s) for s in run.steps if s.elapsed_s is not None]
    gaps = [(b_step, (b_s - a_s) * 1000) for (a_step, a_s), (b_step, b_s) in itertools.pairwise(timed) if b_step == a_step + 1]
    if gaps:
        ax.plot([g[0] for g in gaps], [g[1] for g in gaps], color="0.55", linewidth=0.9, label="fleet step interval")
    missed = [s.step for s in run.steps if s.late or s.refused]
    if missed:
        top = max((max(s.compute_s.values(), default=0.0) for s in run.steps), default=0.0) * 1000
        ax.plot(missed, [top] * len(missed), "x", color="red", label="a board late or refused")
    mark_rebalances(ax, run, by_time=False)
    if gaps:
        ax.set_ylim(0, 1.15 * sorted(g[1] for g in gaps)[int(0.98 * (len(gaps) - 1))] + 1)  # a validation step's gap stays off-scale
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.grid(True, alpha=0.3)
    legend(ax)
    return Plot(key="step_time", title=title, caption=caption, png=png(fig))


def batch_plot(run: RunData) -> Plot:
    """Each board's batch size over steps (a re-balance changes them)."""
    title, caption = "Batch size per board", "The samples each board took per step."
    if not any(s.batch_sizes for s in run.steps):
        return Plot(key="batch", title=title, caption=caption, png=None, why_not="No step logged batch sizes.")
    style = line_styles(run.boards)
    fig = figure(title, 3.2, bottom=0.16)
    ax = fig.subplots()
    for board in run.boards:
        xs, ys = series(run.steps, _batch(board), by_time=False)
        if xs:
            ax.step(xs, ys, where="post", linewidth=1.6, label=label(board), **style[board])
    mark_rebalances(ax, run, by_time=False)
    ax.set_xlabel("step")
    ax.set_ylabel("samples per step")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    legend(ax)
    return Plot(key="batch", title=title, caption=caption, png=png(fig))


def power_plot(run: RunData) -> Plot:
    """Each board's power over time, and the energy it drew."""
    title = "Power and energy per board"
    caption = ("Each board's power as its telemetry reported it, from when the run began (its boards joining "
               "included); the bars are the energy each drew over that time. Hatched bars are estimates, not measurements.")
    energy = board_energy(run.power)
    if not energy:
        return Plot(key="power", title=title, caption=caption, png=None,
                    why_not="No power readings were logged for this run (no power.jsonl with power figures).")
    boards = [b for b in run.boards if b in energy]
    colour = colours(run.boards)
    style = line_styles(run.boards)
    fig = figure(title, 3.8, bottom=0.2)
    over_time, bars = fig.subplots(1, 2, width_ratios=(2, 1))
    for board in boards:
        seen = sorted((s.seen_s, s.power_w) for s in run.power if s.board_id == board and s.power_w is not None)
        over_time.plot([t for t, _ in seen], [w for _, w in seen], label=label(board), **style[board])
    over_time.set_xlabel("time since the power log began (s)")
    over_time.set_ylabel("W")
    over_time.set_ylim(0, 1.08 * max((s.power_w or 0.0 for s in run.power), default=1.0) + 0.01)  # a line at the top shows
    over_time.grid(True, alpha=0.3)
    legend(over_time)
    drawn = bars.bar(range(len(boards)), [energy[b].energy_j for b in boards], color=[colour[b] for b in boards])
    for bar, board in zip(drawn, boards):
        if not energy[board].measured:
            bar.set_hatch("//")
    bars.set_xticks(range(len(boards)), [label(b) for b in boards], rotation=30, ha="right", fontsize=8)
    bars.set_ylabel("energy (J)")
    bars.grid(True, axis="y", alpha=0.3)
    return Plot(key="power", title=title, caption=caption, png=png(fig))


def measured_compute_s(run: RunData) -> dict[str, float]:
    """Each board's median compute time per step over the run."""
    times: dict[str, list[float]] = {}
    for s in run.steps:
        for board, t in s.compute_s.items():
            times.setdefault(board, []).append(t)
    return {b: statistics.median(t) for b, t in times.items()}


def plan_plot(run: RunData) -> Plot:
    """The plan's prediction next to what the run measured, figure by figure and board by board."""
    title = "Plan against measurement"
    caption = ("Each figure as the planner predicted it (grey) and as the run measured it (green); the last panel is each "
               "board's compute time per step (measured: its median over the run).")
    plan = run.plan
    predicted = plan.get("predicted") if plan else None
    if not isinstance(predicted, dict):
        return Plot(key="plan", title=title, caption=caption, png=None,
                    why_not="This run was not planned (no plan.json; `train --auto` writes one), so there is no "
                            "prediction to compare with.")
    measured = plan.get("measured") if plan else None
    measured = measured if isinstance(measured, dict) else {}
    keys = [(k, name) for k, name in PLAN_KEYS if number(predicted.get(k)) is not None]
    fig = figure(title, 3.6, bottom=0.2, wspace=0.55)
    axes = fig.subplots(1, len(keys) + 1, width_ratios=[1] * len(keys) + [1.6], squeeze=False)[0]
    for ax, (key, name) in zip(axes, keys):
        values = [number(predicted.get(key)), number(measured.get(key))]
        ax.bar([0, 1], [v or 0.0 for v in values], color=["C7", "C2"])
        ax.set_xticks([0, 1], ["pred.", "meas." if values[1] is not None else "none"], fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    ax = axes[-1]
    boards = [str(b) for b in _list(predicted.get("boards"))]
    pred = [number(v) for v in _list(predicted.get("compute_s"))]
    real = measured_compute_s(run)
    for i, board in enumerate(boards):
        predicted_s = pred[i] if i < len(pred) else None
        ax.bar(i - 0.2, (predicted_s or 0.0) * 1000, 0.4, color="C7",
               label="predicted" if i == 0 else None)
        ax.bar(i + 0.2, real.get(board, 0.0) * 1000, 0.4, color="C2", label="measured" if i == 0 else None)
    ax.set_xticks(range(len(boards)), [label(b) for b in boards], rotation=30, ha="right", fontsize=7)
    ax.set_title("compute per step (ms)", fontsize=9)
    ax.margins(y=0.35)  # room for the legend above the bars
    ax.set_ylim(bottom=0)
    ax.tick_params(axis="y", labelsize=7)
    legend(ax)
    return Plot(key="plan", title=title, caption=caption, png=png(fig))


PLOTS: tuple[Callable[[RunData], Plot], ...] = (loss_plot, validation_plot, lr_plot, step_time_plot, batch_plot, power_plot,
                                                board_load_plot, plan_plot)


def draw_plots(run: RunData) -> list[Plot]:
    """Every plot of the report, in page order; one that fails to draw says why instead of stopping the page."""
    plots = []
    for draw in PLOTS:
        try:
            plots.append(draw(run))
        except Exception as exc:  # odd values in a hand-edited run: the rest of the page is still worth having
            log.warning("%s: %s failed: %s", run.run_dir, draw.__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
            key = draw.__name__.removesuffix("_plot")
            plots.append(Plot(key=key, title=key.replace("_", " ").capitalize(), caption="", png=None,
                              why_not=f"This plot could not be drawn from the run's values ({type(exc).__name__}: {exc})."))
    return plots


__all__ = ["PLAN_KEYS", "PLOTS", "Plot", "draw_plots", "label", "measured_compute_s"]
