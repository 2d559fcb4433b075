"""Reading sysfs attributes: small text files holding one value."""

from __future__ import annotations

from pathlib import Path


def read_str(path: Path) -> str:
    return path.read_text(encoding="ascii", errors="replace").strip()


def read_int(path: Path) -> int:
    """An integer attribute. Raises OSError (missing, -ENODATA) or ValueError (empty or garbage).

    Some L4T attributes append a unit ("32760 ma"): the first word is the value.
    """
    text = read_str(path)
    if not text:
        raise ValueError(f"{path} is empty")
    return int(text.split()[0])
