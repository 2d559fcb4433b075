"""The pipeline a signed train command carries (issue 35): the cuts, the micro-batches and each stage's host.

A pipelined job cuts the model into S stages, one board a stage (``workloads.stage_cut``); every
stage host is sent the same :class:`PipelineSpec` in its ``TrainCommand.pipeline``, so each knows
where its neighbours listen and which Ed25519 public key their certificates and hellos must prove
(``agent.stage_links``). The host is the board's reachable address (``BoardCaps.address``: its
config's ``[training] address``, else the local end of its broker connection).

On the wire the spec is a plain map of lists and scalars (msgpack inside the signed command), so it
is checked here field by field: a malformed or hostile map is refused with one line naming the field,
never half used. Keys this side does not know are ignored, as every control-plane message's are
(docs/protocol.md); a key that changes what a board does comes with a new train command version.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edgefleet.protocol.bounds import short_repr
from edgefleet.protocol.messages import MAX_ADDRESS_CHARS
from edgefleet.protocol.stage_frames import MAX_GROUP, MAX_MICRO_BATCHES, MAX_STAGES
from edgefleet.protocol.topics import valid_board_id

MIN_STAGES = 2               # one stage is plain training: no pipeline
MAX_CUT_CHARS = 200          # a layer's dotted name (as TrainCommand.placement)
MAX_SHAPE_DIMS = 6           # a stage's output per sample: (features,) up to e.g. (C, T, H, W, ...)
MAX_DIM = (1 << 31) - 1      # one dimension of a stage's output, or max_rows: far above any board's memory
_PUBLIC_KEY = re.compile(r"[0-9a-f]{64}")  # an Ed25519 public key in lowercase hex (fullmatch)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A value in a refusal: a scalar in at most 40 characters, a container by its type (never a hostile map's repr)."""
    if value is None or isinstance(value, (str, bytes, int, float)):
        return short_repr(value)
    return f"a {type(value).__name__}"


def _list(value: Any, field: str, *, low: int, high: int) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"pipeline.{field} should be a list, got {type(value).__name__}")
    if not low <= len(value) <= high:
        raise ValueError(f"pipeline.{field} has {len(value)} entries; it should have {low} to {high}")
    return value


def _whole(value: Any, field: str, *, low: int, high: int) -> int:
    if not _is_int(value) or not low <= value <= high:
        raise ValueError(f"pipeline.{field} = {_shown(value)} should be a whole number from {low} to {high}")
    return int(value)


def _text(value: Any, field: str, *, max_chars: int) -> str:
    if not isinstance(value, str) or not value or len(value) > max_chars or not value.isprintable() or \
            any(c.isspace() for c in value):
        raise ValueError(f"pipeline.{field} = {_shown(value)} should be a non-empty text of at most {max_chars} "
                         "characters without spaces")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelinePeer:
    """One stage's host: its board, where it listens for its neighbours, and the key they check it by."""

    board_id: str                   # the board that runs this stage
    host: str                       # its reachable address (an IP address or a host name)
    port: int                       # where its stage endpoint listens
    public_key: str                 # the board's Ed25519 public key, 64 lowercase hex digits

    def __post_init__(self) -> None:
        _check_peer(self.board_id, self.host, self.port, self.public_key, field="stages[]")

    def to_dict(self) -> dict[str, Any]:
        return {"board_id": self.board_id, "host": self.host, "port": self.port, "public_key": self.public_key}

    @classmethod
    def from_dict(cls, data: Any, *, field: str = "stages[]") -> PipelinePeer:
        """Raises ValueError naming ``field`` (e.g. ``stages[1]``) and what is wrong."""
        if not isinstance(data, Mapping):
            raise ValueError(f"pipeline.{field} should be a map, got {type(data).__name__}")
        for name in ("board_id", "host", "port", "public_key"):
            if name not in data:
                raise ValueError(f"pipeline.{field}.{name} is missing")
        # Checked first with the entry's place in the list, which the constructor's own check cannot name.
        _check_peer(data["board_id"], data["host"], data["port"], data["public_key"], field=field)
        return cls(board_id=data["board_id"], host=data["host"], port=data["port"], public_key=data["public_key"])


def _check_peer(board_id: Any, host: Any, port: Any, public_key: Any, *, field: str) -> None:
    """A stage host's fields. Raises ValueError naming ``pipeline.<field>.<name>``."""
    if not isinstance(board_id, str) or not valid_board_id(board_id):
        raise ValueError(f"pipeline.{field}.board_id = {_shown(board_id)} is not a board id (1-63 letters, digits, "
                         "'.', '_' or '-')")
    _text(host, f"{field}.host", max_chars=MAX_ADDRESS_CHARS)
    _whole(port, f"{field}.port", low=1, high=65535)
    if not isinstance(public_key, str) or not _PUBLIC_KEY.fullmatch(public_key):
        raise ValueError(f"pipeline.{field}.public_key = {_shown(public_key)} is not an Ed25519 public key "
                         "(64 lowercase hex digits)")


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSpec:
    """A model cut into S stages trained GPipe-style: what every stage's board is told. Stage 0 is a group of
    ``group`` boards, data-parallel among them (each with its slice of the global batch); every later stage one
    board, or with ``groups`` (each stage's board count, stage 0's first) a group of its own, whose boards share the
    step's micro-batches out (``protocol.stage_routes``).

    Raises:
        ValueError: on construction, naming the field that is wrong (``pipeline.<field>``).
    """

    cuts: list[str]                 # the S - 1 layers the model is cut after (workloads.stage_cut)
    micro_batches: int              # M: the micro-batches a step's batch is split into
    stages: list[PipelinePeer]      # stage 0's group, then one board per later stage: group + S - 1 boards
    shapes: list[list[int]]         # each stage's output shape per sample, in stage order
    max_rows: int                   # the most samples a micro-batch holds (bounds every stage frame)
    group: int = 1                  # stage 0's boards (they hold the data)
    # 0: every later stage's board sends its gradient every step; N: its state every N steps and at epoch ends,
    # nothing at the other steps (``protocol.stage_sync``)
    state_every: int = 0
    # each stage's boards, stage 0's group first (S entries summing to len(stages)); []: one board a later stage
    groups: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        stages = _list(self.stages, "stages", low=MIN_STAGES, high=MAX_STAGES * MAX_GROUP)
        group = _whole(self.group, "group", low=1, high=min(MAX_GROUP, len(stages) - 1))
        groups = _list(self.groups, "groups", low=0, high=MAX_STAGES)
        for index, size in enumerate(groups):
            _whole(size, f"groups[{index}]", low=1, high=MAX_GROUP)
        if groups and (len(groups) < MIN_STAGES or groups[0] != group or sum(groups) != len(stages)):
            raise ValueError(f"pipeline.groups {groups!s:.80} should give each of at least {MIN_STAGES} stages its "
                             f"boards, stage 0's {group} first, {len(stages)} in all")
        count = len(groups) if groups else len(stages) - group + 1  # S
        if count > MAX_STAGES:
            raise ValueError(f"pipeline.stages makes {count} stages (after stage 0's group of {group}); at most "
                             f"{MAX_STAGES}")
        for index, peer in enumerate(stages):
            if not isinstance(peer, PipelinePeer):
                raise ValueError(f"pipeline.stages[{index}] should be a PipelinePeer, got {type(peer).__name__}")
        seen: dict[str, int] = {}
        for index, peer in enumerate(stages):
            if peer.board_id in seen:
                raise ValueError(f"pipeline.stages: board {peer.board_id!r} is listed at {seen[peer.board_id]} and "
                                 f"{index}; a board runs one stage")
            seen[peer.board_id] = index
        cuts = _list(self.cuts, "cuts", low=0, high=MAX_STAGES)
        if len(cuts) != count - 1:
            raise ValueError(f"pipeline.cuts has {len(cuts)} entries for {count} stages; it should have {count - 1}")
        for index, cut in enumerate(cuts):
            if not isinstance(cut, str) or not cut or len(cut) > MAX_CUT_CHARS:
                raise ValueError(f"pipeline.cuts[{index}] = {_shown(cut)} is not a layer's name (1-{MAX_CUT_CHARS} "
                                 "characters)")
        if len(set(cuts)) != len(cuts):
            twice = next(cut for cut in cuts if cuts.count(cut) > 1)
            raise ValueError(f"pipeline.cuts names the layer {short_repr(twice)} twice")
        _whole(self.micro_batches, "micro_batches", low=1, high=MAX_MICRO_BATCHES)
        _whole(self.max_rows, "max_rows", low=1, high=MAX_DIM)
        _whole(self.state_every, "state_every", low=0, high=MAX_DIM)
        shapes = _list(self.shapes, "shapes", low=0, high=MAX_STAGES)
        if len(shapes) != count:
            raise ValueError(f"pipeline.shapes has {len(shapes)} entries for {count} stages; it should have {count}")
        for index, shape in enumerate(shapes):
            _list(shape, f"shapes[{index}]", low=1, high=MAX_SHAPE_DIMS)
            for axis, dim in enumerate(shape):
                _whole(dim, f"shapes[{index}][{axis}]", low=1, high=MAX_DIM)

    @property
    def stage_count(self) -> int:
        """S, the number of stages."""
        return len(self.sizes)

    @property
    def sizes(self) -> list[int]:
        """Each stage's boards, stage 0's group first."""
        return list(self.groups) if self.groups else [self.group] + [1] * (len(self.stages) - self.group)

    @property
    def later_groups(self) -> bool:
        """Whether a stage after the first has more than one board."""
        return any(size > 1 for size in self.sizes[1:])

    def stage_of(self, index: int) -> int:
        """The stage of the ``index``-th board of :attr:`stages`."""
        return stage_and_member(self.sizes, index)[0]

    def member_of(self, index: int) -> int:
        """The ``index``-th board's place in its stage's group."""
        return stage_and_member(self.sizes, index)[1]

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain maps, lists and scalars (what ``TrainCommand.pipeline`` holds)."""
        return {"cuts": list(self.cuts), "micro_batches": self.micro_batches,
                "stages": [peer.to_dict() for peer in self.stages], "shapes": [list(s) for s in self.shapes],
                "max_rows": self.max_rows, "group": self.group, "state_every": self.state_every,
                **({"groups": list(self.groups)} if self.later_groups else {})}

    @classmethod
    def from_dict(cls, data: Any) -> PipelineSpec:
        """The spec a decoded map describes.

        Raises:
            ValueError: one line naming the field that is missing or wrong.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"pipeline should be a map, got {type(data).__name__}")
        for name in ("cuts", "micro_batches", "stages", "shapes", "max_rows"):
            if name not in data:
                raise ValueError(f"pipeline.{name} is missing")
        stages = _list(data["stages"], "stages", low=MIN_STAGES, high=MAX_STAGES * MAX_GROUP)
        peers = [PipelinePeer.from_dict(peer, field=f"stages[{index}]") for index, peer in enumerate(stages)]
        cuts, shapes = data["cuts"], data["shapes"]  # copied: the spec shares no list with the map it came from
        if isinstance(shapes, list):
            shapes = [list(shape) if isinstance(shape, list) else shape for shape in shapes]
        return cls(cuts=list(cuts) if isinstance(cuts, list) else cuts, micro_batches=data["micro_batches"],
                   stages=peers, shapes=shapes, max_rows=data["max_rows"], group=data.get("group", 1),
                   state_every=data.get("state_every", 0), groups=_copied(data.get("groups", [])))


def _copied(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


def stage_and_member(sizes: list[int], index: int) -> tuple[int, int]:
    """The stage of the ``index``-th board of a pipeline whose stages have ``sizes`` boards, and its place there."""
    for stage, size in enumerate(sizes):
        if index < size:
            return stage, index
        index -= size
    raise IndexError(f"board {index} is beyond the pipeline's {sum(sizes)} boards")


__all__ = ["MAX_CUT_CHARS", "MAX_SHAPE_DIMS", "MIN_STAGES", "PipelinePeer", "PipelineSpec", "stage_and_member"]
