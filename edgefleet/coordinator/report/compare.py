"""Several runs on one page (``edge-coordinator report RUN_A RUN_B ...``): their hyperparameters side by side,
and their loss, validation accuracy, samples/s and learning rate overlaid, over steps and over time.

Each run is labelled by its run id (the folder's name where two share one); each keeps one colour,
dash pattern and marker across the plots. A run that lacks a figure (no validation, an older run
without learning rates) is left out of that plot, and the caption says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from matplotlib.axes import Axes

from edgefleet.coordinator.report.figure_kit import Plot, label, legend, line_styles, png, two_axes
from edgefleet.coordinator.report.html_page import DASH, STYLE, esc, fmt, plot_section, table
from edgefleet.coordinator.report.hyperparams import hyperparameters
from edgefleet.coordinator.report.run_data import RunData, StepRecord

log = logging.getLogger(__name__)

RATE_WINDOW = 10   # steps over which samples/s is measured (one step's interval is noisy)


def run_labels(runs: Sequence[RunData]) -> list[str]:
    """One distinct label per run: its run id, or its folder where run ids repeat, numbered if that repeats too."""
    ids = [r.run_id for r in runs]
    labels = [r.run_id if ids.count(r.run_id) == 1 else str(r.run_dir) for r in runs]
    return [text if labels.count(text) == 1 else f"{text} #{i + 1}" for i, text in enumerate(labels)]


def accuracy_key(run: RunData) -> str | None:
    """The validation metric that is an accuracy (``val_acc``, ``val_accuracy``...), if the run logged one."""
    keys = sorted({k for s in run.steps for k in s.val_metrics if "acc" in k.lower()})
    return keys[0] if keys else None


def _rates(steps: Sequence[StepRecord]) -> list[tuple[int, float, float]]:
    """(step, time, samples/s over the last RATE_WINDOW steps) where both ends are timed and counted."""
    out = []
    for i in range(1, len(steps)):
        a, b = steps[max(0, i - RATE_WINDOW)], steps[i]
        window = steps[max(0, i - RATE_WINDOW) + 1:i + 1]
        if a.elapsed_s is None or b.elapsed_s is None or b.elapsed_s <= a.elapsed_s or any(s.samples is None for s in window):
            continue
        out.append((b.step, b.elapsed_s, sum(s.samples or 0 for s in window) / (b.elapsed_s - a.elapsed_s)))
    return out


Series = Callable[[RunData], tuple[list[float], list[float], list[float]]]  # (steps, times, values) of one run


def _by_step(value: Callable[[StepRecord], float | None]) -> Series:
    def points(run: RunData) -> tuple[list[float], list[float], list[float]]:
        kept = [(float(s.step), s.elapsed_s, v) for s in run.steps if (v := value(s)) is not None]
        return [p[0] for p in kept], [p[1] if p[1] is not None else float("nan") for p in kept], [p[2] for p in kept]
    return points


def _accuracy(run: RunData) -> tuple[list[float], list[float], list[float]]:
    key = accuracy_key(run)
    return _by_step(lambda s: s.val_metrics.get(key) if key else None)(run)


def _samples_per_s(run: RunData) -> tuple[list[float], list[float], list[float]]:
    rates = _rates(run.steps)
    return [float(r[0]) for r in rates], [r[1] for r in rates], [r[2] for r in rates]


def _overlay(runs: Sequence[RunData], labels: Sequence[str], *, key: str, title: str, caption: str, ylabel: str,
             series: Series, log_scale: bool = False, marker_every_point: bool = False) -> Plot:
    drawn: list[tuple[str, tuple[list[float], list[float], list[float]]]] = []
    for run, name in zip(runs, labels):
        points = series(run)
        if points[0]:
            drawn.append((name, points))
    left_out = [name for name in labels if name not in {d[0] for d in drawn}]
    if left_out:
        caption += f" Not in this plot (no such figure logged): {', '.join(left_out)}."
    if not drawn:
        return Plot(key=key, title=title, caption=caption, png=None, why_not=f"None of the runs logged its {ylabel}.")
    style = line_styles(labels)
    if marker_every_point:  # a few points each (one per epoch): every one marked
        style = {name: {**look, "markevery": None} for name, look in style.items()}
    fig, by_step, by_time = two_axes(title)
    for ax, over_time in ((by_step, False), (by_time, True)):
        for name, (steps, times, values) in drawn:
            ax.plot(times if over_time else steps, values, linewidth=1.3, label=label(name), **style[name])
        _finish(ax, ylabel, log_scale=log_scale and all(y > 0 for _, points in drawn for y in points[2]))
    return Plot(key=key, title=title, caption=caption, png=png(fig))


def _finish(ax: Axes, ylabel: str, *, log_scale: bool) -> None:
    ax.set_ylabel(ylabel)
    if log_scale:
        ax.set_yscale("log")
    legend(ax)


def comparison_plots(runs: Sequence[RunData], labels: Sequence[str]) -> list[Plot]:
    """The overlaid plots, in page order."""
    return [
        _overlay(runs, labels, key="compare_loss", title="Loss", ylabel="training loss", log_scale=True,
                 caption="Each run's sample-weighted training loss at every step.", series=_by_step(lambda s: s.loss)),
        _overlay(runs, labels, key="compare_validation", title="Validation accuracy", ylabel="validation accuracy",
                 marker_every_point=True, caption="Each run's validation accuracy at each epoch's end.",
                 series=_accuracy),
        _overlay(runs, labels, key="compare_samples", title="Samples per second", ylabel="samples/s",
                 caption=f"Each run's training throughput over the last {RATE_WINDOW} steps (validation included).",
                 series=_samples_per_s),
        _overlay(runs, labels, key="compare_lr", title="Learning rate", ylabel="learning rate",
                 caption="The learning rate of each run's first param group.",
                 series=_by_step(lambda s: s.lr[0] if s.lr else None)),
    ]


def _outcome(run: RunData) -> list[str]:
    r = run.result or {}
    key = accuracy_key(run)
    last = [s.val_metrics[key] for s in run.steps if key and key in s.val_metrics]
    return [esc(run.run_dir), "finished" if run.result is not None and not r.get("interrupted") else "did not finish",
            str(len(run.steps)), fmt(r.get("elapsed_s")), fmt(r.get("samples_per_s")),
            fmt(run.steps[-1].loss if run.steps else None), fmt(last[-1] if last else None)]


def render_comparison(runs: Sequence[RunData], labels: Sequence[str], plots: Sequence[Plot]) -> str:
    """The page: each run's outcome, the hyperparameters side by side (rows that differ marked), the plots."""
    heads = [esc(name) for name in labels]
    outcome_names = ["run directory", "status", "steps logged", "training time (s)", "samples/s", "last loss",
                     "last validation accuracy"]
    outcomes = [_outcome(run) for run in runs]
    outcome_rows = [[esc(name)] + [o[i] for o in outcomes] for i, name in enumerate(outcome_names)]
    settings = [dict(hyperparameters(run.config)) for run in runs]
    names = list(dict.fromkeys(name for s in settings for name in s))
    rows = []
    for name in names:
        values = [s.get(name, DASH) for s in settings]
        mark = ' class="differs"' if len(set(values)) > 1 else ""
        rows.append(f"<tr{mark}><td>{esc(name)}</td>" + "".join(f"<td>{esc(v)}</td>" for v in values) + "</tr>")
    hyper = (f'<section id="sec-hyperparameters"><h2>Hyperparameters</h2><p class="caption">Rows that differ between '
             f'the runs are marked.</p><table><tr><th></th>{"".join(f"<th>{h}</th>" for h in heads)}</tr>'
             f'{"".join(rows)}</table></section>')
    missing = [f"{name}: {m}" for run, name in zip(runs, labels) for m in run.missing]
    notes = "" if not missing else (
        '<div class="missing" id="missing"><strong>Missing from the run directories:</strong><ul>'
        + "".join(f"<li>{esc(m)}</li>" for m in missing) + "</ul></div>")
    title = f"Runs compared: {', '.join(labels)}"
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{esc(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{esc(title)}</h1>{notes}"
            f'<section id="sec-runs"><h2>Runs</h2>{table(["", *heads], outcome_rows, numeric_from=1)}</section>'
            f"{hyper}" + "".join(plot_section(p) for p in plots) + "</body></html>\n")


__all__ = ["RATE_WINDOW", "accuracy_key", "comparison_plots", "render_comparison", "run_labels"]
