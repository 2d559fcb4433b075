"""A profile on the terminal: one table per model variant, a row per board.

Board ids and power sources come from the boards: they go into cells as plain :class:`Text`, never markup.
"""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text

from edgefleet.coordinator.planning import FleetProfile


def _si(value: float, unit: str) -> str:
    for prefix in ("", "k", "M", "G", "T"):
        if abs(value) < 1000 or prefix == "T":
            return f"{value:.0f} {prefix}{unit}" if abs(value) >= 10 or not prefix else f"{value:.1f} {prefix}{unit}"
        value /= 1000
    return "-"


def _mbit(bytes_per_s: float) -> str:
    mbit = bytes_per_s * 8e-6
    return f"{mbit:.0f}" if mbit >= 100 else f"{mbit:.1f}"


def profile_table(label: str, fleet: FleetProfile) -> Table:
    """One variant's table: a row per board, step time and samples/s per batch size, power, memory, link."""
    sizes = sorted({p.batch_size for board in fleet.boards.values() for p in board.points})
    table = Table(title=Text(f"{label}: {fleet.model_key} · gradient {_si(fleet.grad_bytes, 'B')} · coordinator link "
                             f"{_si(fleet.coordinator_link_bytes_per_s * 8, 'bit/s')}", style="table.title"),
                  title_justify="left", header_style="bold", box=box.SIMPLE_HEAD)
    table.add_column("board")
    for size in sizes:
        table.add_column(f"batch {size}", justify="right")
    for name in ("power W active/link/idle", "source", "peak memory / total", "link Mbit/s up/down",
                 "gradient up+back"):
        table.add_column(name, justify="left" if name == "source" else "right")
    for board in fleet.boards.values():
        by_size = {p.batch_size: p for p in board.points}
        cells = [f"{by_size[s].step_time_s * 1000:.1f} ms · {s / by_size[s].step_time_s:.0f}/s" if s in by_size else "-"
                 for s in sizes]
        star = "*" if board.power_source == "estimated" else ""
        peak = max(p.peak_memory_bytes for p in board.points)
        down = board.link_down_bytes_per_s or board.link_bytes_per_s
        link_w = "-" if board.link_power_w is None else f"{board.link_power_w:.2f}{star}"
        table.add_row(Text(board.board_id), *cells,
                      f"{board.active_power_w:.2f}{star} / {link_w} / {board.idle_power_w:.2f}{star}",
                      Text(board.power_source), f"{_si(peak, 'B')} / {_si(board.memory_total_bytes, 'B')}",
                      f"{_mbit(board.link_bytes_per_s)} / {_mbit(down)}",
                      "-" if board.link_round_s is None else f"{board.link_round_s * 1000:.1f} ms")
    if any(b.power_source == "estimated" for b in fleet.boards.values()):
        table.caption = "* estimated from CPU load (power.idle_w, power.max_w), not measured"
    return table


__all__ = ["profile_table"]
