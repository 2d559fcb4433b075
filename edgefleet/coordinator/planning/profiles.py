"""Board and fleet profiles: what `edge-coordinator profile` measured, and the lines fitted to it.

A board is profiled at two or more batch sizes of one model variant. From those points two
straight lines are fitted by least squares and used everywhere in the planner:

* step time (s) = ``time_intercept_s + time_per_sample_s * b`` (forward + backward of b samples);
* peak memory (bytes) = ``memory_base_bytes + memory_per_sample_bytes * b``.

The time line weighs each point by its precision, ``1 / spread^2``, the spread being the
point's own step-time spread (:attr:`BatchPoint.step_time_spread_s`) and at least
:data:`SPREAD_FLOOR` of its step time (a profile saved without spreads weighs every point by
its relative precision alone). A noisy point then bends the line less: on the emulated lab a Pi
4's steps at batch 64 spread 8x as far as at batch 8 (219 against 25 ms), and the unweighted
line through 8/32/64 predicted its step at the 6 samples the planner gave it 34 ms short,
enough to make it the straggler of every step it took part in.

Both lines are clamped so that predictions stay positive and do not fall as the batch grows
(noise at two close batch sizes can give a negative slope; a negative intercept would predict
a negative time for a small batch). The profile file is JSON with a ``schema_version``; a file
from another model, another variant or another agent version is refused by
:func:`check_compatible`, never silently reused.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgefleet.coordinator.planning.cut_profile import CutProfile
from edgefleet.coordinator.planning.unit_profile import UnitProfile
from edgefleet.protocol.errors import PlanError
from edgefleet.transport.atomic_file import write_atomically

log = logging.getLogger(__name__)

PROFILE_SCHEMA_VERSION = 1
PROFILE_KIND = "edgefleet.fleet-profile"
REPROFILE_HINT = "run `edge-coordinator profile` again"
# The least spread a profile point is taken to have, as a share of its step time: a point whose
# few timed steps happened to agree must not pin the line.
SPREAD_FLOOR = 0.02
# Options that change neither the step time nor the memory of a step; a profile stays valid when
# only these differ. (The optimizer does change memory: Adam keeps two moments per parameter.)
COST_NEUTRAL_OPTIONS = ("lr", "momentum")


@dataclass(frozen=True, slots=True)
class LineFit:
    """``y = intercept + slope * x``, fitted by least squares and clamped (see the module doc)."""

    intercept: float
    slope: float

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x


def fit_line(xs: Sequence[float], ys: Sequence[float], *, min_slope: float,
             weights: Sequence[float] | None = None) -> LineFit:
    """Least-squares line through the points, with ``slope >= min_slope`` and ``intercept >= 0``.

    If the unconstrained slope is below ``min_slope`` the slope is set to it and the intercept
    re-fitted; if the intercept is then negative the line is re-fitted through the origin.

    Args:
        xs: At least two distinct x values.
        ys: The measured values, same length.
        min_slope: The smallest slope allowed (0 for memory, a small positive value for time).
        weights: Each point's weight (positive; 1 / variance for inverse-variance weighting);
            None: all equal.
    """
    w = [1.0] * len(xs) if weights is None else list(weights)
    total = sum(w)
    mean_x = sum(wi * x for wi, x in zip(w, xs)) / total
    mean_y = sum(wi * y for wi, y in zip(w, ys)) / total
    sxx = sum(wi * (x - mean_x) ** 2 for wi, x in zip(w, xs))
    sxy = sum(wi * (x - mean_x) * (y - mean_y) for wi, x, y in zip(w, xs, ys))
    slope = max(sxy / sxx, min_slope)
    intercept = mean_y - slope * mean_x
    if intercept < 0:
        slope = max(sum(wi * x * y for wi, x, y in zip(w, xs, ys)) / sum(wi * x * x for wi, x in zip(w, xs)), min_slope)
        intercept = 0.0
    return LineFit(intercept, slope)


@dataclass(frozen=True, slots=True)
class BatchPoint:
    """One measured batch size on one board."""

    batch_size: int            # samples per step
    step_time_s: float         # median forward+backward time of one step (warm-up excluded)
    peak_memory_bytes: int     # peak resident memory of the training process during the steps
    # How far single steps stray from the median: 1.4826 x their median absolute deviation (a standard
    # deviation that ignores outliers); 0.0 where unknown (profiles saved before it was kept).
    step_time_spread_s: float = 0.0

    def __post_init__(self) -> None:
        if self.batch_size < 1 or not (math.isfinite(self.step_time_s) and self.step_time_s > 0) \
                or self.peak_memory_bytes < 0 or not (math.isfinite(self.step_time_spread_s) and self.step_time_spread_s >= 0):
            raise PlanError(f"invalid profile point {self}: need batch_size >= 1, step_time_s > 0, "
                            f"peak_memory_bytes >= 0, step_time_spread_s >= 0; {REPROFILE_HINT}")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BatchPoint:
        return cls(int(data["batch_size"]), float(data["step_time_s"]), int(data["peak_memory_bytes"]),
                   float(data.get("step_time_spread_s", 0.0)))


@dataclass(frozen=True, slots=True, kw_only=True)
class BoardProfile:
    """One board's measurements for one model variant, and the lines fitted to them."""

    board_id: str
    agent_version: str           # the agent that measured; a different one must re-profile
    model_key: str               # see model_key(): model spec + cost-relevant options + input shape
    points: tuple[BatchPoint, ...]   # at least two distinct batch sizes
    active_power_w: float        # draw while training (measured, or estimated: see power_source)
    idle_power_w: float          # draw while idle
    power_source: str            # "estimated" or the sensor ("jtop", "rpi5-pmic", "hwmon:ina219", "rapl")
    memory_total_bytes: int      # what the board's training process may use (RAM or cgroup limit)
    link_bytes_per_s: float      # measured throughput board -> exchange endpoint
    link_down_bytes_per_s: float | None = None  # endpoint -> board when measured apart; None = same
    link_power_w: float | None = None  # draw while moving bytes over the link (the probe's); None = idle
    link_round_bytes: int | None = None  # the probe's gradient-sized rounds: one frame's payload ...
    link_round_s: float | None = None    # ... and the median time of it up and back; None: not measured
    # The model's pipeline units as this board timed them, in forward order (planning.unit_profile); (): not
    # measured (an agent from before them, or a model that cannot be cut). Written only when measured.
    units: tuple[UnitProfile, ...] = ()
    time_fit: LineFit = field(init=False, repr=False, compare=False)
    memory_fit: LineFit = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "points", tuple(sorted(self.points, key=lambda p: p.batch_size)))
        sizes = {p.batch_size for p in self.points}
        if len(sizes) < 2:
            raise PlanError(f"board {self.board_id!r}: the profile has batch sizes {sorted(sizes)}; the planner "
                            f"needs at least two distinct batch sizes to fit a line. {REPROFILE_HINT.capitalize()}.")
        for name in ("active_power_w", "idle_power_w", "memory_total_bytes", "link_bytes_per_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (value == 0 and name != "idle_power_w"):
                raise PlanError(f"board {self.board_id!r}: {name} = {value} is not a usable figure; {REPROFILE_HINT}")
        if self.link_down_bytes_per_s is not None and not self.link_down_bytes_per_s > 0:
            raise PlanError(f"board {self.board_id!r}: link_down_bytes_per_s = {self.link_down_bytes_per_s}; {REPROFILE_HINT}")
        if self.link_power_w is not None and not (math.isfinite(self.link_power_w) and self.link_power_w >= 0):
            raise PlanError(f"board {self.board_id!r}: link_power_w = {self.link_power_w}; {REPROFILE_HINT}")
        if (self.link_round_bytes is None) != (self.link_round_s is None) or (
                self.link_round_s is not None and not (math.isfinite(self.link_round_s) and self.link_round_s > 0
                                                       and self.link_round_bytes is not None and self.link_round_bytes >= 1)):
            raise PlanError(f"board {self.board_id!r}: link_round_bytes = {self.link_round_bytes} and link_round_s = "
                            f"{self.link_round_s} must both be positive, or both absent; {REPROFILE_HINT}")
        if not self.power_source:
            raise PlanError(f"board {self.board_id!r}: power_source is empty (say 'estimated' or name the sensor)")
        xs = [float(p.batch_size) for p in self.points]
        times = [p.step_time_s for p in self.points]
        # Time must grow with the batch: at least 0.1% of the mean per-sample time, so that the
        # allocation can always divide samples by it.
        min_time_slope = 1e-3 * min(t / x for t, x in zip(times, xs))
        precision = [1.0 / max(p.step_time_spread_s, SPREAD_FLOOR * p.step_time_s) ** 2 for p in self.points]
        object.__setattr__(self, "time_fit", fit_line(xs, times, min_slope=min_time_slope, weights=precision))
        object.__setattr__(self, "memory_fit", fit_line(xs, [float(p.peak_memory_bytes) for p in self.points], min_slope=0.0))

    def step_time(self, batch_size: float) -> float:
        """Predicted forward+backward time (s) of one step of ``batch_size`` samples."""
        return self.time_fit(batch_size)

    def peak_memory(self, batch_size: float) -> float:
        """Predicted peak memory (bytes) at ``batch_size``."""
        return self.memory_fit(batch_size)

    def max_batch(self, max_memory_fraction: float) -> int:
        """The largest batch whose predicted peak memory is within ``max_memory_fraction`` of the total (0 if none)."""
        limit = self.memory_total_bytes * max_memory_fraction
        fit = self.memory_fit
        if fit.slope <= 0:
            return 2**31 - 1 if fit.intercept <= limit else 0
        return max(0, math.floor((limit - fit.intercept) / fit.slope))

    @property
    def up_s_per_byte(self) -> float:
        """Seconds per gradient byte for the board's upload (see :attr:`exchange_link_s_per_byte`)."""
        return self._round_scale() / self.link_bytes_per_s

    @property
    def down_s_per_byte(self) -> float:
        """Seconds per gradient byte for the board's download of the average."""
        return self._round_scale() / (self.link_down_bytes_per_s or self.link_bytes_per_s)

    @property
    def exchange_link_s_per_byte(self) -> float:
        """Seconds per gradient byte for the board's upload plus its download of the average.

        The bulk rates' figure, or, where the probe timed gradient-sized rounds, the round's own
        (``link_round_s / link_round_bytes``), split between up and down as the bulk rates are:
        a short transfer pays each round's wake-ups and enjoys a shaper's burst, which a bulk
        transfer averages away.
        """
        return self.up_s_per_byte + self.down_s_per_byte

    def _round_scale(self) -> float:
        """How much longer a gradient-sized round took than the bulk rates say (1.0 when not measured)."""
        if self.link_round_s is None or self.link_round_bytes is None:
            return 1.0
        down = self.link_down_bytes_per_s or self.link_bytes_per_s
        return self.link_round_s / (self.link_round_bytes * (1.0 / self.link_bytes_per_s + 1.0 / down))

    def to_json(self) -> dict[str, Any]:
        return {
            "board_id": self.board_id, "agent_version": self.agent_version, "model_key": self.model_key,
            "points": [{"batch_size": p.batch_size, "step_time_s": p.step_time_s,
                        "peak_memory_bytes": p.peak_memory_bytes, "step_time_spread_s": p.step_time_spread_s}
                       for p in self.points],
            "active_power_w": self.active_power_w, "idle_power_w": self.idle_power_w,
            "power_source": self.power_source, "memory_total_bytes": self.memory_total_bytes,
            "link_bytes_per_s": self.link_bytes_per_s, "link_down_bytes_per_s": self.link_down_bytes_per_s,
            "link_power_w": self.link_power_w, "link_round_bytes": self.link_round_bytes,
            "link_round_s": self.link_round_s,
            **({"units": [u.to_json() for u in self.units]} if self.units else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BoardProfile:
        fields = _known(data, ("board_id", "agent_version", "model_key", "points", "active_power_w", "idle_power_w",
                               "power_source", "memory_total_bytes", "link_bytes_per_s", "link_down_bytes_per_s",
                               "link_power_w", "link_round_bytes", "link_round_s", "units"),
                        "a board profile")
        points = tuple(BatchPoint.from_json(p) for p in fields.pop("points"))
        units = fields.pop("units", [])
        if not isinstance(units, list):
            raise PlanError(f"board {fields.get('board_id')!r}: its pipeline units are not a list; {REPROFILE_HINT}")
        return cls(points=points, units=tuple(UnitProfile.from_json(u) for u in units), **fields)


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetProfile:
    """Every profiled board for one model variant, plus what the exchange costs."""

    model_key: str                       # every board's profile must carry the same key
    grad_bytes: int                      # bytes of one gradient on the wire (parameters x wire dtype size)
    coordinator_link_bytes_per_s: float  # the exchange endpoint's own link
    dataset_len: int                     # training samples per epoch
    boards: dict[str, BoardProfile]      # by board id
    variant: dict[str, Any] = field(default_factory=dict)  # the model options this variant sets, e.g. {"layers": 3}
    cuts: tuple[CutProfile, ...] = ()    # layer placement's cuts, measured on the coordinator (planning.layer_profile)
    # Batches per optimizer step the boards were timed with (--accumulate-grad-batches): a step is this many
    # batches of each board's batch size, so it trains accumulate x the global batch (1: no accumulation).
    accumulate: int = 1

    def __post_init__(self) -> None:
        if not self.boards:
            raise PlanError("the fleet profile has no boards; " + REPROFILE_HINT)
        if type(self.accumulate) is not int or self.accumulate < 1:
            raise PlanError(f"fleet profile for {self.model_key}: accumulate = {self.accumulate!r:.20} must be a whole "
                            f"number >= 1; {REPROFILE_HINT}")
        if self.grad_bytes < 1 or not self.coordinator_link_bytes_per_s > 0 or self.dataset_len < 1:
            raise PlanError(f"fleet profile for {self.model_key}: grad_bytes = {self.grad_bytes}, "
                            f"coordinator_link_bytes_per_s = {self.coordinator_link_bytes_per_s}, "
                            f"dataset_len = {self.dataset_len} must all be positive")
        for board_id, board in self.boards.items():
            if board_id != board.board_id:
                raise PlanError(f"fleet profile lists board {board_id!r} with the profile of {board.board_id!r}")
            if board.model_key != self.model_key:
                raise PlanError(f"board {board_id!r} was profiled for {board.model_key}, the rest of the fleet for "
                                f"{self.model_key}; {REPROFILE_HINT} for all boards together")

    @property
    def agent_versions(self) -> dict[str, str]:
        return {b: p.agent_version for b, p in self.boards.items()}

    def select(self, board_ids: Iterable[str]) -> FleetProfile:
        """The same profile restricted to ``board_ids`` (e.g. the boards online now)."""
        wanted = list(board_ids)
        missing = [b for b in wanted if b not in self.boards]
        if missing:
            raise PlanError(f"no profile for board(s) {', '.join(missing)}; {REPROFILE_HINT} "
                            f"(or leave them out with --exclude)")
        return FleetProfile(model_key=self.model_key, grad_bytes=self.grad_bytes,
                            coordinator_link_bytes_per_s=self.coordinator_link_bytes_per_s,
                            dataset_len=self.dataset_len, boards={b: self.boards[b] for b in wanted},
                            variant=dict(self.variant), cuts=self.cuts, accumulate=self.accumulate)

    def to_json(self) -> dict[str, Any]:
        # accumulate only when not 1: a file without accumulation stays readable by an edgefleet before it
        return {"model_key": self.model_key, "variant": dict(self.variant), "grad_bytes": self.grad_bytes,
                "coordinator_link_bytes_per_s": self.coordinator_link_bytes_per_s, "dataset_len": self.dataset_len,
                "agent_versions": self.agent_versions, "boards": [b.to_json() for b in self.boards.values()],
                **({"cuts": [c.to_json() for c in self.cuts]} if self.cuts else {}),
                **({"accumulate": self.accumulate} if self.accumulate != 1 else {})}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FleetProfile:
        fields = _known(data, ("model_key", "variant", "grad_bytes", "coordinator_link_bytes_per_s", "dataset_len",
                               "agent_versions", "boards", "cuts", "accumulate"), "a fleet profile")
        boards = [BoardProfile.from_json(b) for b in fields.pop("boards")]
        cuts = fields.pop("cuts", [])
        if not isinstance(cuts, list):
            raise PlanError(f"the fleet profile's cuts are not a list: {REPROFILE_HINT}")
        fields["cuts"] = tuple(CutProfile.from_json(c) for c in cuts)
        versions = fields.pop("agent_versions", None)
        fleet = cls(boards={b.board_id: b for b in boards}, **fields)
        if versions is not None and versions != fleet.agent_versions:
            raise PlanError("the profile's agent_versions summary disagrees with its boards (edited by hand?); "
                            + REPROFILE_HINT)
        return fleet


def model_key(model: str, options: Mapping[str, Any], input_shape: Sequence[int]) -> str:
    """The string that identifies what a profile measured: model spec, options, one sample's shape.

    Options in :data:`COST_NEUTRAL_OPTIONS` (learning rate, momentum) are left out: they do not
    change the cost of a step, so a profile stays valid across them.

    Example: ``model_key("mlp", {"layers": 3, "lr": 0.01}, (1, 32, 32))`` is
    ``'mlp{"layers":3}[1,32,32]'``.
    """
    kept = {k: options[k] for k in sorted(options) if k not in COST_NEUTRAL_OPTIONS}
    return f"{model}{json.dumps(kept, sort_keys=True, separators=(',', ':'))}{list(map(int, input_shape))}".replace(" ", "")


def variant_label(variant: Mapping[str, Any]) -> str:
    """A short label for a variant's options: ``"layers=3,width=64"``, or ``"default"``."""
    return ",".join(f"{k}={variant[k]}" for k in sorted(variant)) or "default"


def check_compatible(profile: FleetProfile, model_key: str, agent_versions: Mapping[str, str]) -> None:
    """Refuse a profile that does not describe this job on these boards.

    Args:
        profile: The loaded profile of one variant.
        model_key: The key of the job's model for that variant (:func:`model_key`).
        agent_versions: The agent version each board to plan over reports now (from its caps).

    Raises:
        PlanError: naming what differs (model, a board's agent version, a board with no profile)
            and the fix.
    """
    problems = []
    if profile.model_key != model_key:
        problems.append(f"it was measured for {profile.model_key}, this job is {model_key}")
    for board_id, version in sorted(agent_versions.items()):
        board = profile.boards.get(board_id)
        if board is None:
            problems.append(f"board {board_id} has no profile")
        elif board.agent_version != version:
            problems.append(f"board {board_id} was profiled by agent {board.agent_version}, it now runs {version}")
    if problems:
        raise PlanError(f"the profile cannot be reused: {'; '.join(problems)}. {REPROFILE_HINT.capitalize()} "
                        f"(profiles are tied to one model variant and agent version).")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileMeta:
    """What a profile file as a whole measured; saved next to its variants.

    The job's settings that change a step's cost (``datamodule``, ``precision``,
    ``accumulate_grad_batches``) are written only when not the default, so that a plain profile's
    file stays readable by an edgefleet from before they were kept; a file without them was
    measured with the defaults.
    """

    model: str                       # the model spec, as given to `edge-coordinator profile --model`
    dataset: str                     # a dataset spec, or "" with a datamodule
    dataset_options: dict[str, Any] = field(default_factory=dict)
    wire_dtype: str = "float32"      # the gradient dtype grad_bytes was counted for
    batch_sizes: list[int] = field(default_factory=list)  # the batch sizes every board was measured at
    created: str = ""                # ISO 8601 time the profile was taken, e.g. "2026-11-21T10:15:00+00:00"
    datamodule: str = ""             # "pkg.mod:Class", the LightningDataModule measured instead of a dataset
    datamodule_options: dict[str, Any] = field(default_factory=dict)
    precision: str = "32-true"       # Lightning's precision the steps were timed at
    accumulate_grad_batches: int = 1  # batches per timed step (gradient accumulation)

    def to_json(self) -> dict[str, Any]:
        settings = {name: value for name, value, default in (
            ("datamodule", self.datamodule, ""), ("datamodule_options", dict(self.datamodule_options), {}),
            ("precision", self.precision, "32-true"), ("accumulate_grad_batches", self.accumulate_grad_batches, 1))
            if value != default}
        return {"model": self.model, "dataset": self.dataset, "dataset_options": dict(self.dataset_options),
                "wire_dtype": self.wire_dtype, "batch_sizes": list(self.batch_sizes), "created": self.created, **settings}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProfileMeta:
        fields = _known(data, ("model", "dataset", "dataset_options", "wire_dtype", "batch_sizes", "created",
                               "datamodule", "datamodule_options", "precision", "accumulate_grad_batches"),
                        "the profile's meta")
        return cls(**fields)

    @property
    def settings_text(self) -> str:
        """``--precision bf16-mixed --accumulate-grad-batches 2``: the measured settings as flags ("" for the defaults)."""
        return settings_flags(precision=self.precision, accumulate_grad_batches=self.accumulate_grad_batches)


def settings_flags(*, precision: str, accumulate_grad_batches: int) -> str:
    """The flags that give ``precision`` and ``accumulate_grad_batches``, leaving out the defaults ("" for both)."""
    flags = [f"--precision {precision}"] if precision != "32-true" else []
    if accumulate_grad_batches != 1:
        flags.append(f"--accumulate-grad-batches {accumulate_grad_batches}")
    return " ".join(flags)


def check_settings(meta: ProfileMeta | None, *, precision: str, accumulate_grad_batches: int) -> None:
    """Refuse a profile whose steps were timed with another precision or accumulation than the job's.

    A file without meta (or from before these were kept) was measured with the defaults.

    Raises:
        PlanError: naming both settings and the fix.
    """
    theirs = ("32-true", 1) if meta is None else (meta.precision, meta.accumulate_grad_batches)
    if theirs != (precision, accumulate_grad_batches):
        measured = settings_flags(precision=theirs[0], accumulate_grad_batches=theirs[1]) or "fp32 without accumulation"
        ours = settings_flags(precision=precision, accumulate_grad_batches=accumulate_grad_batches)
        raise PlanError(f"its steps were timed with {measured}, this job trains with "
                        f"{ours or 'fp32 without accumulation'}; {REPROFILE_HINT} with the job's settings")


def save_profiles(path: Path, profiles_by_variant: Mapping[str, FleetProfile], meta: ProfileMeta | None = None) -> None:
    """Write the profile file atomically (``transport.atomic_file``), with ``meta`` if given.

    Raises:
        AtomicWriteError: an OSError; the old file is unchanged.
    """
    doc: dict[str, Any] = {"schema_version": PROFILE_SCHEMA_VERSION, "kind": PROFILE_KIND,
                           "variants": {label: fleet.to_json() for label, fleet in profiles_by_variant.items()}}
    if meta is not None:
        doc["meta"] = meta.to_json()
    write_atomically(path, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())
    log.debug("wrote %d profile variant(s) to %s", len(profiles_by_variant), path)


def _read_profile_doc(path: Path) -> dict[str, Any]:
    """The profile file's JSON document, checked for kind and schema version.

    Raises:
        PlanError: the file is missing, not JSON, another kind of file, or of another schema version.
    """
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"no profile at {path}; run `edge-coordinator profile` first") from None
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read the profile {path}: {exc}; {REPROFILE_HINT}") from exc
    if not isinstance(doc, dict) or doc.get("kind") != PROFILE_KIND:
        raise PlanError(f"{path} is not an edgefleet profile file")
    if doc.get("schema_version") != PROFILE_SCHEMA_VERSION:
        raise PlanError(f"{path} has profile schema_version {doc.get('schema_version')}, this edgefleet reads "
                        f"{PROFILE_SCHEMA_VERSION}; {REPROFILE_HINT}")
    return doc


def load_profiles(path: Path) -> dict[str, FleetProfile]:
    """Read a profile file written by :func:`save_profiles`.

    Raises:
        PlanError: the file is missing, not JSON, another kind of file, or of another schema version.
    """
    doc = _read_profile_doc(path)
    try:
        return {label: FleetProfile.from_json(fleet) for label, fleet in doc["variants"].items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"{path} is malformed ({type(exc).__name__}: {exc}); {REPROFILE_HINT}") from exc


def load_profile_meta(path: Path) -> ProfileMeta | None:
    """The meta saved with the profile file (model, dataset, wire dtype, batch sizes, time), or None.

    Raises:
        PlanError: the file cannot be read (as :func:`load_profiles`) or its meta is malformed.
    """
    meta = _read_profile_doc(path).get("meta")
    if meta is None:
        return None
    try:
        return ProfileMeta.from_json(meta)
    except (AttributeError, TypeError, ValueError) as exc:
        raise PlanError(f"{path}: the profile's meta is malformed ({type(exc).__name__}: {exc}); {REPROFILE_HINT}") from exc


def _known(data: Mapping[str, Any], names: tuple[str, ...], what: str) -> dict[str, Any]:
    unknown = set(data) - set(names)
    if unknown:
        raise PlanError(f"{what} has unknown keys {sorted(unknown)} (written by a newer edgefleet?); {REPROFILE_HINT}")
    return dict(data)
