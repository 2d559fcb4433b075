"""What every plot of a report shares: the :class:`Plot` record, figures with fixed margins, PNG output,
and one look per board (or per run, on a comparison page).

A board keeps its colour, dash pattern and marker across the plots. The dash pattern and marker
matter where boards report equal values (three estimated power readings at 10 W, two boards at 100%
CPU): lines drawn on top of each other in colour alone would show only the last board's.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from edgefleet.coordinator.report.run_data import RunData, StepRecord

log = logging.getLogger(__name__)

DPI = 100
WIDTH_IN = 11.0
MAX_LEGEND = 12          # more boards than this: no legend (the tables name them)
PALETTE = tuple(f"C{i}" for i in range(10))
DASHES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
MARK_SPACING = 0.08      # between a line's markers, as a fraction of the axes' diagonal (matplotlib's float markevery)


@dataclass(frozen=True, slots=True, kw_only=True)
class Plot:
    """One figure of the page."""

    key: str                 # the image's id on the page: plot-<key>
    title: str
    caption: str             # what it shows, under the image
    png: bytes | None        # None: nothing to draw
    why_not: str = ""        # when png is None: what is missing


def label(text: str) -> str:
    """``text`` as matplotlib shows it literally: a ``$`` would start mathematics (and can fail to parse)."""
    return text.replace("\\", "\\\\").replace("$", r"\$")


def png(fig: Figure) -> bytes:
    """The figure as PNG bytes."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def colours(names: Sequence[str]) -> dict[str, str]:
    """One colour per name, in order (the palette repeats after ten: :func:`line_styles` tells those apart)."""
    return {b: PALETTE[i % len(PALETTE)] for i, b in enumerate(names)}


def line_styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per name (boards, or runs, in the order of the page's tables), ``Axes.plot`` keywords: its colour, a dash
    pattern and a marker of its own. Markers are spaced along the drawn line, each name's shifted from the
    others', so that lines on top of each other still show every name's markers."""
    shifts = len(DASHES)
    return {name: {"color": PALETTE[i % len(PALETTE)], "linestyle": DASHES[i % len(DASHES)],
                   "marker": MARKERS[i % len(MARKERS)], "markersize": 4,
                   "markevery": ((i % shifts) * MARK_SPACING / shifts, MARK_SPACING)}
            for i, name in enumerate(names)}


def legend(ax: Axes) -> None:
    """A legend, unless there is nothing to name or too much."""
    handles, _ = ax.get_legend_handles_labels()
    if handles and len(handles) <= MAX_LEGEND:
        ax.legend(fontsize=8, loc="best")


def mark_rebalances(ax: Axes, run: RunData, *, by_time: bool) -> None:
    """Dotted vertical lines where each re-balance's new sizes took effect."""
    elapsed = {s.step: s.elapsed_s for s in run.steps}
    for i, event in enumerate(run.rebalances):
        x = elapsed.get(event.from_step, event.elapsed_s) if by_time else event.from_step
        if x is not None:
            ax.axvline(x, color="0.35", linestyle=":", linewidth=1.4, label="re-balance" if i == 0 else None)


def figure(title: str, height_in: float, *, bottom: float = 0.14, wspace: float = 0.2) -> Figure:
    """A figure with fixed margins: a layout engine (constrained, tight) would double the drawing time."""
    fig = Figure(figsize=(WIDTH_IN, height_in))
    fig.subplots_adjust(left=0.065, right=0.985, top=1 - 0.55 / height_in, bottom=bottom, wspace=wspace)
    fig.suptitle(title)
    return fig


def two_axes(title: str, *, right_xlabel: str = "time since the first step (s)") -> tuple[Figure, Axes, Axes]:
    """A figure of two panels: over steps (left) and over time (right)."""
    fig = figure(title, 3.6)
    by_step, by_time = fig.subplots(1, 2)
    by_step.set_xlabel("step")
    by_time.set_xlabel(right_xlabel)
    for ax in (by_step, by_time):
        ax.grid(True, alpha=0.3)
    return fig, by_step, by_time


def series(steps: Sequence[StepRecord], value: Callable[[StepRecord], float | None], *,
           by_time: bool) -> tuple[list[float], list[float]]:
    """(x, y) of ``value`` over the steps that have it: x is the step, or its time with ``by_time``."""
    xs, ys = [], []
    for s in steps:
        y, x = value(s), (s.elapsed_s if by_time else float(s.step))
        if y is not None and x is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


__all__ = ["DPI", "MAX_LEGEND", "WIDTH_IN", "Plot", "colours", "figure", "label", "legend", "line_styles",
           "mark_rebalances", "png", "series", "two_axes"]
