"""Type and range checks for decoded messages, compiled once per dataclass from its own annotations.

The fleet view validates every telemetry message it folds (thousands per second), so each field's
check is built once per class and is a plain function call per message. A class may also have
bounds (:func:`set_bounds`, see ``bounds.py``): what a board can physically report per field.

JSON from the network is decoded under a size and a nesting-depth limit (:func:`load_json`), so a
payload of 100 KB of ``[[[[`` is refused in words instead of raising RecursionError in the parser.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from itertools import accumulate, repeat
from typing import Any, TypeVar

from edgefleet.protocol.bounds import Bound, short_repr
from edgefleet.protocol.errors import DecodeError

T = TypeVar("T")
Check = Callable[[Any], bool]
_isfinite = math.isfinite
_NUMBER_TYPES = frozenset((int, float))   # exact types: bool (an int subclass) is not one
_STR_TYPE = {str}

MAX_JSON_BYTES = 64 * 1024   # a telemetry sample is ~600 bytes; one of a 1024-core board ~12 KB
MAX_JSON_DEPTH = 8           # the messages nest 2 deep (an object holding lists and maps)

# A JSON string (escapes included) or one bracket: the tokens that decide how deep a document nests.
_DEPTH_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_DEPTH_STEP = {b"[": 1, b"{": 1, b"]": -1, b"}": -1}


def json_depth(payload: bytes) -> int:
    """How deep the arrays and objects of a JSON document nest (brackets inside strings do not count).

    A document of valid JSON up to any point is measured exactly up to that point, so an invalid one
    cannot hide depth from the parser either.
    """
    tokens = _DEPTH_TOKENS.findall(payload)
    return max(accumulate(map(_DEPTH_STEP.get, tokens, repeat(0))), default=0)


def load_json(payload: bytes | str, *, what: str, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` for a payload from the network, refused in words when too large or too deep.

    Raises:
        DecodeError: naming ``what``, and the size, depth or syntax that was wrong.
    """
    if isinstance(payload, str):
        payload = payload.encode("utf-8", "surrogatepass")
    if len(payload) > max_bytes:
        raise DecodeError(f"{what}: {len(payload)} bytes, over the limit of {max_bytes} for one message")
    # Cheap first: a document with no more opening brackets than the limit cannot nest deeper.
    if payload.count(b"[") + payload.count(b"{") > max_depth:
        depth = json_depth(payload)
        if depth > max_depth:
            raise DecodeError(f"{what}: JSON nested {depth} deep, over the limit of {max_depth}")
    try:
        return json.loads(payload)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise DecodeError(f"{what}: not valid JSON ({str(exc)[:120]})") from None


def _float(v: Any) -> bool:
    t = type(v)
    if t is float:
        return _isfinite(v)
    if t is int:
        return True
    return isinstance(v, (int, float)) and not isinstance(v, bool) and (not isinstance(v, float) or _isfinite(v))


def _int(v: Any) -> bool:
    return type(v) is int or (isinstance(v, int) and not isinstance(v, bool))


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _any_scalar(v: Any) -> bool:   # an option value: a scalar, never a nested structure
    return v is None or isinstance(v, (str, int, float, bool))


def _opt_float(v: Any) -> bool:
    t = type(v)
    if t is float:
        return _isfinite(v)
    return v is None or t is int or _float(v)


def _opt_int(v: Any) -> bool:
    return v is None or type(v) is int or _int(v)


_SCALAR_CHECKS: dict[str, Check] = {"str": _str, "int": _int, "float": _float, "bool": _bool}
_OPTIONAL_CHECKS: dict[str, Check] = {"float|None": _opt_float, "int|None": _opt_int,
                                      "str|None": lambda v: v is None or isinstance(v, str)}


def _numbers(values: Any) -> bool:
    """All finite int/float, at C speed for the usual exact types; else element by element."""
    if set(map(type, values)) <= _NUMBER_TYPES:
        try:
            return all(map(_isfinite, values))
        except OverflowError:  # an int too large for a float is finite: the field's bound judges it
            return all(map(_float, values))
    return all(map(_float, values))


def _compile(annotation: str) -> Check:
    """A checker for one field annotation (as written in the dataclass), built once per class."""
    a = annotation.replace(" ", "")
    if a == "Any":
        return _any_scalar
    if a.endswith("|None"):
        if a in _OPTIONAL_CHECKS:
            return _OPTIONAL_CHECKS[a]
        inner = _compile(a[: -len("|None")])
        return lambda v: v is None or inner(v)
    if a in _SCALAR_CHECKS:
        return _SCALAR_CHECKS[a]
    if a.startswith("list[") and a.endswith("]"):
        if a == "list[float]":
            return lambda v: isinstance(v, list) and _numbers(v)
        item = _compile(a[5:-1])
        return lambda v: isinstance(v, list) and all(map(item, v))
    if a.startswith("dict[str,") and a.endswith("]"):
        if a == "dict[str,float]":
            return lambda v: isinstance(v, dict) and all(map(_str, v)) and _numbers(v.values())
        item = _compile(a[len("dict[str,"):-1])
        return lambda v: isinstance(v, dict) and all(map(_str, v)) and all(map(item, v.values()))
    raise TypeError(f"unsupported annotation {annotation!r} in a wire message")


Plan = tuple[tuple[str, Check, Check, "Check | None", bool, str, "Bound | None"], ...]
_PLANS: dict[type, Plan] = {}
_BOUNDS: dict[type, Mapping[str, Bound]] = {}


def set_bounds(cls: type, bounds: Mapping[str, Bound]) -> None:
    """Check every message of ``cls`` decoded from now on against ``bounds`` (field name -> Bound)."""
    _BOUNDS[cls] = dict(bounds)
    _PLANS.pop(cls, None)


def _fast(annotation: str, check: Check, bound: Bound | None, in_bounds: Check | None) -> Check:
    """One predicate for a field's type and bound, fused where it can be (the hot path of every sample).

    True means valid; False means "look closer" (the separate checks then decide and name the problem),
    so the fused forms may be stricter than the real checks (exact types) but never looser.
    """
    if bound is None or in_bounds is None:
        return check
    a = annotation.replace(" ", "")
    optional = a.endswith("|None")
    base = a[: -len("|None")] if optional else a
    if base in ("float", "int") and not bound.max_items and not bound.max_chars:
        types = _NUMBER_TYPES if base == "float" else frozenset((int,))
        lo, hi = bound.lo, bound.hi  # a finite range also refuses NaN and the infinities
        if optional:
            return lambda v: (type(v) in types and lo <= v <= hi) or v is None
        return lambda v: type(v) in types and lo <= v <= hi
    if base == "str" and bound.max_chars:
        chars = bound.max_chars
        if optional:
            return lambda v: (type(v) is str and len(v) <= chars and v.isprintable()) or v is None
        return lambda v: type(v) is str and len(v) <= chars and v.isprintable()
    if base == "list[float]" and bound.max_items and not optional:
        return lambda v: type(v) is list and (not v or (set(map(type, v)) <= _NUMBER_TYPES and in_bounds(v)))
    if base == "dict[str,float]" and bound.max_items and not optional:
        return lambda v: type(v) is dict and (not v or (set(map(type, v)) == _STR_TYPE
                                                        and set(map(type, v.values())) <= _NUMBER_TYPES and in_bounds(v)))
    return lambda v: check(v) and in_bounds(v)


def _plan(cls: type) -> Plan:
    """(name, fused check, type check, bound check, required, annotation, bound) per field of ``cls``; made on first use."""
    plan = _PLANS.get(cls)
    if plan is None:
        bounds = _BOUNDS.get(cls, {})
        fields = [(f, str(f.type), _compile(str(f.type)), bounds.get(f.name)) for f in dataclasses.fields(cls)]
        plan = _PLANS[cls] = tuple(
            (f.name, _fast(annotation, check, bound, in_bounds), check, in_bounds,
             f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, annotation, bound)
            for f, annotation, check, bound in fields
            for in_bounds in [None if bound is None else bound.compile()])
    return plan


_MISSING = object()


def _preview(value: Any) -> str:
    """At most 60 characters of ``value``'s repr; never the decimal digits of a huge int (slow, and useless)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return short_repr(value)
    try:
        return f"{value!r:.60}"
    except ValueError:  # an int inside a list past Python's 4300-digit str() limit
        return f"a {type(value).__name__} too large to show"


def message_from_dict(cls: type[T], data: Any, *, schema_version: int) -> T:
    """Validate an already-decoded map (JSON or msgpack) into the frozen dataclass ``cls``.

    Raises:
        DecodeError: naming the message type and the offending field.
    """
    if not isinstance(data, dict):
        raise DecodeError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
    version = data.get("schema_version", schema_version)
    if not isinstance(version, int) or version > schema_version:
        raise DecodeError(f"{cls.__name__}: schema_version {version!r} is newer than this side understands ({schema_version}); upgrade "
                          "edgefleet")
    kwargs: dict[str, Any] = {}
    get = data.get
    for name, fast, check, in_bounds, required, annotation, bound in _plan(cls):
        value = get(name, _MISSING)
        if value is _MISSING:
            if required:
                raise DecodeError(f"{cls.__name__}: required field {name!r} is missing")
            continue
        if not fast(value):
            if not check(value):
                what = "a finite number" if isinstance(value, float) and not _isfinite(value) else annotation
                raise DecodeError(f"{cls.__name__}: field {name!r} should be {what}, got {_preview(value)}")
            if in_bounds is not None and bound is not None and not in_bounds(value):
                raise DecodeError(f"{cls.__name__}: field {name!r} {bound.problem(value)}")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ValueError as exc:  # a __post_init__ range check
        raise DecodeError(f"{cls.__name__}: {exc}") from None


def message_from_json(cls: type[T], payload: bytes | str, *, schema_version: int) -> T:
    """Decode a JSON message and validate it into the frozen dataclass ``cls``.

    Unknown keys are ignored, so that an older coordinator can read a newer agent's messages;
    a payload over :data:`MAX_JSON_BYTES` or nested deeper than :data:`MAX_JSON_DEPTH`, a missing
    required key, a wrong type, a non-finite number or a value outside the class's bounds raises.

    Raises:
        DecodeError: naming the message type and the offending field.
    """
    return message_from_dict(cls, load_json(payload, what=cls.__name__), schema_version=schema_version)


def message_to_json(message: Any) -> bytes:
    """Encode a message dataclass as compact JSON bytes."""
    return json.dumps(dataclasses.asdict(message), separators=(",", ":"), allow_nan=False).encode()
