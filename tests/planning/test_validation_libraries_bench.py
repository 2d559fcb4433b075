"""bench/validation_libraries.py (issue 37): the msgspec Structs it measures are the same messages as ours.

A faster contender that accepted more, or decoded other values, would make the speed figures a lie:
both sides must decode every sample message to the same fields and refuse every bad input.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from edgefleet.protocol.errors import DecodeError
from tests.planning import load_bench

pytest.importorskip("msgspec", reason="the bench extra: pip install -e '.[bench]'")
pytest.importorskip("shtab", reason="the bench extra: pip install -e '.[bench]'")


vl = load_bench("validation_libraries.py", "validation_libraries", helpers=True)
msgspec, shtab, structs = vl.need_libraries()


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
@pytest.mark.parametrize("name", ["TelemetrySample", "BoardStatus", "BoardCaps", "JobEvent", "TrainCommand"])
def test_both_sides_decode_each_message_to_the_same_fields(name: str, fmt: str) -> None:
    payload = vl.encode(vl.sample_messages()[name], fmt)

    today = vl.today_decoder(name, fmt, structs.check_used_within_total)(payload)
    library = structs.decoder(getattr(structs, name), fmt)(payload)

    assert vl.same_fields(today, library, msgspec)


@pytest.mark.parametrize("case", [c for c in vl.bad_inputs() if c.fmt != "toml"], ids=lambda c: c.label)
def test_both_sides_refuse_every_bad_message(case: object) -> None:
    assert isinstance(case, vl.BadInput)
    for decode in (vl.today_decoder(case.name, case.fmt, structs.check_used_within_total),
                   structs.decoder(getattr(structs, case.name), case.fmt)):
        with pytest.raises(DecodeError):
            decode(case.payload)


def test_todays_completion_script_gives_every_completion_the_bench_tries(tmp_path: Path) -> None:
    rows = vl.measure_completion(shtab, tmp_path, runs=1)

    assert rows[0].passed == [label for label, _, _ in vl.COMPLETION_CASES]
