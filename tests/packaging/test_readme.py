"""The README is the user's document (and the PyPI long description): short, and no run history."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
HISTORY = [
    (r"\b20\d\d-\d\d-\d\d\b", "a dated run"),
    (r"\bsession\b", "a development session"),
    (r"misses taught", "a benchmark's diary"),
    (r"\bissue \d+\b", "an issue number"),
]


def test_the_readme_is_under_15_kb() -> None:
    size = len(README.read_bytes())
    assert size < 15_000, f"README.md is {size} bytes; move reference material to docs/"


def _outside_the_figures_table(text: str) -> str:
    """The README without its table of current figures (each figure says the day it was measured)."""
    start = text.index("## Benchmarks")
    end = text.index("\n## ", start + 1)
    section = "\n".join(line for line in text[start:end].splitlines() if not line.startswith("|"))
    return text[:start] + section + text[end:]


def test_the_readme_holds_no_run_history() -> None:
    text = _outside_the_figures_table(README.read_text())
    for pattern, what in HISTORY:
        found = [m.group(0) for m in re.finditer(pattern, text, flags=re.IGNORECASE)]
        found = [f for f in found if f != "2026-11-21"]  # the run id in the resume example is a name, not a date of a run
        assert not found, f"README.md holds {what}: {found[:3]}; history goes to docs/benchmarks.md"


def test_the_readme_links_point_at_files() -> None:
    for target in re.findall(r"\]\(((?!https?://|#)[^)#]+)", README.read_text()):
        assert (README.parent / target).exists(), f"README.md links to {target}, which does not exist"
