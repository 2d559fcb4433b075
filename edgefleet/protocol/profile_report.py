"""The profile report: what a board's profile job sends the coordinator in its ``finished`` event's ``data``.

One :class:`ProfileReport` per model variant and board: the step times, peak memory and power at
each batch size profiled (:class:`MeasuredPoint`), the board's power and memory, and the link
probe's figures (:class:`LinkReport` for the bulk transfers of a board's first job,
:class:`RoundsReport` for the gradient-sized rounds) and, where the model can be cut, each pipeline
unit's forward and backward times and bytes (:class:`UnitReport`, ``units``). ``to_wire()``
gives the plain map the event carries (msgpack, finite numbers only); ``from_wire(d)`` validates
one and raises ``DecodeError`` naming the field.

:data:`PROFILE_REPORT_VERSION` is the one version of this layout; the report carries it as ``v``.
A report of another version is refused with :class:`ProfileReportVersionError`, whose message says
which side to upgrade. A report without ``v`` is version 1.

``units`` was added without a new version: it is optional (absent when empty, so an older agent's
report reads as no units), and a coordinator from before it ignores the key, as it ignores any key
it does not know, and plans with the stand-ins it always used; no figure it does read changes
meaning. A new version would only make such a coordinator refuse every newer board's profile.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from edgefleet.protocol.errors import DecodeError, ProtocolError
from edgefleet.protocol.frame_fields import is_int

PROFILE_REPORT_VERSION: Final = 1
MAX_POINTS = 64  # batch sizes in one report (a profile command allows fewer)
MAX_UNITS = 64   # pipeline units in one report: a model cut in more is reported without them (the event's size)


class ProfileReportVersionError(ProtocolError):
    """A profile report of another version; the message says which side to upgrade."""


def _map(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise DecodeError(f"{what} is a {type(value).__name__}, not a map")
    return value


def _whole(d: Mapping[str, Any], what: str, key: str, *, minimum: int = 0) -> int:
    value = d.get(key)
    if not is_int(value) or value < minimum:
        raise DecodeError(f"{what}: {key} {value!r:.40} is not a whole number >= {minimum}")
    return value


def _number(d: Mapping[str, Any], what: str, key: str, *, positive: bool = False) -> float:
    value = d.get(key)
    if not (is_int(value) or type(value) is float) or not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise DecodeError(f"{what}: {key} {value!r:.40} is not a finite number {'> 0' if positive else '>= 0'}")
    return float(value)


def _number_or_none(d: Mapping[str, Any], what: str, key: str) -> float | None:
    return None if d.get(key) is None else _number(d, what, key)


def _text(d: Mapping[str, Any], what: str, key: str) -> str:
    value = d.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= 200:
        raise DecodeError(f"{what}: {key} {value!r:.40} is not a short string")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredPoint:
    """One batch size's figures: the median step and its spread, samples per second, peak memory and power."""

    batch_size: int
    step_time_s: float          # median period of the timed steps
    step_time_min_s: float
    step_time_max_s: float
    step_time_spread_s: float   # 1.4826 x the median absolute deviation of the periods
    samples_per_s: float
    peak_memory_bytes: int
    power_w: float              # during the timed steps

    def to_wire(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "step_time_s": self.step_time_s, "step_time_min_s": self.step_time_min_s,
                "step_time_max_s": self.step_time_max_s, "step_time_spread_s": self.step_time_spread_s,
                "samples_per_s": self.samples_per_s, "peak_memory_bytes": self.peak_memory_bytes, "power_w": self.power_w}

    @classmethod
    def from_wire(cls, d: Any) -> MeasuredPoint:
        what = "a profile point"
        d = _map(d, what)
        return cls(batch_size=_whole(d, what, "batch_size", minimum=1),
                   step_time_s=_number(d, what, "step_time_s", positive=True),
                   step_time_min_s=_number(d, what, "step_time_min_s"), step_time_max_s=_number(d, what, "step_time_max_s"),
                   step_time_spread_s=_number(d, what, "step_time_spread_s"), samples_per_s=_number(d, what, "samples_per_s"),
                   peak_memory_bytes=_whole(d, what, "peak_memory_bytes"), power_w=_number(d, what, "power_w"))


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkReport:
    """The bulk link probe: ``nbytes`` up, then down, between this board alone and the coordinator."""

    up_bytes_per_s: float
    down_bytes_per_s: float
    nbytes: int
    power_w: float | None       # the board's draw while the bytes moved; None: no meter

    def to_wire(self) -> dict[str, Any]:
        return {"up_bytes_per_s": self.up_bytes_per_s, "down_bytes_per_s": self.down_bytes_per_s, "bytes": self.nbytes,
                "power_w": self.power_w}

    @classmethod
    def from_wire(cls, d: Any) -> LinkReport:
        what = "the link report"
        d = _map(d, what)
        return cls(up_bytes_per_s=_number(d, what, "up_bytes_per_s", positive=True),
                   down_bytes_per_s=_number(d, what, "down_bytes_per_s", positive=True),
                   nbytes=_whole(d, what, "bytes", minimum=1), power_w=_number_or_none(d, what, "power_w"))


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundsReport:
    """The link probe's rounds: a ``round_bytes`` frame up and straight back, median of ``rounds`` timed ones."""

    round_bytes: int
    rounds: int
    round_s: float
    power_w: float | None       # the board's draw during the timed rounds; None: no meter

    def to_wire(self) -> dict[str, Any]:
        return {"round_bytes": self.round_bytes, "rounds": self.rounds, "round_s": self.round_s, "power_w": self.power_w}

    @classmethod
    def from_wire(cls, d: Any) -> RoundsReport:
        what = "the link rounds report"
        d = _map(d, what)
        return cls(round_bytes=_whole(d, what, "round_bytes", minimum=1), rounds=_whole(d, what, "rounds", minimum=1),
                   round_s=_number(d, what, "round_s", positive=True), power_w=_number_or_none(d, what, "power_w"))


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitReport:
    """One pipeline unit (the layers between two admissible cuts of the model) as the board timed it.

    Its times are lines ``intercept + per_sample * n`` through the unit's median forward (and
    backward) at two batch sizes; its bytes are per sample (the growth from one batch size to the
    other), so a tensor kept whatever the batch is not counted.
    """

    name: str                         # the unit's last layer: the cut that ends it, or the model's last one
    forward_intercept_s: float
    forward_s_per_sample: float
    backward_intercept_s: float       # backward from the unit's output gradient to its input's (and parameters')
    backward_s_per_sample: float
    param_bytes: int
    activation_bytes_per_sample: int  # its output: what crosses the cut after it
    held_bytes_per_sample: int        # what its forward saves for its backward (its parameters left out)

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "forward_intercept_s": self.forward_intercept_s,
                "forward_s_per_sample": self.forward_s_per_sample, "backward_intercept_s": self.backward_intercept_s,
                "backward_s_per_sample": self.backward_s_per_sample, "param_bytes": self.param_bytes,
                "activation_bytes_per_sample": self.activation_bytes_per_sample,
                "held_bytes_per_sample": self.held_bytes_per_sample}

    @classmethod
    def from_wire(cls, d: Any) -> UnitReport:
        what = "a pipeline unit"
        d = _map(d, what)
        return cls(name=_text(d, what, "name"), forward_intercept_s=_number(d, what, "forward_intercept_s"),
                   forward_s_per_sample=_number(d, what, "forward_s_per_sample"),
                   backward_intercept_s=_number(d, what, "backward_intercept_s"),
                   backward_s_per_sample=_number(d, what, "backward_s_per_sample"),
                   param_bytes=_whole(d, what, "param_bytes"),
                   activation_bytes_per_sample=_whole(d, what, "activation_bytes_per_sample"),
                   held_bytes_per_sample=_whole(d, what, "held_bytes_per_sample"))


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileReport:
    """One board's measurements of one model variant (``points`` in ascending batch size)."""

    agent_version: str
    worker_pid: int
    torch_threads: int
    param_count: int            # trainable parameters of the variant as the board built it
    points: tuple[MeasuredPoint, ...]
    active_power_w: float       # the timed steps' draw, weighted by their time
    idle_power_w: float
    power_source: str           # "estimated" or the sensor
    memory_total_bytes: int     # what the training process may use (RAM or cgroup limit)
    link: LinkReport | None = None          # the bulk probe: a board's first job only
    link_rounds: RoundsReport | None = None  # the rounds probe, when the job asked for rounds
    units: tuple[UnitReport, ...] = ()       # the model's pipeline units in forward order; (): not measured
    v: int = PROFILE_REPORT_VERSION

    def to_wire(self) -> dict[str, Any]:
        return {"v": self.v, "agent_version": self.agent_version, "worker_pid": self.worker_pid,
                "torch_threads": self.torch_threads, "param_count": self.param_count,
                "points": [point.to_wire() for point in self.points], "active_power_w": self.active_power_w,
                "idle_power_w": self.idle_power_w, "power_source": self.power_source,
                "memory_total_bytes": self.memory_total_bytes,
                "link": None if self.link is None else self.link.to_wire(),
                "link_rounds": None if self.link_rounds is None else self.link_rounds.to_wire(),
                **({"units": [unit.to_wire() for unit in self.units]} if self.units else {})}

    @classmethod
    def from_wire(cls, d: Any) -> ProfileReport:
        """Raises:
            ProfileReportVersionError: a report of another version (the message says which side to upgrade).
            DecodeError: not a report, or a field missing or of the wrong type or range.
        """
        what = "the profile report"
        d = _map(d, what)
        v = d.get("v", 1)
        if not is_int(v):
            raise DecodeError(f"{what} names no version (v = {v!r:.20})")
        if v != PROFILE_REPORT_VERSION:
            upgrade = "edge-coordinator" if v > PROFILE_REPORT_VERSION else "edge-agent on the board"
            raise ProfileReportVersionError(f"the board reports its profile in version {v}, this coordinator reads "
                                            f"{PROFILE_REPORT_VERSION}: upgrade {upgrade}")
        points = d.get("points")
        if not isinstance(points, list) or not 0 < len(points) <= MAX_POINTS:
            raise DecodeError(f"{what}: points is not a list of 1-{MAX_POINTS} batch sizes")
        link, rounds = d.get("link"), d.get("link_rounds")
        units = d.get("units", [])
        if not isinstance(units, list) or len(units) > MAX_UNITS:
            raise DecodeError(f"{what}: units is not a list of at most {MAX_UNITS} pipeline units")
        return cls(agent_version=_text(d, what, "agent_version"), worker_pid=_whole(d, what, "worker_pid"),
                   torch_threads=_whole(d, what, "torch_threads", minimum=1), param_count=_whole(d, what, "param_count"),
                   points=tuple(sorted((MeasuredPoint.from_wire(p) for p in points), key=lambda p: p.batch_size)),
                   active_power_w=_number(d, what, "active_power_w"), idle_power_w=_number(d, what, "idle_power_w"),
                   power_source=_text(d, what, "power_source"), memory_total_bytes=_whole(d, what, "memory_total_bytes"),
                   link=None if link is None else LinkReport.from_wire(link),
                   link_rounds=None if rounds is None else RoundsReport.from_wire(rounds),
                   units=tuple(UnitReport.from_wire(u) for u in units), v=v)


__all__ = [
    "MAX_UNITS",
    "PROFILE_REPORT_VERSION",
    "LinkReport",
    "MeasuredPoint",
    "ProfileReport",
    "ProfileReportVersionError",
    "RoundsReport",
    "UnitReport",
]
