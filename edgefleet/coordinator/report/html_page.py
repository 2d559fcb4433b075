"""The report as one self-contained HTML page: tables, the plots as ``data:`` PNGs, and what is missing.

Every string that comes from the run (board ids, the run id, messages, metric names, file
contents) passes through :func:`esc` before it reaches the page: a run directory is data, and a
board names itself.
"""

from __future__ import annotations

import base64
import html
import json
import logging
from typing import Any

from edgefleet.coordinator.report.hyperparams import hyperparameters
from edgefleet.coordinator.report.plots import PLAN_KEYS, Plot, measured_compute_s
from edgefleet.coordinator.report.power_stats import board_energy, board_load
from edgefleet.coordinator.report.run_data import RunData, number

log = logging.getLogger(__name__)

DASH = "\u2013"    # a figure that is not there
TIMES = "\u00d7"   # measured / predicted

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1150px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .5em 0; font-size: .9em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; } td.num { text-align: right; }
img.plot { max-width: 100%; display: block; }
.missing { background: #fff4e0; border: 1px solid #e0b060; padding: .5em 1em; }
.none { color: #a05000; font-style: italic; } .caption { color: #555; font-size: .85em; }
tr.differs td { background: #fff8d0; }
"""


def esc(value: Any) -> str:
    """``value`` as text safe inside HTML content and attribute values."""
    return html.escape(str(value), quote=True)


def fmt(value: Any, digits: int = 4) -> str:
    """A number with ``digits`` significant figures; a dash for none."""
    v = number(value)
    return DASH if v is None else f"{v:.{digits}g}"


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def table(head: list[str], rows: list[list[str]], numeric_from: int = 1) -> str:
    """A table of already escaped cells; columns from ``numeric_from`` on are right-aligned."""
    th = "".join(f"<th>{h}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td class=\"num\">{c}</td>" if i >= numeric_from else f"<td>{c}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def plot_section(plot: Plot) -> str:
    parts = [f'<section id="sec-{esc(plot.key)}"><h2>{esc(plot.title)}</h2>']
    if plot.png is not None:
        data = base64.b64encode(plot.png).decode("ascii")
        parts.append(f'<img class="plot" id="plot-{esc(plot.key)}" alt="{esc(plot.title)}" src="data:image/png;base64,{data}">')
        parts.append(f'<p class="caption">{esc(plot.caption)}</p>')
    else:
        parts.append(f'<p class="none" id="none-{esc(plot.key)}">{esc(plot.why_not)}</p>')
    return "".join(parts) + "</section>"


def _status(run: RunData) -> str:
    if run.result is None:
        last = run.steps[-1].step + 1 if run.steps else 0
        return f"did not finish: {last} steps logged"
    done, total = run.result.get("steps"), run.result.get("total_steps")
    if run.result.get("interrupted"):
        return f"interrupted at step {done} of {total} (resumable with train --resume)"
    return f"finished: {done} of {total} steps"


def _summary(run: RunData) -> str:
    c, r = run.config, run.result or {}
    val = r.get("val_metrics") if isinstance(r.get("val_metrics"), dict) else (run.steps[-1].val_metrics if run.steps else {})
    rows = [["model", esc(c.get("model", DASH))], ["data", esc(c.get("dataset") or c.get("datamodule") or DASH)],
            ["boards", esc(", ".join(run.boards) or DASH)], ["status", esc(_status(run))],
            ["training time", f"{fmt(r.get('elapsed_s'))} s"], ["joining time", f"{fmt(r.get('join_s'))} s"],
            ["samples/s", f"{fmt(r.get('samples_per_s'))} (steady {fmt(r.get('steady_samples_per_s'))})"],
            ["steps with a board left out", fmt(r.get("steps_with_dropped_boards"))],
            ["wire dtype", esc(c.get("wire_dtype", DASH))],
            ["plan", esc(f"planned by train --auto (objective {run.plan.get('objective', '?')})" if run.plan is not None
                         else "none: the run was not planned (train --auto writes plan.json)")]]
    rows += [[f"final {esc(k)}", fmt(v)] for k, v in sorted((val or {}).items())]
    return "<h2>Summary</h2>" + table(["", ""], rows, numeric_from=2)


def _hyperparameters(run: RunData) -> str:
    """The run's hyperparameters, and every setting of its config.json under a fold."""
    rows = [[esc(name), esc(value)] for name, value in hyperparameters(run.config)]
    every = [[esc(k), esc(v if isinstance(v, str) else json.dumps(v))] for k, v in sorted(run.config.items())]
    fold = (f"<details><summary>every setting in config.json ({len(every)})</summary>"
            f"{table(['setting', 'value'], every, numeric_from=2)}</details>") if every else ""
    return (f'<section id="sec-hyperparameters"><h2>Hyperparameters</h2>'
            f"{table(['', ''], rows, numeric_from=2)}{fold}</section>")


def _boards(run: RunData) -> str:
    energy, compute, load = board_energy(run.power), measured_compute_s(run), board_load(run.power)
    per_board = (run.result or {}).get("boards")
    per_board = per_board if isinstance(per_board, dict) else {}
    rows = []
    for board in run.boards:
        mine = [s for s in run.steps if board in s.batch_sizes or board in s.compute_s]
        sizes = [s.batch_sizes[board] for s in mine if board in s.batch_sizes]
        missed = sum(1 for s in run.steps if board in s.late or board in s.refused)
        e, cpu_temp = energy.get(board), load.get(board)
        flags = _list(per_board[board].get("flags")) if isinstance(per_board.get(board), dict) else []
        rows.append([esc(board), fmt(sizes[0] if sizes else None), fmt(sizes[-1] if sizes else None), str(len(mine)),
                     fmt(compute[board] * 1000 if board in compute else None), str(missed),
                     DASH if e is None else fmt(e.mean_power_w, 3), DASH if e is None else fmt(e.energy_j, 4),
                     DASH if e is None else esc(", ".join(e.sources)),
                     fmt(cpu_temp.mean_cpu_percent if cpu_temp else None, 3), fmt(cpu_temp.max_temp_c if cpu_temp else None),
                     esc("; ".join(map(str, flags)) or DASH)])
    head = ["board", "first batch", "last batch", "steps", "median compute (ms)", "steps missed", "mean power (W)",
            "energy (J)", "power source", "mean CPU (%)", "max temp (°C)", "flags"]
    return "<h2>Boards</h2>" + table(head, rows, numeric_from=1)


def _rebalances(run: RunData) -> str:
    if not run.rebalances:
        why = ("re-balancing was off for this run" if run.config.get("rebalance") is False
               else "the batch sizes stayed as they started")
        return f'<section id="sec-rebalances"><h2>Re-balancing</h2><p>No re-balancing: {esc(why)}.</p></section>'
    rows = [[str(e.step), str(e.from_step), fmt(e.elapsed_s),
             esc(", ".join(f"{b} {e.old_batch_sizes.get(b, '?')} → {n}" for b, n in e.new_batch_sizes.items())),
             esc(e.message)] for e in run.rebalances]
    events = table(["decided at step", "from step", "at time (s)", "batch sizes", "why"], rows, numeric_from=0)
    return (f'<section id="sec-rebalances"><h2>Re-balancing</h2><p>{len(run.rebalances)} re-balance(s), drawn as dotted '
            f"lines on the plots where the new sizes take effect.</p>{events}</section>")


def _plan(run: RunData) -> str:
    plan = run.plan or {}
    predicted, measured = plan.get("predicted"), plan.get("measured")
    if not isinstance(predicted, dict):
        return ""
    measured = measured if isinstance(measured, dict) else {}
    rows = []
    for key, name in PLAN_KEYS:
        p, m = number(predicted.get(key)), number(measured.get(key))
        rows.append([esc(name), fmt(p), fmt(m), DASH if p in (None, 0.0) or m is None else f"{m / p:.2f}{TIMES}"])
    sizes = ", ".join(f"{b}: {n}" for b, n in zip(_list(predicted.get("boards")), _list(predicted.get("batch_sizes"))))
    notes = [f"objective: {plan.get('objective', DASH)}; planned boards and batch sizes: {sizes or DASH}; "
             f"power {'estimated' if predicted.get('power_estimated') else 'measured'} in the profile",
             f"profiling took {fmt(plan.get('profile_s'), 3)} s, pre-training {fmt(plan.get('verify_s'), 3)} s"]
    if not measured:
        notes.append("the run was not measured (too few steps after the warm-up, or no telemetry)")
    elif measured.get("power_measured") is False:
        notes.append("the measured power includes estimates (some board has no power sensor)")
    return "<ul>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>" + table(
        ["figure", "predicted", "measured", "measured / predicted"], rows)


def _files(run: RunData) -> str:
    rows = [[esc(name), "yes" if present else "no"] for name, present in run.files.items()]
    return "<h2>Files</h2>" + table(["file", "present"], rows, numeric_from=2)


def render_page(run: RunData, plots: list[Plot]) -> str:
    """The whole page for ``run`` with its ``plots`` (from :func:`~.plots.draw_plots`)."""
    by_key = {p.key: p for p in plots}
    missing = "" if not run.missing else (
        '<div class="missing" id="missing"><strong>Missing from this run directory:</strong><ul>'
        + "".join(f"<li>{esc(m)}</li>" for m in run.missing) + "</ul></div>")
    sections = [_hyperparameters(run)] + [plot_section(p) for p in plots if p.key not in ("power", "board_load", "plan")]
    sections.append(_rebalances(run))
    sections.append(_boards(run))
    for key in ("power", "board_load"):
        if key in by_key:
            sections.append(plot_section(by_key[key]))
    if "plan" in by_key:
        sections.append(plot_section(by_key["plan"]) + _plan(run))
    title = f"Run report: {run.run_id}"
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{esc(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{esc(title)}</h1>"
            f"<p>Run directory: <code>{esc(run.run_dir)}</code></p>{missing}{_summary(run)}"
            + "".join(sections) + _files(run) + "</body></html>\n")


__all__ = ["DASH", "STYLE", "esc", "fmt", "plot_section", "render_page", "table"]
