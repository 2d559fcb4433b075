"""bench/validation_libraries.py (issue 37): the msgspec Structs it measures are the same messages as ours.

A faster contender that accepted more, or decoded other values, would make the speed figures a lie:
both sides must decode every sample message to the same fields and refuse every bad input.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from edgefleet.protocol.errors import DecodeError

pytest.importorskip("msgspec", reason="the bench extra: pip install -e '.[bench]'")
pytest.importorskip("shtab", reason="the bench extra: pip install -e '.[bench]'")

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load() -> ModuleType:
    # bench/ is a folder of scripts, not a package: the module is loaded from its file (it imports _table beside it).
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("validation_libraries", BENCH / "validation_libraries.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


vl = _load()
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
