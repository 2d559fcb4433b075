"""Rich tables: the fleet view (``status``) and the end of a training run.

Every string that a board or a run produced goes into a cell as a :class:`rich.text.Text`, which
rich never parses as markup: a ``power_source`` of ``[bold red]x[/]`` shows as those characters,
and ``[/]`` cannot raise MarkupError. Numbers go through :func:`_num` and :func:`_bytes`, which show
``?`` for a value they cannot format instead of raising.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console, JustifyMethod
from rich.table import Table
from rich.text import Text

from edgefleet.coordinator.control.fleet import BoardRow

_SHORT_REASON = {"connection lost": "lost"}
_HEALTH_STYLE = {"ok": "green", "stale": "yellow", "no-data": "yellow", "bad-data": "red", "offline": "dim red"}


def _bytes(n: float | None) -> str:
    """Compact SI bytes: 812B, 2.7K, 512M, 25.3G; ``?`` for a value that cannot be formatted."""
    if n is None:
        return "-"
    try:
        for unit in ("B", "K", "M", "G", "T"):
            if abs(n) < 1000 or unit == "T":
                return f"{n:.0f}{unit}" if unit == "B" or abs(n) >= 10 else f"{n:.1f}{unit}"
            n /= 1000
    except (OverflowError, ValueError, TypeError):
        return "?"
    return "-"


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    """``value`` formatted with ``fmt`` and ``suffix``; ``-`` for None, ``?`` for a value that cannot be formatted."""
    if value is None:
        return "-"
    try:
        return format(value, fmt) + suffix
    except (OverflowError, ValueError, TypeError):
        return "?"


def limit_note(ignored: int, max_boards: int) -> str:
    """The line that says boards were left out of the view; empty when none were."""
    if not ignored:
        return ""
    return (f"{ignored} more board(s) not shown: over the limit of {max_boards} boards per view "
            f"(raise it with --max-boards, or clear the retained topics of boards that do not exist)")


# The live table's lines besides its rows: the title and the blank line under it, the header and its rule, the blank
# line above the caption, and two caption lines (the estimated-power mark, what did not fit; the view's limit is rare)
_TABLE_OVERHEAD_LINES = 7


def fit_rows(rows: list[BoardRow], height: int) -> tuple[list[BoardRow], str]:
    """The rows a live view of ``height`` lines shows, and a line saying what it left out (empty: every row fits).

    A terminal shorter than the fleet would cut the table off at its bottom, whatever is there: the boards that report
    go first, and the offline ones fill what room is left (a broker keeps the retained status of every board that
    ever reported, so the offline ones pile up). Among the shown rows the order stays the view's.
    """
    room = max(1, height - _TABLE_OVERHEAD_LINES)
    if len(rows) <= room:
        return rows, ""
    offline = [r for r in rows if r.health == "offline"]
    reporting = [r for r in rows if r.health != "offline"]
    if len(reporting) >= room:
        kept = set(map(id, reporting[:room]))
        left = len(rows) - room
        return [r for r in rows if id(r) in kept], (f"{left} more board(s) not shown: the terminal has room for {room}; "
                                                   "make it taller, or run status without --watch to list them all")
    kept = set(map(id, reporting)) | set(map(id, offline[:room - len(reporting)]))
    hidden = [r.board_id for r in offline[room - len(reporting):]]
    names = ", ".join(hidden[:3]) + (", ..." if len(hidden) > 3 else "")
    return [r for r in rows if id(r) in kept], (f"{len(hidden)} offline board(s) not shown ({names}): "
                                               "status without --watch lists them all")


def fleet_table(rows: list[BoardRow], *, title: str = "edgefleet", note: str = "") -> Table:
    """One row per board: state, age of its sample, CPU, memory, network, temperature and power.

    Board-provided text (ids, offline reasons, power sources) is shown as plain text, never as markup;
    ``note`` (for example :func:`limit_note`) goes into the caption.
    """
    table = Table(title=Text(title, style="table.title"), title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1, 0, 0))
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("board", "left"), ("state", "left"), ("age", "right"), ("CPU", "right"), ("memory", "right"),
        ("net rx/tx", "right"), ("temp", "right"), ("power", "right"), ("source", "left"))
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)
    for row in rows:
        s = row.sample
        state = row.state if row.health in ("ok", "offline") else f"{row.state} ({row.health})"
        if row.health == "offline" and row.offline_reason:
            state = f"offline ({_SHORT_REASON.get(row.offline_reason, row.offline_reason)})"
        if row.bad_messages:
            state += f" [{row.bad_messages} bad]"
        memory = "-" if s is None or s.mem_used_bytes is None else f"{_bytes(s.mem_used_bytes)}/{_bytes(s.mem_total_bytes)}"
        net = "-" if s is None else f"{_bytes(s.net_rx_bytes_per_s)}/{_bytes(s.net_tx_bytes_per_s)}"
        cells = [
            row.board_id, state, _num(row.age_s, ".1f", "s"),
            "-" if s is None else _num(s.cpu_percent, ".0f", "%"),
            memory, net,
            "-" if s is None else _num(s.temp_c, ".1f", "°C"),
            "-" if s is None else _num(s.power_w, ".2f", "W*" if s.power_source == "estimated" else "W"),
            "-" if s is None else s.power_source,
        ]
        style = _HEALTH_STYLE.get(row.health, "")
        table.add_row(*(Text(cell, style=style if i == 1 else "") for i, cell in enumerate(cells)))
    captions = []
    if not rows:
        captions.append("no boards have reported on this broker and topic prefix yet")
    elif any(r.sample is not None and r.sample.power_source == "estimated" for r in rows):
        captions.append("* estimated from CPU load, not measured")
    if note:
        captions.append(note)
    if captions:
        table.caption = Text("\n".join(captions), style="table.caption")
        table.caption_justify = "left"
    return table


def fleet_power_text(rows: list[BoardRow]) -> str:
    """The fleet's total power now: the sum over the boards online or busy with a reading, e.g. ``23.4 W``
    (``W*`` when part of it is estimated from CPU load), or ``-`` when none has one."""
    readings = [r.sample for r in rows if r.sample is not None and r.sample.power_w is not None
                and r.state in ("online", "busy") and r.health == "ok"]
    if not readings:
        return "-"
    total = sum(float(s.power_w or 0.0) for s in readings)
    estimated = any(s.power_source == "estimated" for s in readings)
    return _num(total, ".1f", " W*" if estimated else " W")


def make_console(*, stderr: bool = False) -> Console:
    """A console on stdout (``stderr``: on stderr) as wide as the terminal, or 120 columns when it goes to a file or pipe."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(width=120, stderr=stderr)


def summary_line(result: dict[str, Any]) -> str:
    """One line of a run's result: steps, validation accuracy, time and throughput."""
    acc = result.get("val_accuracy")
    return (f"run {result['run_id']}: {result['steps']}/{result['total_steps']} steps, "
            f"val accuracy {'-' if acc is None else f'{acc:.2%}'}, {result['elapsed_s']:.1f} s training, "
            f"{result.get('samples_per_s') or 0:.0f} samples/s")


def summary_table(result: dict[str, Any]) -> Table:
    """The end-of-run table: each board's share of the run."""
    table = Table(header_style="bold", box=box.SIMPLE_HEAD)
    for name in ("board", "batch", "steps", "median compute", "flags"):
        table.add_column(name, justify="left" if name in ("board", "flags") else "right")
    for board, info in result["boards"].items():
        median = info.get("median_compute_s")
        flags = info.get("flags") or []
        table.add_row(Text(str(board)), str(info["batch_size"]), str(info["steps_contributed"]),
                      "-" if median is None else _num(median * 1000, ".1f", " ms"),
                      Text("" if not flags else f"{len(flags)}: {flags[-1]}"))
    return table
