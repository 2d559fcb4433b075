"""Type checks for JSON-decoded messages, driven by the dataclasses' own annotations."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, TypeVar

from protocol.errors import DecodeError

T = TypeVar("T")

# Every annotation a JSON message field may use, mapped to a checker.
_SCALARS: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
}


def _is(value: Any, kind: str) -> bool:
    types = _SCALARS[kind]
    if isinstance(value, bool) and kind != "bool":
        return False
    if kind == "float" and isinstance(value, float) and not math.isfinite(value):
        return False
    return isinstance(value, types)


def _check(value: Any, annotation: str) -> bool:
    annotation = annotation.replace(" ", "")
    if annotation == "Any":  # an option value: a scalar, never a nested structure
        return value is None or isinstance(value, (str, int, float, bool))
    if annotation.endswith("|None"):
        return value is None or _check(value, annotation[: -len("|None")])
    if annotation in _SCALARS:
        return _is(value, annotation)
    if annotation.startswith("list[") and annotation.endswith("]"):
        inner = annotation[5:-1]
        return isinstance(value, list) and all(_check(v, inner) for v in value)
    if annotation.startswith("dict[str,") and annotation.endswith("]"):
        inner = annotation[len("dict[str,"):-1]
        return isinstance(value, dict) and all(isinstance(k, str) and _check(v, inner) for k, v in value.items())
    raise TypeError(f"unsupported annotation {annotation!r} in a wire message")


def message_from_json(cls: type[T], payload: bytes | str, *, schema_version: int) -> T:
    """Decode a JSON message and validate it into the frozen dataclass ``cls``.

    Unknown keys are ignored, so that an older coordinator can read a newer agent's messages;
    a missing required key, a wrong type or a non-finite number raises.

    Raises:
        DecodeError: naming the message type and the offending field.
    """
    name = cls.__name__
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, ValueError) as exc:
        raise DecodeError(f"{name}: not valid JSON ({exc})") from None
    return message_from_dict(cls, data, schema_version=schema_version)


def message_from_dict(cls: type[T], data: Any, *, schema_version: int) -> T:
    """Validate an already-decoded map (JSON or msgpack) into the frozen dataclass ``cls``.

    Raises:
        DecodeError: naming the message type and the offending field.
    """
    name = cls.__name__
    if not isinstance(data, dict):
        raise DecodeError(f"{name}: expected a JSON object, got {type(data).__name__}")
    version = data.get("schema_version", schema_version)
    if not isinstance(version, int) or version > schema_version:
        raise DecodeError(f"{name}: schema_version {version!r} is newer than this side understands ({schema_version}); upgrade edgefleet")
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name not in data:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise DecodeError(f"{name}: required field {field.name!r} is missing")
            continue
        value = data[field.name]
        if not _check(value, str(field.type)):
            raise DecodeError(f"{name}: field {field.name!r} should be {field.type}, got {value!r:.60}")
        kwargs[field.name] = value
    try:
        return cls(**kwargs)
    except ValueError as exc:  # a __post_init__ range check
        raise DecodeError(f"{name}: {exc}") from None


def message_to_json(message: Any) -> bytes:
    """Encode a message dataclass as compact JSON bytes."""
    return json.dumps(dataclasses.asdict(message), separators=(",", ":"), allow_nan=False).encode()
