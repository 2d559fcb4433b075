"""The time/energy Pareto front of the candidates, and a PNG of it for `edge-coordinator plan`.

matplotlib is needed only for the PNG and is imported when one is drawn (the ``coordinator``
extra). The figure is built with the object-oriented API on the Agg canvas, so drawing one
never changes the process's global matplotlib backend.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from edgefleet.coordinator.planning.cost_model import Estimate

log = logging.getLogger(__name__)

MATPLOTLIB_HINT = "drawing the Pareto front needs matplotlib: pip install matplotlib (or pip install 'edgefleet[coordinator]')"


def pareto_front(estimates: Iterable[Estimate]) -> list[Estimate]:
    """The estimates no other one beats on both time per epoch and energy per epoch, fastest first.

    Of several with equal time and energy the first given is kept.
    """
    ordered = sorted(estimates, key=lambda e: (e.epoch_time_s, e.energy_per_epoch_j))
    front: list[Estimate] = []
    least = math.inf
    for e in ordered:
        if e.energy_per_epoch_j < least:
            front.append(e)
            least = e.energy_per_epoch_j
    return front


def write_pareto_png(path: Path, estimates: Sequence[Estimate], chosen: Estimate | None = None, *,
                     title: str = "Time and energy per epoch of the candidate configurations") -> Path:
    """Draw every estimate, the Pareto front through them, and the chosen one; write a PNG.

    Args:
        path: Where to write the PNG.
        estimates: The candidates to draw (e.g. ``PlanResult.ranked + PlanResult.front``).
        chosen: The configuration to mark.
        title: The figure title.

    Returns:
        ``path``.

    Raises:
        RuntimeError: matplotlib is not installed (the message says how to install it).
        ValueError: there is nothing to draw.
    """
    try:
        # matplotlib: optional and slow to import, only to draw
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError(MATPLOTLIB_HINT) from exc
    points = list(estimates) + ([chosen] if chosen is not None else [])
    if not points:
        raise ValueError("no estimates to draw")
    longest = max(e.epoch_time_s for e in points)
    t_scale, t_unit = (60.0, "min") if longest >= 120 else (1.0, "s")
    most = max(e.energy_per_epoch_j for e in points)
    e_scale, e_unit = (1e3, "kJ") if most >= 1e4 else (1.0, "J")
    front = pareto_front(points)

    fig = Figure(figsize=(8.5, 5.5), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.scatter([e.epoch_time_s / t_scale for e in points], [e.energy_per_epoch_j / e_scale for e in points],
               s=18, color="#9aa5b1", label="candidates", zorder=2)
    ax.plot([e.epoch_time_s / t_scale for e in front], [e.energy_per_epoch_j / e_scale for e in front],
            "-o", color="#1f6feb", markersize=5, linewidth=1.5, label="Pareto front (labels: Nb = N boards)", zorder=3)
    labelled = None
    for e in front:  # label where the board count changes, so neighbours do not overprint
        if len(e.candidate.boards) == labelled:
            continue
        labelled = len(e.candidate.boards)
        ax.annotate(f"{len(e.candidate.boards)}b", (e.epoch_time_s / t_scale, e.energy_per_epoch_j / e_scale),
                    textcoords="offset points", xytext=(5, 4), fontsize=7, color="#1f6feb")
    if chosen is not None:
        x, y = chosen.epoch_time_s / t_scale, chosen.energy_per_epoch_j / e_scale
        ax.scatter([x], [y], marker="*", s=260, color="#d1242f", edgecolor="black", linewidth=0.6, zorder=4,
                   label="chosen")
        count = len(chosen.candidate.boards)
        ax.annotate(f"chosen: {count} board{'s' if count > 1 else ''}, batch {chosen.candidate.global_batch}, "
                    f"{chosen.variant_label}\n{x:.1f} {t_unit}, {y:.1f} {e_unit}, {chosen.power_w:.1f} W",
                    (x, y), textcoords="offset points", xytext=(18, 28), fontsize=8,
                    arrowprops={"arrowstyle": "-", "color": "#d1242f", "linewidth": 0.8},
                    bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.9})
    ax.set_xlabel(f"time per epoch ({t_unit})")
    ax.set_ylabel(f"energy per epoch ({e_unit})")
    ax.set_title(title, fontsize=11)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    if any(e.power_estimated for e in points):
        ax.text(0.01, 0.01, "power of some boards is estimated (no sensor), not measured",
                transform=ax.transAxes, fontsize=7, color="#57606a")

    fig.savefig(path)
    log.debug("wrote the Pareto front (%d points, %d on the front) to %s", len(points), len(front), path)
    return path
