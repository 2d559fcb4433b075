"""Type checks for decoded messages, compiled once per dataclass from its own annotations.

The fleet view validates every telemetry message it folds (thousands per second), so each field's
check is built once per class and is a plain function call per message.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any, TypeVar

from edgefleet.protocol.errors import DecodeError

T = TypeVar("T")
Check = Callable[[Any], bool]
_isfinite = math.isfinite
_NUMBER_TYPES = frozenset((int, float))   # exact types: bool (an int subclass) is not one


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
        return all(map(_isfinite, values))
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


_PLANS: dict[type, tuple[tuple[str, Check, bool, str], ...]] = {}


def _plan(cls: type) -> tuple[tuple[str, Check, bool, str], ...]:
    """(name, checker, required, annotation) per field of ``cls``; computed on first use."""
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = tuple(
            (f.name, _compile(str(f.type)),
             f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, str(f.type))
            for f in dataclasses.fields(cls))
    return plan


_MISSING = object()


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
    for name, check, required, annotation in _plan(cls):
        value = get(name, _MISSING)
        if value is _MISSING:
            if required:
                raise DecodeError(f"{cls.__name__}: required field {name!r} is missing")
            continue
        if not check(value):
            raise DecodeError(f"{cls.__name__}: field {name!r} should be {annotation}, got {value!r:.60}")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ValueError as exc:  # a __post_init__ range check
        raise DecodeError(f"{cls.__name__}: {exc}") from None


def message_from_json(cls: type[T], payload: bytes | str, *, schema_version: int) -> T:
    """Decode a JSON message and validate it into the frozen dataclass ``cls``.

    Unknown keys are ignored, so that an older coordinator can read a newer agent's messages;
    a missing required key, a wrong type or a non-finite number raises.

    Raises:
        DecodeError: naming the message type and the offending field.
    """
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, ValueError) as exc:
        raise DecodeError(f"{cls.__name__}: not valid JSON ({exc})") from None
    return message_from_dict(cls, data, schema_version=schema_version)


def message_to_json(message: Any) -> bytes:
    """Encode a message dataclass as compact JSON bytes."""
    return json.dumps(dataclasses.asdict(message), separators=(",", ":"), allow_nan=False).encode()
