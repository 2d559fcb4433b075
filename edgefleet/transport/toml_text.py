"""A configuration as TOML text that ``tomllib`` reads back to the same values (``edge-agent --check-config``).

The standard library reads TOML but does not write it, and a configuration holds only strings,
numbers, booleans and lists of them, in one level of tables: these few lines write that much
rather than add a dependency. Anything else raises TypeError.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string: quotes, backslashes and control characters escaped."""
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def toml_key(key: str) -> str:
    """A bare key when TOML allows one, else a quoted key."""
    return key if _BARE_KEY.match(key) else toml_string(key)


def toml_value(value: Any) -> str:
    """One value: a string, a boolean, an integer, a float (``inf``/``nan`` included) or a list of them.

    Raises:
        TypeError: a value TOML has no place for here (None, a table inside a list, an object).
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # the shortest text that reads back to the same float, always with '.' or 'e'
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"{type(value).__name__} {value!r} has no TOML form here")


def toml_document(top: Mapping[str, Any], tables: Mapping[str, Mapping[str, Any]], *, header: str = "",
                  notes: Mapping[str, str] | None = None) -> str:
    """``top``'s keys, then one ``[table]`` per entry of ``tables``, with ``header`` as comment lines first.

    ``notes`` maps ``"table.key"`` (or a top-level ``"key"``) to a comment written after that table's keys,
    e.g. for a value left out on purpose.
    """
    notes = notes or {}
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in top.items()]
    lines += [f"# {text}" for key, text in notes.items() if "." not in key]
    for name, table in tables.items():
        lines += ["", f"[{toml_key(name)}]"]
        lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items()]
        lines += [f"# {text}" for key, text in notes.items() if key.split(".", 1)[0] == name and "." in key]
    return "\n".join(lines) + "\n"


__all__ = ["toml_document", "toml_key", "toml_string", "toml_value"]
