"""The report's plots of what TensorBoard and W&B users look for beside the loss: the learning rate
each step was taken with (``metrics.jsonl``'s ``lr``), and each board's CPU load and temperature over
the run (``power.jsonl``'s ``cpu_percent`` and ``temp_c``, from the boards' telemetry).
"""

from __future__ import annotations

import logging

from matplotlib.axes import Axes

from edgefleet.coordinator.report.figure_kit import Plot, figure, label, legend, line_styles, mark_rebalances, png, two_axes
from edgefleet.coordinator.report.run_data import PowerSample, RunData, StepRecord

log = logging.getLogger(__name__)

LOG_SCALE_RATIO = 20.0   # learning rates spanning more than this factor are drawn on a log scale


def lr_plot(run: RunData) -> Plot:
    """The learning rate of each param group over steps and over time."""
    title = "Learning rate"
    caption = ("The learning rate each step was taken with, per param group, as the coordinator's replica stepped its "
               "optimizer and LR schedulers (the boards step theirs alike).")
    groups = max((len(s.lr) for s in run.steps), default=0)
    if not groups:
        return Plot(key="lr", title=title, caption=caption, png=None,
                    why_not="metrics.jsonl holds no learning rates (its lines have no lr: a run from before they were "
                            "recorded, or no step was logged).")
    style = line_styles([f"group {g}" for g in range(groups)])
    fig, by_step, by_time = two_axes(title)
    rates = [lr for s in run.steps for lr in s.lr if lr > 0]
    for ax, by_t in ((by_step, False), (by_time, True)):
        for g in range(groups):
            xs, ys = _lr_series(run.steps, g, by_time=by_t)
            ax.plot(xs, ys, linewidth=1.3, drawstyle="steps-post", label=f"param group {g}" if groups > 1 else "lr",
                    **style[f"group {g}"])
        mark_rebalances(ax, run, by_time=by_t)
        if rates and max(rates) > LOG_SCALE_RATIO * min(rates):
            ax.set_yscale("log")
        ax.set_ylabel("lr")
        legend(ax)
    return Plot(key="lr", title=title, caption=caption, png=png(fig))


def _lr_series(steps: list[StepRecord], group: int, *, by_time: bool) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for s in steps:
        x = s.elapsed_s if by_time else float(s.step)
        if x is not None and group < len(s.lr):
            xs.append(x)
            ys.append(s.lr[group])
    return xs, ys


def _board_panel(ax: Axes, run: RunData, samples: dict[str, list[PowerSample]], what: str, unit: str) -> bool:
    """One figure (``cpu_percent`` or ``temp_c``) per board over time; False if no board reported it."""
    style = line_styles(run.boards)
    drawn = False
    for board in run.boards:
        points = [(s.seen_s, getattr(s, what)) for s in samples.get(board, []) if getattr(s, what) is not None]
        if points:
            ax.plot([t for t, _ in points], [v for _, v in points], linewidth=1.1, label=label(board), **style[board])
            drawn = True
    ax.set_xlabel("time since the power log began (s)")
    ax.set_ylabel(unit)
    ax.grid(True, alpha=0.3)
    if drawn:
        legend(ax)
    else:
        ax.text(0.5, 0.5, "no board reported this", ha="center", va="center", transform=ax.transAxes, color="0.4")
    return drawn


def board_load_plot(run: RunData) -> Plot:
    """Each board's CPU load and temperature over the run, from its telemetry."""
    title = "CPU and temperature per board"
    caption = ("Each board's CPU load (all cores) and its hottest temperature sensor, as its telemetry reported them "
               "while the run trained (its boards joining included). Lines differ in dash and marker as well as "
               "colour, so boards with equal values stay visible.")
    samples: dict[str, list[PowerSample]] = {}
    for s in sorted(run.power, key=lambda s: s.seen_s):
        samples.setdefault(s.board_id, []).append(s)
    if not any(s.cpu_percent is not None or s.temp_c is not None for s in run.power):
        return Plot(key="board_load", title=title, caption=caption, png=None,
                    why_not="No CPU or temperature readings were logged for this run (power.jsonl is missing, or was "
                            "written before it recorded cpu_percent and temp_c).")
    fig = figure(title, 3.6, wspace=0.22)
    cpu, temp = fig.subplots(1, 2)
    _board_panel(cpu, run, samples, "cpu_percent", "CPU (%)")
    cpu.set_ylim(-2, 102)
    cpu.set_title("CPU load", fontsize=9)
    _board_panel(temp, run, samples, "temp_c", "°C")
    temp.set_title("temperature", fontsize=9)
    return Plot(key="board_load", title=title, caption=caption, png=png(fig))


__all__ = ["board_load_plot", "lr_plot"]
