"""Hand-written or a library: message validation against msgspec, shell completion against shtab (issue 37).

Four measurements, each against today's code measured in the same run (the baseline of every ratio):

1. Decode + validate speed of the real messages (``TelemetrySample``, ``BoardStatus``, ``BoardCaps``,
   ``JobEvent``, ``TrainCommand``) from JSON and from msgpack bytes: today's decoders
   (``from_json``, ``from_msgpack``, ``message_from_dict`` after the same ``json``/``msgpack``
   parsing and limits) against msgspec Structs with the same constraints (``_msgspec_messages.py``:
   ``Meta(ge=, le=, max_length=, pattern=)``, ``Literal``, and the dataclasses' own cross-field
   rules in ``__post_init__``). The wire format each message really travels in is marked. Before
   timing, both must decode each payload to the same field values. Times are the best of
   ``--repeats`` passes of about ``--pass-s`` seconds each, in microseconds per message. Then the
   coordinator's fold of a telemetry sample (``FleetView.ingest``, 200 boards x 50 samples), once as
   it is and once with msgspec's decoder and Struct in its place.
2. Error messages for bad inputs (a wrong type, a value out of range, a missing field, a bool for an
   int, NaN, a too-long list, a control character, a used part above its total, a newer
   schema_version, nesting too deep inside a known and an unknown field, a too-large payload, a bad
   train command, and four config mistakes): both sides' words, side by side; counted: refused,
   naming the field, giving the allowed values or the fix (a substring each case names).
3. The agent's idle memory: the RSS of a Python process that imports what ``python -m
   edgefleet.agent`` imports (``edgefleet.agent.__main__``, hence the daemon's closure), with and
   without msgspec and the Structs and decoders above; and the baseline of ``agent_footprint.py``
   (paho-mqtt, psutil, msgpack). Median of ``--rss-runs`` processes each. The running agent's RSS
   is measured by ``agent_footprint.py`` (target <= 40 MB); the difference here is what msgspec
   would add to it.
4. Shell completion: ``edge-coordinator completion bash`` (``coordinator/cli/completion.py``)
   against what shtab 1.x generates for the same two argparse parsers, plainly and with the hints
   shtab needs to do as much (``complete = shtab.FILE`` / ``DIRECTORY`` on the same path actions and a
   board-id function in a preamble): lines of code, lines generated, which of eight completions
   each gives (run in a real bash: the script is sourced, ``COMP_WORDS`` set, the function called; what
   bash itself would add when a function offers nothing, ``complete -o bashdefault``, is not counted),
   and the time to source the script and to answer one completion, inside bash. zsh scripts are
   counted, not run (zsh is not installed here).

Needs the ``bench`` extra: ``pip install -e '.[bench]'`` (msgspec, shtab). Exit code 0 when the run
was made, 2 when it could not be (a library missing, the two sides decoding a payload differently).
The table of figures comes last.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from _harness import BenchError  # bench/ is the script's folder, first on sys.path
from _table import print_table

from edgefleet.protocol import jobs
from edgefleet.protocol._validate import load_json, message_from_dict
from edgefleet.protocol.errors import ConfigError, DecodeError
from edgefleet.protocol.jobs import JobEvent, TrainCommand
from edgefleet.protocol.messages import MESSAGE_SCHEMA_VERSION, BoardCaps, BoardStatus, TelemetrySample
from edgefleet.protocol.signing import MAX_COMMAND_BYTES

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
MB = 1_000_000
INSTALL_HINT = "pip install -e '.[bench]'   (or: pip install msgspec shtab)"
WIRE = {("TelemetrySample", "json"), ("BoardStatus", "json"), ("BoardCaps", "json"), ("JobEvent", "msgpack"),
        ("TrainCommand", "msgpack")}  # the format each message travels in (commands: the signed body)


def need_libraries() -> tuple[Any, Any, Any]:
    """msgspec, shtab and the bench's Structs, or a BenchError that says how to install them."""
    try:
        import _msgspec_messages
        import msgspec
        import shtab
    except ImportError as exc:
        raise BenchError(f"{exc.name} is missing: {INSTALL_HINT}") from None
    return msgspec, shtab, _msgspec_messages


# ----------------------------------------------------------------------------- the messages

def sample_messages() -> dict[str, Any]:
    """One realistic message of each type, as the production dataclasses make it."""
    sample = TelemetrySample(
        board_id="pi5-kitchen", ts=1764390000.125, seq=48213, interval_s=1.0,
        cpu_percent=23.4, cpu_percent_per_core=[18.0, 31.5, 22.1, 22.0], cpu_freq_mhz=1800.0,
        load_avg_1m=0.42, load_avg_5m=0.37, load_avg_15m=0.31,
        mem_total_bytes=4_109_848_576, mem_used_bytes=612_343_808, mem_available_bytes=3_497_504_768, mem_percent=14.9,
        swap_total_bytes=104_853_504, swap_used_bytes=0, net_rx_bytes_per_s=812.4, net_tx_bytes_per_s=960.2,
        temp_c=51.3, temps_c={"cpu_thermal": 51.3, "rp1_adc": 47.9}, power_w=3.05, power_source="rpi5-pmic",
        power_rails_w={"VDD_CORE": 1.21, "3V3_SYS": 0.35}, throttled_bits=0, under_voltage_now=False,
        disk_data_used_bytes=9_000_000_000, disk_data_total_bytes=31_000_000_000, energy_wh=812.5)
    status = BoardStatus(state="busy", ts=1764390000.5, agent_version="0.9.0", interval_s=1.0, keepalive_s=30.0,
                         activity="training")
    caps = BoardCaps(board_id="pi5-kitchen", hostname="pi5-kitchen", model="Raspberry Pi 5 Model B Rev 1.0",
                     machine="aarch64", cores=4, ram_bytes=4_109_848_576, power_source="rpi5-pmic", agent_version="0.9.0",
                     python_version="3.11.2", training_available=True, cpu_cores=4.0, train_threads=3, address="192.168.1.20")
    event = JobEvent(job_id="run-20261129-0601", board_id="pi5-kitchen", phase="progress", step=1200, loss=0.4213,
                     compute_s=0.183, ts=1764390000.75, data={"samples_per_s": 174.2, "epoch": 3})
    command = TrainCommand(job_id="run-20261129-0601", board_id="pi5-kitchen", exchange_host="10.0.0.2", exchange_port=47000,
                           token="", model="mlp", model_options={"hidden": 64}, dataset="synthetic:4096",
                           board_index=1, batch_sizes=[64, 48, 32], seed=1234, total_steps=2000, lr=0.01,
                           exchange_tls_sha256="ab" * 32, threads=3)
    return {"TelemetrySample": sample, "BoardStatus": status, "BoardCaps": caps, "JobEvent": event, "TrainCommand": command}


def encode(message: Any, fmt: str) -> bytes:
    fields = dataclasses.asdict(message)
    if isinstance(message, TelemetrySample) and fmt == "json":
        return message.to_json()  # the agent's own bytes (None fields left out)
    if fmt == "json":
        return json.dumps(fields, separators=(",", ":")).encode()
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return packed


def _event_from_obj(data: Any) -> JobEvent:
    """``JobEvent.from_msgpack`` after its unpacking: ``data`` checked on its own (it nests)."""
    result = data.pop("data", None) if isinstance(data, dict) else None
    event = message_from_dict(JobEvent, data, schema_version=jobs.JOB_SCHEMA_VERSION)
    if result is None:
        return event
    if not isinstance(result, dict) or not jobs._plain_data(result):
        raise DecodeError("JobEvent: field 'data' should be a map of plain values nested at most "
                          f"{jobs._DATA_MAX_DEPTH} deep with finite numbers, got {result!r:.60}")
    return dataclasses.replace(event, data=result)


def _unpack(payload: bytes, what: str) -> Any:
    """msgpack as the event and command decoders unpack it: size limits first, errors in words."""
    if len(payload) > jobs.MAX_EVENT_BYTES:
        raise DecodeError(f"{what}: {len(payload)} bytes is over the {jobs.MAX_EVENT_BYTES}-byte limit")
    try:
        return msgpack.unpackb(payload, max_str_len=MAX_COMMAND_BYTES, max_bin_len=0, max_array_len=1000, max_map_len=100)
    except (ValueError, msgpack.UnpackException) as exc:
        raise DecodeError(f"{what}: not valid msgpack ({exc})") from None


def _telemetry_from_obj(data: Any, check: Callable[[Any], None]) -> TelemetrySample:
    sample = message_from_dict(TelemetrySample, data, schema_version=MESSAGE_SCHEMA_VERSION)
    try:
        check(sample)
    except ValueError as exc:
        raise DecodeError(f"TelemetrySample: {exc}") from None
    return sample


def today_decoder(name: str, fmt: str, check_used: Callable[[Any], None]) -> Callable[[bytes], Any]:
    """Today's code for ``name`` from ``fmt`` bytes: the production decoder where the message travels in
    ``fmt``, else the same validation (``message_from_dict``) after the same parsing and limits."""
    cls = {"TelemetrySample": TelemetrySample, "BoardStatus": BoardStatus, "BoardCaps": BoardCaps}.get(name)
    if cls is not None:
        if fmt == "json":
            return cls.from_json  # type: ignore[attr-defined, no-any-return]
        if cls is TelemetrySample:
            return lambda b: _telemetry_from_obj(_unpack(b, name), check_used)
        return lambda b: message_from_dict(cls, _unpack(b, name), schema_version=MESSAGE_SCHEMA_VERSION)
    if name == "JobEvent":
        return JobEvent.from_msgpack if fmt == "msgpack" else lambda b: _event_from_obj(load_json(b, what=name))
    parse = (lambda b: _unpack(b, name)) if fmt == "msgpack" else (lambda b: load_json(b, what=name))
    return lambda b: TrainCommand.from_dict(parse(b))


@dataclass
class SpeedRow:
    name: str
    fmt: str
    size: int
    today_us: float
    library_us: float


def best_us(decode: Callable[[bytes], Any], payload: bytes, *, repeats: int, pass_s: float) -> float:
    """Best of ``repeats`` passes, each about ``pass_s`` seconds, in microseconds per call."""
    number = 1
    while True:  # calibrate: enough calls for one pass to last pass_s
        t0 = time.perf_counter()
        for _ in range(number):
            decode(payload)
        took = time.perf_counter() - t0
        if took >= pass_s / 4:
            number = max(1, int(number * pass_s / took))
            break
        number *= 4
    best = float("inf")
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(number):
                decode(payload)
            best = min(best, (time.perf_counter() - t0) / number)
    finally:
        if gc_was:
            gc.enable()
    return best * 1e6


def same_fields(today: Any, library: Any, msgspec: Any) -> bool:
    return bool(dataclasses.asdict(today) == msgspec.structs.asdict(library))


def measure_speed(args: argparse.Namespace, msgspec: Any, structs: Any) -> list[SpeedRow]:
    rows: list[SpeedRow] = []
    for name, message in sample_messages().items():
        for fmt in ("json", "msgpack"):
            payload = encode(message, fmt)
            today = today_decoder(name, fmt, structs.check_used_within_total)
            library = structs.decoder(getattr(structs, name), fmt)
            if not same_fields(today(payload), library(payload), msgspec):
                raise BenchError(f"{name} from {fmt}: today's code and msgspec decode different values; fix _msgspec_messages.py")
            rows.append(SpeedRow(name, fmt, len(payload), best_us(today, payload, repeats=args.repeats, pass_s=args.pass_s),
                                 best_us(library, payload, repeats=args.repeats, pass_s=args.pass_s)))
            print(f"  {name:16} {fmt:8} {len(payload):5d} B  today {rows[-1].today_us:7.2f} us  "
                  f"msgspec {rows[-1].library_us:7.2f} us", flush=True)
    return rows


def fold_payloads(boards: int = 200, per_board: int = 50) -> list[tuple[str, bytes]]:
    """(topic, sample JSON) round robin over ``boards``, each board's seq and ts counting up: a fold's input."""
    from edgefleet.protocol.topics import DEFAULT_PREFIX, telemetry_topic

    base = sample_messages()["TelemetrySample"]
    out = []
    for seq in range(1, per_board + 1):
        for b in range(boards):
            sample = dataclasses.replace(base, board_id=f"sim-{b:04d}", seq=seq, ts=base.ts + seq)
            out.append((telemetry_topic(DEFAULT_PREFIX, sample.board_id), sample.to_json()))
    return out


def measure_fold(args: argparse.Namespace, structs: Any) -> tuple[float, float]:
    """``FleetView.ingest`` per telemetry message (us, best of passes) with today's decoder and with msgspec's.

    For msgspec's run the fleet view's decoder and its ``TelemetrySample`` (one ``isinstance`` check) are the
    Struct's, as they would be after adopting it; both folds must end with the same boards and no bad
    message (the Struct has the dataclass's attribute names).
    """
    from edgefleet.coordinator.control import fleet
    from edgefleet.protocol.topics import DEFAULT_PREFIX

    stream = fold_payloads()
    results = []
    original, original_class = fleet._DECODERS["telemetry"], fleet.TelemetrySample
    for decode in (original, structs.decoder(structs.TelemetrySample, "json")):
        fleet._DECODERS["telemetry"] = decode
        fleet.TelemetrySample = original_class if decode is original else structs.TelemetrySample  # type: ignore[misc]
        best = float("inf")
        try:
            for _ in range(args.repeats):
                view = fleet.FleetView(DEFAULT_PREFIX)
                ingest = view.ingest
                t0 = time.perf_counter()
                for topic, payload in stream:
                    ingest(topic, payload, False)
                best = min(best, (time.perf_counter() - t0) / len(stream))
        finally:
            fleet._DECODERS["telemetry"], fleet.TelemetrySample = original, original_class  # type: ignore[misc]
        if view.bad_messages or view.messages != len(stream) or len(view.boards) != 200:
            raise BenchError(f"the fold with {decode!r} counted {view.bad_messages} bad of {view.messages} messages, "
                             f"{len(view.boards)} boards")
        results.append(best * 1e6)
        print(f"  fold alone ({'today' if decode is original else 'msgspec'}): {best * 1e6:.2f} us per message", flush=True)
    return results[0], results[1]


# ----------------------------------------------------------------------------- error messages

@dataclass(frozen=True)
class BadInput:
    label: str
    name: str           # the message type, or "config" for a TOML text
    fmt: str            # "json", "msgpack" or "toml"
    payload: bytes
    field: str          # what a good message names
    fix: str            # a substring that shows the allowed values or the fix ("" when the field is the fix)


def _sample_with(**changes: Any) -> bytes:
    fields = json.loads(sample_messages()["TelemetrySample"].to_json())
    for key, value in changes.items():
        if value is _DROP:
            del fields[key]
        else:
            fields[key] = value
    return json.dumps(fields, separators=(",", ":")).encode()


_DROP = object()


def _nested(depth: int) -> Any:
    value: Any = 1.0
    for _ in range(depth):
        value = [value]
    return value


def bad_inputs() -> list[BadInput]:
    command = dataclasses.asdict(sample_messages()["TrainCommand"])
    event = dataclasses.asdict(sample_messages()["JobEvent"])
    return [
        BadInput("wrong type: cpu_percent = \"12%\"", "TelemetrySample", "json", _sample_with(cpu_percent="12%"),
                 "cpu_percent", "float"),
        BadInput("out of range: temp_c = 900", "TelemetrySample", "json", _sample_with(temp_c=900), "temp_c", "250"),
        BadInput("missing field: no seq", "TelemetrySample", "json", _sample_with(seq=_DROP), "seq", "required"),
        BadInput("bool for an int: seq = true", "TelemetrySample", "json", _sample_with(seq=True), "seq", "int"),
        BadInput("NaN: cpu_percent = NaN", "TelemetrySample", "json",
                 _sample_with(cpu_percent=0.5).replace(b'"cpu_percent":0.5', b'"cpu_percent":NaN'), "cpu_percent", "finite"),
        BadInput("too many items: 5000 cores", "TelemetrySample", "json", _sample_with(cpu_percent_per_core=[1.0] * 5000),
                 "cpu_percent_per_core", "4096"),
        BadInput("control character in board_id", "TelemetrySample", "json", _sample_with(board_id="pi\x07"), "board_id", ""),
        BadInput("used above total: mem_used > mem_total", "TelemetrySample", "json",
                 _sample_with(mem_used_bytes=5_000_000_000), "mem_used_bytes", "mem_total_bytes"),
        BadInput("newer schema_version = 2", "TelemetrySample", "json", _sample_with(schema_version=2), "schema_version",
                 "upgrade"),
        BadInput("known field nested 20 deep: temps_c", "TelemetrySample", "json", _sample_with(temps_c={"x": _nested(20)}),
                 "temps_c", "float"),
        BadInput("unknown field nested 3000 deep", "TelemetrySample", "json",
                 _sample_with(extra=0).replace(b'"extra":0', b'"extra":' + b"[" * 3000 + b"]" * 3000), "", "8"),
        BadInput("payload of 100 KB", "BoardStatus", "json", b'{"state":"online","reason":"' + b"x" * 100_000 + b'"}', "",
                 "65536"),
        BadInput("bad state word", "BoardStatus", "json", b'{"state":"sleeping"}', "state", "online"),
        BadInput("event data nested 6 deep", "JobEvent", "msgpack",
                 msgpack.packb({**event, "data": {"x": _nested(6)}}, use_bin_type=True), "data", "4"),
        BadInput("command: batch_sizes = [64, \"48\"]", "TrainCommand", "msgpack",
                 msgpack.packb({**command, "batch_sizes": [64, "48"]}, use_bin_type=True), "batch_sizes", "int"),
        BadInput("command: board_index 5 of 3 boards", "TrainCommand", "msgpack",
                 msgpack.packb({**command, "board_index": 5}, use_bin_type=True), "board_index", "3"),
        BadInput("config: unknown key intervall_s", "config", "toml", b"[telemetry]\nintervall_s = 2\n", "intervall_s",
                 "interval_s"),
        BadInput("config: interval_s = \"fast\"", "config", "toml", b'[telemetry]\ninterval_s = "fast"\n', "interval_s",
                 "number"),
        BadInput("config: interval_s = 0.001", "config", "toml", b"[telemetry]\ninterval_s = 0.001\n", "interval_s", "0.05"),
        BadInput("config: cpu_scope = \"all\"", "config", "toml", b'[telemetry]\ncpu_scope = "all"\n', "cpu_scope", "cgroup"),
    ]


def today_config_error(text: bytes, workdir: Path) -> str:
    from edgefleet.agent.config import load_agent_config

    path = workdir / "agent.toml"
    path.write_bytes(text)
    try:
        load_agent_config(path, board_id="bench-1")
    except ConfigError as exc:
        return str(exc).replace(str(path), "agent.toml")
    return ""


def library_config_error(text: bytes, msgspec: Any, structs: Any, workdir: Path) -> str:
    from edgefleet.transport.settings import read_toml

    path = workdir / "agent.toml"
    path.write_bytes(text)
    table = read_toml(path).get("telemetry", {})
    try:
        msgspec.convert(table, structs.TelemetrySettings)
    except msgspec.ValidationError as exc:
        return f"agent.toml: [telemetry]: {exc}"
    return ""


@dataclass
class ErrorCount:
    refused: int = 0
    named: int = 0
    fixed: int = 0


def compare_errors(msgspec: Any, structs: Any, workdir: Path) -> tuple[ErrorCount, ErrorCount, int, int]:
    """Print both sides' words per bad input; count refused / naming the field / giving the fix.

    Returns:
        today's counts, msgspec's, the number of bad inputs, and how many of them have a field to name.
    """
    today_n, library_n = ErrorCount(), ErrorCount()
    cases = bad_inputs()
    print("\nError messages, today's code and msgspec's, per bad input:")
    for case in cases:
        if case.fmt == "toml":
            words = {"today": today_config_error(case.payload, workdir),
                     "msgspec": library_config_error(case.payload, msgspec, structs, workdir)}
        else:
            words = {}
            for side, decode in (("today", today_decoder(case.name, case.fmt, structs.check_used_within_total)),
                                 ("msgspec", structs.decoder(getattr(structs, case.name), case.fmt))):
                try:
                    decode(case.payload)
                    words[side] = ""
                except DecodeError as exc:
                    words[side] = str(exc)
        print(f"\n  {case.label}")
        for side, count in (("today", today_n), ("msgspec", library_n)):
            text = words[side]
            print(f"    {side + ':':9}{text[:200] if text else 'ACCEPTED'}")
            if text:
                count.refused += 1
                count.named += bool(case.field) and case.field in text
                count.fixed += (not case.fix) or case.fix.lower() in text.lower()
    return today_n, library_n, len(cases), sum(1 for c in cases if c.field)


# ----------------------------------------------------------------------------- idle memory

BASELINE_IMPORTS = "import paho.mqtt.client, psutil, msgpack"
AGENT_IMPORTS = "import edgefleet.agent.__main__"
WITH_MSGSPEC = ("import edgefleet.agent.__main__, msgspec, _msgspec_messages as m; "
                "decoders = [m.decoder(getattr(m, n), f) for n in ('TelemetrySample', 'BoardStatus', 'BoardCaps', 'JobEvent', "
                "'TrainCommand') for f in ('json', 'msgpack')]")


def rss_of(imports: str) -> int:
    """VmRSS of a fresh ``python -c`` that ran ``imports`` and collected its garbage."""
    code = f"import gc, sys; {imports}; gc.collect(); print('ready', flush=True); sys.stdin.read()"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(BENCH), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            raise BenchError(f"`python -c {code!r}` failed: {proc.communicate(timeout=10)[1].decode(errors='replace')[-300:]}")
        with open(f"/proc/{proc.pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise BenchError(f"no VmRSS in /proc/{proc.pid}/status")
    finally:
        proc.communicate(timeout=10)


def measure_memory(runs: int) -> dict[str, float]:
    out = {}
    for label, imports in (("baseline", BASELINE_IMPORTS), ("agent", AGENT_IMPORTS), ("agent+msgspec", WITH_MSGSPEC)):
        out[label] = statistics.median(rss_of(imports) for _ in range(runs)) / MB
        print(f"  RSS {label:14} {out[label]:.1f} MB (median of {runs})", flush=True)
    return out


# ----------------------------------------------------------------------------- shell completion

BOARD_FUNCTION_BASH = ('_edgefleet_boards() { local cur="$1"; compgen -P "${cur%"${cur##*,}"}" -W "$(cat '
                       '"${XDG_CACHE_HOME:-$HOME/.cache}/edgefleet/boards" 2>/dev/null)" -- "${cur##*,}"; }\n')
BOARD_FUNCTION_ZSH = ('_edgefleet_boards() { _sequence compadd - ${(f)"$(cat "${XDG_CACHE_HOME:-$HOME/.cache}/edgefleet/boards" '
                      '2>/dev/null)"}; }\n')
# (label, words typed, what must be among the offers); the last word is the one being completed
COMPLETION_CASES: list[tuple[str, list[str], str]] = [
    ("sub-commands", ["edge-coordinator", "tr"], "train"),
    ("flags of a sub-command", ["edge-coordinator", "train", "--wire"], "--wire-dtype"),
    ("choices of a flag", ["edge-coordinator", "train", "--wire-dtype", "b"], "bfloat16"),
    ("choices of a positional", ["edge-coordinator", "completion", "z"], "zsh"),
    ("file after --config", ["edge-coordinator", "--config", "fle"], "fleet.toml"),
    ("file after train --fleet-key", ["edge-coordinator", "train", "--fleet-key", "fle"], "fleet.toml"),
    ("board ids after --boards x,", ["edge-coordinator", "train", "--boards", "pi-1,pi"], "pi-1,pi-2"),
    ("edge-agent flags", ["edge-agent", "--check"], "--check-config"),
]
HARNESS = r'''
script="$1"; prog="$2"; shift 2
source "$script" >/dev/null 2>&1
fn=$(complete -p "$prog" | sed -E 's/.* -F ([^ ]+) .*/\1/')
COMP_WORDS=("$@"); COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )); COMP_LINE="${COMP_WORDS[*]}"; COMP_POINT=${#COMP_LINE}
case "$MODE" in
    source)  # sourcing again: reading and defining, no bash start-up
        t0=$EPOCHREALTIME
        for (( n = 0; n < LOOPS; n++ )); do source "$script" >/dev/null 2>&1; done
        echo "$t0 $EPOCHREALTIME";;
    call)
        t0=$EPOCHREALTIME
        for (( n = 0; n < LOOPS; n++ )); do
            COMPREPLY=(); "$fn" "$prog" "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}" 2>/dev/null
        done
        echo "$t0 $EPOCHREALTIME";;
    *)
        "$fn" "$prog" "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}" 2>/dev/null
        printf '%s\n' "${COMPREPLY[@]}";;
esac
'''


def parsers() -> list[argparse.ArgumentParser]:
    from edgefleet.agent.__main__ import build_parser as agent_parser
    from edgefleet.coordinator.cli.main import build_parser

    return [build_parser(), agent_parser()]


def shtab_script(shtab: Any, shell: str, *, hints: bool) -> str:
    """shtab's script for both programs; ``hints``: the path and board-id actions marked as ours are."""
    from edgefleet.coordinator.cli import completion

    scripts = []
    for parser in parsers():
        if hints:
            for action in _walk(parser):
                kind = completion._value_kind(action)
                if kind == "boards":
                    action.complete = {"bash": "_edgefleet_boards", "zsh": "_edgefleet_boards"}  # type: ignore[attr-defined]
                elif kind in ("file", "dir"):
                    action.complete = shtab.FILE if kind == "file" else shtab.DIRECTORY  # type: ignore[attr-defined]
        preamble = {"bash": BOARD_FUNCTION_BASH, "zsh": BOARD_FUNCTION_ZSH} if hints else None
        scripts.append(shtab.complete(parser, shell=shell, preamble=preamble))
    return "\n".join(scripts)


def _walk(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    actions = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                actions += _walk(child)
        elif action.help != argparse.SUPPRESS:
            actions.append(action)
    return actions


@dataclass
class CompletionRow:
    label: str
    code_lines: int        # lines we maintain for it
    bash_lines: int
    zsh_lines: int
    passed: list[str] = field(default_factory=list)
    source_ms: float = 0.0
    call_ms: float = 0.0


def _bash(args: list[str], *, cwd: Path, env: dict[str, str]) -> str:
    return subprocess.run(["bash", "--norc", "--noprofile", "-c", HARNESS, "harness", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=30, check=False).stdout


def measure_completion(shtab: Any, workdir: Path, *, runs: int) -> list[CompletionRow]:
    from edgefleet.coordinator.cli import completion

    (workdir / "fleet.toml").write_text("")
    (workdir / "cache" / "edgefleet").mkdir(parents=True)
    (workdir / "cache" / "edgefleet" / "boards").write_text("jetson-1\npi-1\npi-2\n")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workdir), "XDG_CACHE_HOME": str(workdir / "cache")}
    # what we would keep with shtab: the board cache, the sub-command, and (with hints) the marking and the board functions
    kept = kept_lines(completion.board_cache_path, completion.remember_boards, completion.add_completion_parser,
                      completion.cmd_completion) + 3  # + the shtab.complete() call
    hinted = kept + kept_lines(completion._value_kind, shtab_script, _walk) + 4  # + BOARD_FUNCTION_BASH/ZSH
    variants = [
        ("today: completion.py", len(Path(completion.__file__).read_text().splitlines()),
         completion.completion_script(parsers(), shell="bash"), completion.completion_script(parsers(), shell="zsh")),
        ("shtab, plain", kept, shtab_script(shtab, "bash", hints=False), shtab_script(shtab, "zsh", hints=False)),
        ("shtab + the same hints", hinted, shtab_script(shtab, "bash", hints=True), shtab_script(shtab, "zsh", hints=True)),
    ]
    rows = []
    for label, code_lines, bash_script, zsh_script in variants:
        script = workdir / f"{len(rows)}.bash"
        script.write_text(bash_script)
        row = CompletionRow(label, code_lines, len(bash_script.splitlines()), len(zsh_script.splitlines()))
        for case, words, expected in COMPLETION_CASES:
            offers = _bash([str(script), words[0], *words], cwd=workdir, env=env).split("\n")
            if expected in offers:
                row.passed.append(case)
        row.source_ms = _loop_ms(script, "source", 20, workdir, env, runs)
        row.call_ms = _loop_ms(script, "call", 100, workdir, env, runs)
        rows.append(row)
        print(f"  {label:24} {len(row.passed)}/{len(COMPLETION_CASES)} completions, source {row.source_ms:.2f} ms, "
              f"one completion {row.call_ms:.2f} ms", flush=True)
    return rows


def kept_lines(*functions: Callable[..., Any]) -> int:
    """Source lines of ``functions``, docstrings and all: what adopting shtab would still keep of ours."""
    import inspect

    return sum(len(inspect.getsource(f).splitlines()) for f in functions)


def _loop_ms(script: Path, mode: str, loops: int, workdir: Path, env: dict[str, str], runs: int) -> float:
    """Milliseconds per source of ``script`` (``mode`` "source") or per completion of ``train --wire-dtype b``
    ("call"), timed inside bash over ``loops``; the median of ``runs`` bash processes."""
    times = []
    for _ in range(runs):
        ends = _bash([str(script), "edge-coordinator", "edge-coordinator", "train", "--wire-dtype", "b"], cwd=workdir,
                     env={**env, "MODE": mode, "LOOPS": str(loops)}).split()
        if len(ends) != 2:
            raise BenchError(f"bash did not time {mode} of {script.name}")
        times.append((float(ends[1]) - float(ends[0])) * 1000 / loops)
    return statistics.median(times)


# ----------------------------------------------------------------------------- report

def host_load() -> str:
    load1, _, _ = os.getloadavg()
    return f"load average {load1:.2f} on {os.cpu_count()} CPUs"


def report(speed: list[SpeedRow], fold: tuple[float, float], errors: tuple[ErrorCount, ErrorCount, int, int], memory: dict[str, float],
           completions: list[CompletionRow], versions: str, load: str, shtab_lines: int) -> None:
    today_e, library_e, n, n_field = errors
    rows: list[tuple[str, str, str, str, str]] = []
    for r in speed:
        wire = " (wire)" if (r.name, r.fmt) in WIRE else ""
        rows.append((f"decode {r.name}, {r.fmt}{wire}", f"{r.today_us:.2f} us", f"{r.library_us:.2f} us",
                     f"{r.library_us / r.today_us:.2f}x", f"{r.size} B"))
    rows.append(("FleetView.ingest, one sample (JSON)", f"{fold[0]:.2f} us", f"{fold[1]:.2f} us",
                 f"{fold[1] / fold[0]:.2f}x", f"{1e6 / fold[0]:,.0f} vs {1e6 / fold[1]:,.0f} msg/s"))
    rows += [
        ("bad inputs refused", f"{today_e.refused}/{n}", f"{library_e.refused}/{n}", "", "higher is better"),
        ("  names the field (of those with one)", f"{today_e.named}/{n_field}", f"{library_e.named}/{n_field}", "", ""),
        ("  gives the limit or the fix", f"{today_e.fixed}/{n}", f"{library_e.fixed}/{n}", "", ""),
        ("RSS: paho, psutil, msgpack (baseline)", f"{memory['baseline']:.1f} MB", "", "", ""),
        ("RSS: the agent's imports", f"{memory['agent']:.1f} MB", f"{memory['agent+msgspec']:.1f} MB",
         f"{memory['agent+msgspec'] / memory['agent']:.2f}x", "library: + msgspec, Structs, decoders"),
        ("  msgspec's addition", "", f"+{memory['agent+msgspec'] - memory['agent']:.1f} MB", "", "agent target <= 40 MB"),
    ]
    base = completions[0]
    for c in completions[1:]:
        rows += [
            (f"completion, {c.label}: our lines", f"{base.code_lines}", f"{c.code_lines}", "",
             f"+ shtab's {shtab_lines} lines"),
            ("  bash / zsh script lines", f"{base.bash_lines} / {base.zsh_lines}", f"{c.bash_lines} / {c.zsh_lines}", "", ""),
            ("  completions given (run in bash)", f"{len(base.passed)}/{len(COMPLETION_CASES)}",
             f"{len(c.passed)}/{len(COMPLETION_CASES)}", "",
             "misses: " + (", ".join(k for k, _, _ in COMPLETION_CASES if k not in c.passed) or "none")),
            ("  source the script", f"{base.source_ms:.2f} ms", f"{c.source_ms:.2f} ms",
             f"{c.source_ms / base.source_ms:.2f}x" if base.source_ms > 0 else "", "in bash, no start-up"),
            ("  one completion", f"{base.call_ms:.2f} ms", f"{c.call_ms:.2f} ms",
             f"{c.call_ms / base.call_ms:.2f}x", "train --wire-dtype b"),
        ]
    misses = ", ".join(k for k, _, _ in COMPLETION_CASES if k not in base.passed) or "none"
    print_table(f"Hand-written against msgspec {versions}: today is the baseline of every ratio",
                ("measure", "today", "library", "library / today", "note"), rows, min_width=140,
                caption=f"today's completion misses: {misses}. Host: {load} at the start. Times: best of passes (decode), "
                        "medians (RSS, sourcing).")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Measure today's message validation and shell completion against msgspec "
                                                 "and shtab (speed, error messages, idle memory, what completes).",
                                     epilog=f"Needs the bench extra: {INSTALL_HINT}. Exit code 0 when the run was made.")
    parser.add_argument("--repeats", type=int, default=5, metavar="N", help="timed passes per decoder, best kept (default 5)")
    parser.add_argument("--pass-s", type=float, default=0.2, metavar="S", help="seconds per timed pass (default 0.2)")
    parser.add_argument("--rss-runs", type=int, default=5, metavar="N", help="processes per RSS figure, median kept (default 5)")
    parser.add_argument("--shell-runs", type=int, default=7, metavar="N", help="bash processes per completion time, median (default 7)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.rss_runs < 1 or args.shell_runs < 1 or not 0.01 <= args.pass_s <= 10:
        parser.error("--repeats, --rss-runs and --shell-runs must be >= 1 and --pass-s within 0.01-10")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        msgspec, shtab, structs = need_libraries()
        if shutil.which("bash") is None:
            raise BenchError("bash is not installed: the completion scripts are run in it")
        load = host_load()
        workdir = Path(tempfile.mkdtemp(prefix="edgefleet-bench-libs-"))
        try:
            print("decode + validate, best of passes:", flush=True)
            speed = measure_speed(args, msgspec, structs)
            fold = measure_fold(args, structs)
            errors = compare_errors(msgspec, structs, workdir)
            print("\nidle memory:", flush=True)
            memory = measure_memory(args.rss_runs)
            print("\nshell completion (bash):", flush=True)
            completions = measure_completion(shtab, workdir, runs=args.shell_runs)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    except BenchError as exc:
        print(f"validation_libraries: {exc}", file=sys.stderr)
        return 2
    report(speed, fold, errors, memory, completions, f"{msgspec.__version__} and shtab {shtab.__version__}", load,
           len(Path(shtab.__file__).read_text().splitlines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
