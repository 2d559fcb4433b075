"""The benchmarks' final table: rich when it is installed, aligned plain text otherwise."""

from __future__ import annotations

import shutil
from collections.abc import Sequence


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], *, caption: str = "",
                left_columns: int = 1, min_width: int = 120) -> None:
    """Print ``rows`` under ``headers``; the first ``left_columns`` columns are left-aligned."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in (headers, *rows)) for i in range(len(headers))]
        print(f"\n{title}")
        for r in (headers, *rows):
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if caption:
            print(caption)
        return
    table = Table(title=title, title_justify="left", caption=caption or None, caption_justify="left")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i < left_columns else "right")
    for r in rows:
        table.add_row(*r)
    print()
    Console(width=max(min_width, shutil.get_terminal_size().columns)).print(table)
