"""The train command's pipeline (issue 35): a signed map every stage host reads, checked field by field."""

from __future__ import annotations

import copy
from typing import Any

import msgpack
import pytest

from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.jobs import (
    PIPELINE_TRAIN_SCHEMA_VERSION,
    STAGE_GROUPS_TRAIN_SCHEMA_VERSION,
    STAGE_SYNC_TRAIN_SCHEMA_VERSION,
    TRAIN_SCHEMA_VERSION,
    TrainCommand,
    command_from_dict,
)
from edgefleet.protocol.pipeline_command import PipelinePeer, PipelineSpec

KEYS = ["0" * 63 + "a", "1" * 64, "ab" * 32]
SPEC: dict[str, Any] = {
    "cuts": ["net.2", "net.8"],
    "micro_batches": 4,
    "stages": [{"board_id": f"stage-{k}", "host": host, "port": 7000 + k, "public_key": KEYS[k]}
               for k, host in enumerate(["192.168.1.21", "pi-2.lab", "fe80::1%eth0"])],
    "shapes": [[6, 14, 14], [120], [10]],
    "max_rows": 16,
}
BASE: dict[str, Any] = {"kind": "train", "job_id": "j", "board_id": "stage-1", "exchange_host": "127.0.0.1",
                        "exchange_port": 9000, "token": "", "model": "lenet5", "dataset": "digits", "board_index": 1,
                        "batch_sizes": [16, 0, 0], "seed": 1, "total_steps": 10, "pipeline": SPEC}


def _spec(**change: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec.update(change)
    return spec


def _peer(index: int, **change: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["stages"][index].update(change)
    return spec


def test_a_pipelined_command_round_trips_through_the_signed_bytes() -> None:
    command = TrainCommand(**{k: v for k, v in BASE.items() if k != "kind"})
    assert command.schema_version == TRAIN_SCHEMA_VERSION == STAGE_GROUPS_TRAIN_SCHEMA_VERSION == 11
    wire = msgpack.unpackb(msgpack.packb(command.to_dict(), use_bin_type=True))  # as the signed body travels
    back = command_from_dict(wire)
    assert back == command and isinstance(back, TrainCommand)
    spec = back.pipeline_spec
    assert spec is not None and spec.stage_count == 3 and spec.micro_batches == 4 and spec.max_rows == 16
    assert spec.stages[2] == PipelinePeer(board_id="stage-2", host="fe80::1%eth0", port=7002, public_key=KEYS[2])
    assert spec.shapes == [[6, 14, 14], [120], [10]] and spec.cuts == ["net.2", "net.8"]
    assert spec.to_dict() == {**SPEC, "group": 1, "state_every": 0} and PipelineSpec.from_dict(spec.to_dict()) == spec


def test_stage_0_may_be_a_group_of_boards_each_with_its_slice_of_the_batch() -> None:
    stages = [*SPEC["stages"], {"board_id": "stage-3", "host": "10.0.0.4", "port": 7003, "public_key": KEYS[0]}]
    pipeline = _spec(stages=stages, group=2)  # stage-0 and stage-1 hold the data; stage-2 and stage-3 one stage each
    command = command_from_dict({**BASE, "pipeline": pipeline, "batch_sizes": [8, 12, 0, 0]})
    spec = command.pipeline_spec
    assert spec is not None and spec.group == 2 and spec.stage_count == 3
    assert [spec.stage_of(i) for i in range(4)] == [0, 0, 1, 2]
    with pytest.raises(DecodeError, match=r"should be stage 0's 2 batch size\(s\)"):
        command_from_dict({**BASE, "pipeline": pipeline, "batch_sizes": [8, 0, 0, 0]})


def test_a_later_stage_may_be_a_group_from_version_11() -> None:
    stages = [*SPEC["stages"], {"board_id": "stage-3", "host": "10.0.0.4", "port": 7003, "public_key": KEYS[0]}]
    pipeline = _spec(stages=stages, groups=[1, 2, 1])  # stage-1 and stage-2 train stage 1, each some micro-batches
    command = command_from_dict({**BASE, "pipeline": pipeline, "batch_sizes": [16, 0, 0, 0], "board_index": 2,
                                 "board_id": "stage-2"})
    spec = command.pipeline_spec
    assert spec is not None and spec.stage_count == 3 and spec.sizes == [1, 2, 1] and spec.later_groups
    assert [spec.stage_of(i) for i in range(4)] == [0, 1, 1, 2] and [spec.member_of(i) for i in range(4)] == [0, 0, 1, 0]
    assert PipelineSpec.from_dict(spec.to_dict()) == spec and spec.to_dict()["groups"] == [1, 2, 1]
    assert "groups" not in PipelineSpec.from_dict(SPEC).to_dict()  # a plan without later groups travels as before
    with pytest.raises(DecodeError, match=f"pipeline.groups needs schema_version {STAGE_GROUPS_TRAIN_SCHEMA_VERSION}, "
                                          "the command says 10"):
        command_from_dict({**BASE, "schema_version": 10, "pipeline": pipeline, "batch_sizes": [16, 0, 0, 0]})
    for groups, fragment in (([1, 2], "should give each of at least 2 stages"), ([2, 1, 1], "should give each"),
                             ([1, 0, 3], r"groups\[1\] = 0 should be a whole number"), ("12", "should be a list")):
        with pytest.raises(DecodeError, match=fragment):
            command_from_dict({**BASE, "pipeline": _spec(stages=stages, groups=groups), "batch_sizes": [16, 0, 0, 0]})


def test_a_spec_of_more_boards_than_the_stage_and_group_limits_added_reads_back() -> None:
    # 64 boards at stage 0 and two later groups of 64: 192 peers, within 64 stages of 64 boards each
    stages = [{"board_id": f"b{k}", "host": "10.0.0.1", "port": 7000 + k, "public_key": KEYS[0]} for k in range(192)]
    spec = PipelineSpec.from_dict(_spec(stages=stages, group=64, groups=[64, 64, 64], micro_batches=64))
    assert spec.sizes == [64, 64, 64] and PipelineSpec.from_dict(spec.to_dict()) == spec


def test_a_data_parallel_command_has_no_pipeline() -> None:
    command = command_from_dict({**BASE, "pipeline": None, "board_id": "b", "batch_sizes": [8, 8]})
    assert isinstance(command, TrainCommand) and command.pipeline is None and command.pipeline_spec is None


def test_keys_a_newer_coordinator_adds_are_ignored_as_every_messages_are() -> None:
    command = command_from_dict({**BASE, "pipeline": _spec(schedule="gpipe")})
    assert isinstance(command, TrainCommand) and command.pipeline_spec == PipelineSpec.from_dict(SPEC)


@pytest.mark.parametrize("version", [1, 7, PIPELINE_TRAIN_SCHEMA_VERSION - 1])
def test_an_older_command_cannot_ask_for_a_pipeline(version: int) -> None:
    with pytest.raises(DecodeError, match=f"pipeline needs schema_version {PIPELINE_TRAIN_SCHEMA_VERSION}, the command "
                                          f"says {version}"):
        command_from_dict({**BASE, "schema_version": version})


def test_a_version_9_command_cannot_ask_the_later_stages_for_their_state_at_checkpoints() -> None:
    with pytest.raises(DecodeError, match=f"pipeline.state_every needs schema_version {STAGE_SYNC_TRAIN_SCHEMA_VERSION}, "
                                          "the command says 9"):
        command_from_dict({**BASE, "schema_version": 9, "pipeline": _spec(state_every=50)})
    command = command_from_dict({**BASE, "pipeline": _spec(state_every=50)})
    assert isinstance(command, TrainCommand) and command.pipeline_spec is not None
    assert command.pipeline_spec.state_every == 50


def test_a_newer_command_is_refused_before_its_pipeline_is_read() -> None:
    with pytest.raises(DecodeError, match="newer than this side understands"):
        command_from_dict({**BASE, "schema_version": TRAIN_SCHEMA_VERSION + 1, "pipeline": "anything"})


@pytest.mark.parametrize(("change", "fragment"), [
    ({"placement": "net.2", "tail_port": 9100}, "cannot be combined with placement"),
    ({"sync_every": 2}, "cannot be combined with sync_every > 1"),
    ({"overlap": True}, "cannot be combined with overlap"),
    ({"accumulate_grad_batches": 2}, "cannot be combined with accumulate_grad_batches > 1"),
    ({"board_id": "stage-2"}, r"board_id 'stage-2' is not the pipeline's board 1 \('stage-1'\)"),
    ({"batch_sizes": [8, 8, 0]}, r"should be stage 0's 1 batch size\(s\), then a 0 for each later stage's board \(3 in all\)"),
    ({"batch_sizes": [16, 0]}, r"should be stage 0's 1 batch size\(s\), then a 0 for each later stage's board \(3 in all\)"),
    ({"batch_sizes": [0, 16, 0]}, r"should be stage 0's 1 batch size"),
    ({"batch_sizes": [80, 0, 0]}, "holds 20 rows a micro-batch, more than pipeline.max_rows 16"),
    ({"pipeline": [1, 2]}, "pipeline should be a map, got list"),
])
def test_a_pipeline_with_what_it_cannot_carry_is_refused(change: dict[str, Any], fragment: str) -> None:
    with pytest.raises(DecodeError, match=fragment):
        command_from_dict({**BASE, **change})


def test_micro_batches_of_exactly_max_rows_are_taken() -> None:
    command = command_from_dict({**BASE, "batch_sizes": [64, 0, 0]})  # 64 in 4 micro-batches: 16 rows each
    assert isinstance(command, TrainCommand) and command.batch_size == 0 and command.batch_sizes[0] == 64


@pytest.mark.parametrize(("pipeline", "fragment"), [
    ({k: v for k, v in SPEC.items() if k != "shapes"}, r"pipeline\.shapes is missing"),
    (_spec(cuts="net.2"), r"pipeline\.cuts should be a list, got str"),
    (_spec(cuts=["net.2"]), r"pipeline\.cuts has 1 entries for 3 stages; it should have 2"),
    (_spec(cuts=["net.2", ""]), r"pipeline\.cuts\[1\] = '' is not a layer's name"),
    (_spec(cuts=["net.2", "x" * 201]), r"pipeline\.cuts\[1\] = 'x+\.\.\. is not a layer's name \(1-200"),
    (_spec(cuts=["net.2", 8]), r"pipeline\.cuts\[1\] = 8 is not a layer's name"),
    (_spec(cuts=["net.2", "net.2"]), r"pipeline\.cuts names the layer 'net\.2' twice"),
    (_spec(micro_batches=0), r"pipeline\.micro_batches = 0 should be a whole number from 1 to 4096"),
    (_spec(micro_batches=4097), r"pipeline\.micro_batches = 4097 should be"),
    (_spec(micro_batches=True), r"pipeline\.micro_batches = True should be"),
    (_spec(micro_batches=2.0), r"pipeline\.micro_batches = 2\.0 should be"),
    (_spec(max_rows=0), r"pipeline\.max_rows = 0 should be a whole number from 1"),
    (_spec(stages=SPEC["stages"][:1], cuts=[], shapes=[[10]]), r"pipeline\.stages has 1 entries; it should have 2 to 4096"),
    (_spec(stages=[SPEC["stages"][0]] * 65), r"pipeline\.stages makes 65 stages \(after stage 0's group of 1\); at most 64"),
    (_spec(stages={"0": SPEC["stages"][0]}), r"pipeline\.stages should be a list, got dict"),
    (_spec(stages=[SPEC["stages"][0], "pi-2", SPEC["stages"][2]]), r"pipeline\.stages\[1\] should be a map, got str"),
    (_peer(1, board_id="stage-0"), r"board 'stage-0' is listed at 0 and 1; a board runs one stage"),
    (_peer(1, board_id="a/b"), r"pipeline\.stages\[1\]\.board_id = 'a/b' is not a board id"),
    (_peer(2, host=""), r"pipeline\.stages\[2\]\.host = '' should be a non-empty text of at most 253"),
    (_peer(2, host="h" * 254), r"pipeline\.stages\[2\]\.host = 'h+\.\.\. should be a non-empty text"),
    (_peer(2, host=None), r"pipeline\.stages\[2\]\.host = None should be"),
    (_peer(0, port=0), r"pipeline\.stages\[0\]\.port = 0 should be a whole number from 1 to 65535"),
    (_peer(0, port=65536), r"pipeline\.stages\[0\]\.port = 65536 should be"),
    (_peer(0, port="7000"), r"pipeline\.stages\[0\]\.port = '7000' should be"),
    (_peer(1, public_key="AB" * 32), r"pipeline\.stages\[1\]\.public_key = 'ABAB.* is not an Ed25519 public key \(64 "
                                     "lowercase hex digits\\)"),
    (_peer(1, public_key="ab" * 31), r"pipeline\.stages\[1\]\.public_key = .* is not an Ed25519 public key"),
    (_peer(1, public_key=b"\x00" * 32), r"pipeline\.stages\[1\]\.public_key = b.* is not an Ed25519 public key"),
    (_spec(stages=[{k: v for k, v in SPEC["stages"][0].items() if k != "port"}, *SPEC["stages"][1:]]),
     r"pipeline\.stages\[0\]\.port is missing"),
    (_spec(shapes=[[6, 14, 14], [120]]), r"pipeline\.shapes has 2 entries for 3 stages; it should have 3"),
    (_spec(shapes=[[6, 14, 14], [], [10]]), r"pipeline\.shapes\[1\] has 0 entries; it should have 1 to 6"),
    (_spec(shapes=[[6, 14, 14], [1] * 7, [10]]), r"pipeline\.shapes\[1\] has 7 entries; it should have 1 to 6"),
    (_spec(shapes=[[6, 14, 14], [0], [10]]), r"pipeline\.shapes\[1\]\[0\] = 0 should be a whole number from 1"),
    (_spec(shapes=[[6, -14, 14], [120], [10]]), r"pipeline\.shapes\[0\]\[1\] = -14 should be a whole number"),
    (_spec(shapes=[[6, 14, 14], 120, [10]]), r"pipeline\.shapes\[1\] should be a list, got int"),
    (_spec(shapes=[[6, 14.0, 14], [120], [10]]), r"pipeline\.shapes\[0\]\[1\] = 14\.0 should be a whole number"),
    (_spec(shapes=[[6, [14], 14], [120], [10]]), r"pipeline\.shapes\[0\]\[1\] = a list should be a whole number"),
    (_spec(max_rows=10**400), r"pipeline\.max_rows = an integer of about 400 digits should be"),
    (_spec(state_every=-1), r"pipeline\.state_every = -1 should be a whole number from 0"),
    (_spec(state_every="4"), r"pipeline\.state_every = '4' should be a whole number from 0"),
])
def test_a_malformed_pipeline_is_refused_naming_the_field(pipeline: Any, fragment: str) -> None:
    with pytest.raises(DecodeError, match=fragment):
        command_from_dict({**BASE, "pipeline": pipeline})
    with pytest.raises(ValueError, match=fragment):  # the same check when the coordinator builds it
        PipelineSpec.from_dict(pipeline)


def test_a_spec_built_in_code_is_checked_too() -> None:
    peers = [PipelinePeer.from_dict(p) for p in SPEC["stages"]]
    with pytest.raises(ValueError, match=r"pipeline\.cuts has 1 entries for 3 stages"):
        PipelineSpec(cuts=["net.2"], micro_batches=4, stages=peers, shapes=SPEC["shapes"], max_rows=16)
    with pytest.raises(ValueError, match=r"pipeline\.stages\[\]\.port = 0 should be"):
        PipelinePeer(board_id="stage-0", host="10.0.0.1", port=0, public_key=KEYS[0])
    with pytest.raises(ValueError, match=r"pipeline\.stages\[1\] should be a PipelinePeer, got dict"):
        PipelineSpec(cuts=["a", "b"], micro_batches=4, stages=[peers[0], SPEC["stages"][1], peers[2]],
                     shapes=SPEC["shapes"], max_rows=16)
