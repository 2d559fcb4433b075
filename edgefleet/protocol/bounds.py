"""What a board can physically report: a range per numeric field, a length per text field.

A message from a board is checked against these after its types (``_validate``): a value outside
its bound refuses the whole message with a :class:`DecodeError` naming the field, the value and the
range, so the fleet view shows the board as sending bad data instead of showing nonsense as healthy.
Each bound compiles to one fast check (``accepts``); the wording is built only for a refused value.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Check = Callable[[Any], bool]

MAX_TEXT_CHARS = 256  # any text field a board sends: a hostname, a model name, a reason


@dataclass(frozen=True, slots=True)
class Bound:
    """The values one field may hold.

    Attributes:
        lo, hi: inclusive range of a number, or of every number in a list or map.
        unit: named in the refusal ("W", "°C", "bytes").
        max_items: most entries of a list or map field (0: not a list or map).
        max_chars: most characters of a text field, or of a map's keys (0: not text).
    """

    lo: float = -math.inf
    hi: float = math.inf
    unit: str = ""
    max_items: int = 0
    max_chars: int = 0

    def _number_ok(self, v: Any) -> bool:
        return bool(self.lo <= v <= self.hi)  # int and float compare exactly, however large the int

    def _key_ok(self, key: str) -> bool:
        return len(key) <= (self.max_chars or MAX_TEXT_CHARS) and key.isprintable()

    def compile(self) -> Check:
        """One fast predicate for an already type-checked value (None always passes)."""
        lo, hi, items, chars = self.lo, self.hi, self.max_items, self.max_chars
        key_chars = chars or MAX_TEXT_CHARS
        if items:
            def collection(v: Any) -> bool:  # min/max/join at C speed: a sample has three of these
                if not v:
                    return True
                if len(v) > items:
                    return False
                if isinstance(v, dict):
                    if max(map(len, v)) > key_chars or not "".join(v).isprintable():
                        return False
                    v = v.values()
                return bool(lo <= min(v) and max(v) <= hi)
            return collection
        if chars:
            return lambda v: v is None or (len(v) <= chars and v.isprintable())
        return lambda v: v is None or lo <= v <= hi

    def _range(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        return f"{self.lo:g} to {self.hi:g}{unit}"

    def problem(self, value: Any) -> str:
        """Why ``value`` is refused, in words (call only when ``compile()``'s check said no)."""
        if isinstance(value, str):
            if len(value) > self.max_chars:
                return f"has {len(value)} characters, over the limit of {self.max_chars}"
            return f"holds control or other non-printable characters ({value!r:.60})"
        if isinstance(value, (list, dict)):
            if len(value) > self.max_items:
                return f"has {len(value)} entries, over the limit of {self.max_items}"
            if isinstance(value, dict):
                for key in value:
                    if not self._key_ok(key):
                        return (f"has a key of {len(key)} characters or with non-printable ones ({key!r:.60}); "
                                f"keys are printable text of at most {self.max_chars or MAX_TEXT_CHARS} characters")
                value = list(value.values())
            bad = next(v for v in value if not self._number_ok(v))
            return f"holds {short_repr(bad)}, outside what a board can report ({self._range()})"
        return f"= {short_repr(value)} is outside what a board can report ({self._range()})"


def short_repr(value: Any) -> str:
    """``value`` in at most 40 characters; a huge int by its size (its digits are useless, and slow to make)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 100:
        return f"an integer of about {round(value.bit_length() * math.log10(2))} digits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


TEXT = Bound(max_chars=MAX_TEXT_CHARS)


def bounds_for(cls: type, table: Mapping[str, Bound]) -> dict[str, Bound]:
    """``table`` completed for the dataclass ``cls``: every text field not named gets :data:`TEXT`.

    Raises:
        TypeError: a numeric, list or map field of ``cls`` has no bound, or ``table`` names a field
            ``cls`` does not have (a programming error, found at import).
    """
    fields = {f.name: str(f.type).replace(" ", "") for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise TypeError(f"{cls.__name__} has no fields {unknown}")
    out = dict(table)
    for name, annotation in fields.items():
        if name in out or annotation in ("bool", "bool|None"):
            continue
        if annotation in ("str", "str|None"):
            out[name] = TEXT
        else:
            raise TypeError(f"{cls.__name__}.{name} ({annotation}) needs a bound: what can a board physically report?")
    return out


__all__ = ["MAX_TEXT_CHARS", "TEXT", "Bound", "bounds_for", "short_repr"]
