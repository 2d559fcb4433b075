"""Property-based fuzzing of every decoder a peer's bytes reach: the exchange's and the link probe's frames,
the profile report, commands, job events, telemetry, status and caps, and the agent's config file. Each
either returns a value or raises its own documented error (DecodeError / ProtocolError for the wire,
ConfigError for a config), never anything else, for a bounded number of generated inputs."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgefleet.agent.config import load_agent_config
from edgefleet.protocol import exchange_frames, probe_frames, profile_report
from edgefleet.protocol.errors import ConfigError, ProtocolError
from edgefleet.protocol.jobs import JobEvent, command_from_dict
from edgefleet.protocol.messages import BoardCaps, BoardStatus, TelemetrySample

EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Keys the decoders look for, so that generated maps often get past the first check.
KEYS = ["type", "v", "step", "n", "loss", "compute_s", "g", "boards", "split", "lrs", "logs", "job_id", "board_id",
        "token", "param_count", "model", "optimizer", "splits", "message", "reason", "from_step", "batch_sizes",
        "dtype", "shape", "data", "bytes", "round", "rounds", "points", "link", "phase", "ts", "state", "seq",
        "cpu_percent", "mem_used_bytes", "power_w", "exchange_host", "exchange_port", "batch_size", "seconds",
        "schema_version", "nonce", "welcome", "hello", "grad", "avg", "stop", "refusal"]
TYPES = ["hello", "welcome", "refusal", "grad", "avg", "stop", "go", "got", "down", "end", "aggregate", "done",
         "train", "profile", "stop_job", "accepted", "failed", "online", "offline"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(TYPES),
                    st.text(max_size=20), st.binary(max_size=64))
values = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=5),
    st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), children, max_size=6)), max_leaves=25)
frames = st.dictionaries(st.sampled_from(KEYS), values, max_size=10)


def _ok(call: Any, *args: Any, **kwargs: Any) -> None:
    """``call`` returns, or raises a ProtocolError (DecodeError and the version errors are ones)."""
    try:
        call(*args, **kwargs)
    except ProtocolError:
        pass


@EXAMPLES
@given(frame=st.one_of(frames, values))
def test_exchange_frames(frame: Any) -> None:
    for decode in (exchange_frames.Hello.from_wire, exchange_frames.Welcome.from_wire, exchange_frames.Refusal.from_wire,
                   exchange_frames.Stop.from_wire, exchange_frames.BatchSplit.from_wire, exchange_frames.decode_hello_reply):
        _ok(decode, frame)
    for dtype in ("float32", "float16", "bfloat16"):
        _ok(exchange_frames.Grad.from_wire, frame, elements=4, dtype=dtype)
        _ok(exchange_frames.Avg.from_wire, frame, elements=4, dtype=dtype)
        _ok(exchange_frames.decode_step_reply, frame, elements=4, dtype=dtype)


@EXAMPLES
@given(frame=st.one_of(frames, values), round_bytes=st.integers(min_value=0, max_value=1 << 20))
def test_probe_frames_and_profile_report(frame: Any, round_bytes: int) -> None:
    _ok(probe_frames.decode_probe_frame, frame, round_bytes=round_bytes)
    _ok(profile_report.ProfileReport.from_wire, frame)


@EXAMPLES
@given(frame=st.one_of(frames, values))
def test_commands(frame: Any) -> None:
    _ok(command_from_dict, frame)


def _packed(value: Any) -> bytes:
    try:
        return bytes(msgpack.packb(value, use_bin_type=True))
    except (OverflowError, TypeError, ValueError):  # an int beyond 64 bits: msgpack has no such number
        return b"\x80"


@EXAMPLES
@given(payload=st.one_of(st.binary(max_size=512), frames.map(_packed)))
def test_job_events(payload: bytes) -> None:
    _ok(JobEvent.from_msgpack, payload)


def _json_text(value: Any) -> str:
    try:
        return json.dumps(value, default=repr, allow_nan=True)
    except (ValueError, TypeError, RecursionError):
        return "{"


@EXAMPLES
@given(payload=st.one_of(st.binary(max_size=512), frames.map(_json_text), values.map(_json_text),
                         st.text(alphabet="[]{}\",:0123456789e.-", max_size=400)))
def test_telemetry_status_and_caps(payload: Any) -> None:
    for cls in (TelemetrySample, BoardStatus, BoardCaps):
        _ok(cls.from_json, payload)


toml_values = st.one_of(st.integers(min_value=-2**63, max_value=2**63 - 1), st.floats(allow_nan=False),
                        st.booleans(), st.text(alphabet=string.printable, max_size=20),
                        st.lists(st.integers(min_value=-5, max_value=5), max_size=3))
SECTIONS = {"": ["board_id", "state_dir", "nonsense"], "broker": ["host", "port", "keepalive_s", "protocol", "username"],
            "telemetry": ["interval_s", "cpu_scope", "net_interfaces"], "power": ["source", "idle_w", "max_w"],
            "security": ["fleet_key_file", "max_command_age_s"], "training": ["keep_worker"], "bogus": ["x"]}


def _toml(entries: dict[str, dict[str, Any]]) -> str:
    lines: list[str] = []
    for section, items in sorted(entries.items()):
        if section:
            lines.append(f"[{section}]")
        for key, value in items.items():
            lines.append(f"{key} = {json.dumps(value) if not isinstance(value, bool) else str(value).lower()}")
    return "\n".join(lines) + "\n"


config_files = st.one_of(
    st.dictionaries(st.sampled_from(sorted(SECTIONS)), st.just({}), max_size=4).flatmap(
        lambda chosen: st.fixed_dictionaries({section: st.dictionaries(st.sampled_from(SECTIONS[section]), toml_values,
                                                                       max_size=3) for section in chosen})).map(_toml),
    st.text(max_size=200))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(text=config_files)
def test_agent_config_files(tmp_path: Path, text: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    try:
        load_agent_config(path)
    except ConfigError:
        pass


def test_the_fuzzed_frames_are_not_all_refused_at_the_first_check() -> None:
    """The generators reach past the type check: a well-formed grad frame among them decodes."""
    frame = {"type": "grad", "step": 3, "n": 8, "loss": 0.5, "compute_s": 0.1,
             "g": {"dtype": "float32", "shape": [4], "data": np.arange(4, dtype=np.float32).tobytes()}}
    assert exchange_frames.Grad.from_wire(frame, elements=4, dtype="float32").step == 3
