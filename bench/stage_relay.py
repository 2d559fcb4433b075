"""Stage links board to board, or relayed by the coordinator: which is faster on the lab's topology (issue 35).

A pipeline's activations go from a stage host to the next, and their gradients come back. Issue 35 allows a
relay through the coordinator "if that measures faster". This bench measures it on ``fleet8``
(lab/fleets/fleet8.toml: the boards on their own shaped links, 20-100 Mbit/s; the coordinator's namespace on
1 Gbit/s), boards only (no agents):

* **direct**: the upstream board connects to the downstream board, as ``train --pipeline``'s stage links do;
* **relayed**: it connects to a relay in the coordinator's namespace, which connects to the downstream board and
  copies bytes both ways as they come (``bench/_relay_ends.py``: a streaming relay, the best case for one; a
  relay that ended TLS at the coordinator would also decrypt and re-encrypt every frame).

A round is one frame of activations down and as many bytes of gradient back, as a micro-batch's forward and
backward cross a cut. Frame sizes (``--sizes``, KiB): 128 (64 samples x 2 KiB, what each stage-0 board of the
planner's pick for conv_mlp sends per step; bench/pipeline.py), 1,024 and 4,096. Pairs (``--pairs``):
``x86-1>pi5-2`` (both wired), ``pi5-1>pi5-2`` (5 GHz Wi-Fi to wired), ``pi4-1>x86-1`` (2.4 GHz Wi-Fi to wired).
Direct and relayed blocks alternate (``--blocks`` of each, ``--rounds`` rounds a block, the first round of a
block left out: TCP's slow start); each figure is the median round. The ends run in the boards' namespaces and
cgroups (their CPU quotas), plain TCP (TLS costs the ends the same either way).

The table's ``wire`` is the round at the links' set rates (frame out at the slower of the sender's upload and
the receiver's download, and back), no latency; ``relayed / direct`` above 1 means the relay is slower.

Needs root (the lab). Usage::

    python bench/stage_relay.py [--pairs x86-1>pi5-2,...] [--sizes 128,1024,4096] [--blocks 2] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from _harness import BenchError, sigterm_as_ctrl_c
from _table import print_table

if TYPE_CHECKING:
    from edgefleet.lab.lab import Lab
    from edgefleet.lab.supervisor import BoardProcess

ENDS = Path(__file__).resolve().parent / "_relay_ends.py"
DEFAULT_PAIRS = "x86-1>pi5-2,pi5-1>pi5-2,pi4-1>x86-1"
DEFAULT_SIZES = "128,1024,4096"
START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Figure:
    """One pair at one frame size: median rounds, direct and relayed, and the wire's round."""

    pair: str
    kib: int
    direct_s: float
    relayed_s: float
    wire_s: float

    @property
    def ratio(self) -> float:
        return self.relayed_s / self.direct_s


def _listening_port(proc: BoardProcess) -> str:
    """The port a listening end printed (``listening PORT``)."""
    from edgefleet.lab.measurements import expect_line

    try:
        return expect_line(proc, "listening", timeout_s=START_TIMEOUT_S).split()[1]
    except RuntimeError as exc:
        raise BenchError(str(exc)) from None


def _block(lab: Lab, src: str, dst: str, size: int, rounds: int, *, relayed: bool) -> list[float]:
    """One block of rounds from ``src`` to ``dst``: their round times, the first (slow start) left out."""
    from edgefleet.lab.naming import SERVER_ADDRESS

    py = sys.executable
    dst_address = str(lab.board(dst).address)
    started: list[BoardProcess] = []
    try:
        sink = lab.start_in_board(dst, "relay-sink", [py, str(ENDS), "sink", "--bind", dst_address, "--bytes", str(size)],
                                  capture_stdout=True, expect_exit=True)
        started.append(sink)
        to = f"{dst_address}:{_listening_port(sink)}"
        if relayed:
            relay = lab.start_in_server("relay", [py, str(ENDS), "relay", "--bind", str(SERVER_ADDRESS), "--to", to],
                                        capture_stdout=True, expect_exit=True)
            started.append(relay)
            to = f"{SERVER_ADDRESS}:{_listening_port(relay)}"
        source = lab.start_in_board(src, "relay-source", [py, str(ENDS), "source", "--to", to, "--bytes", str(size),
                                                           "--rounds", str(rounds + 1)], capture_stdout=True, expect_exit=True)
        started.append(source)
        line = source.readline(timeout_s=60 + rounds * size * 8 / 1e6)
        if not line:
            raise BenchError(f"the source on {src} gave no result:\n{source.log()[-1500:]}")
        return list(json.loads(line)["rounds_s"][1:])
    finally:
        for proc in reversed(started):
            lab.supervisor.stop(proc)


def _wire_s(lab: Lab, src: str, dst: str, size: int) -> float:
    a, b = lab.board(src).spec, lab.board(dst).spec
    return size * 8 / min(a.rate_up_bps, b.rate_down_bps) + size * 8 / min(b.rate_up_bps, a.rate_down_bps)


def measure(pairs: list[tuple[str, str]], sizes_kib: list[int], blocks: int, rounds: int) -> list[Figure]:
    from edgefleet.lab.fixtures import FLEET8
    from edgefleet.lab.fleet_file import FleetError, load_fleet
    from edgefleet.lab.lab import Lab

    try:
        fleet = load_fleet(FLEET8)
    except FleetError as exc:
        raise BenchError(f"fleet8 does not fit this machine: {exc}") from exc
    figures = []
    with Lab(fleet, start_agents=False) as lab:
        for src, dst in pairs:
            for kib in sizes_kib:
                size = kib * 1024
                direct: list[float] = []
                relayed: list[float] = []
                for _ in range(blocks):
                    direct += _block(lab, src, dst, size, rounds, relayed=False)
                    relayed += _block(lab, src, dst, size, rounds, relayed=True)
                figure = Figure(f"{src}>{dst}", kib, statistics.median(direct), statistics.median(relayed),
                                _wire_s(lab, src, dst, size))
                print(f"  {figure.pair} {kib} KiB: direct {figure.direct_s * 1e3:.1f} ms, relayed {figure.relayed_s * 1e3:.1f} ms "
                      f"({figure.ratio:.2f}x)", file=sys.stderr, flush=True)
                figures.append(figure)
    return figures


def _pairs(text: str) -> list[tuple[str, str]]:
    pairs = []
    for item in text.split(","):
        src, sep, dst = item.partition(">")
        if not sep or not src or not dst or src == dst:
            raise argparse.ArgumentTypeError(f"a pair is SRC>DST with two different boards, not {item!r}")
        pairs.append((src, dst))
    return pairs


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"sizes are KiB, comma-separated whole numbers, not {text!r}") from None
    if any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"a size is at least 1 KiB, not {text!r}")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=_pairs, default=_pairs(DEFAULT_PAIRS), help=f"SRC>DST,... (default {DEFAULT_PAIRS})")
    parser.add_argument("--sizes", type=_sizes, default=_sizes(DEFAULT_SIZES), help=f"frame sizes in KiB (default {DEFAULT_SIZES})")
    parser.add_argument("--blocks", type=int, default=2, help="blocks of each way, alternating (default 2)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds a block, after one left out (default 6)")
    args = parser.parse_args()
    if args.blocks < 1 or args.rounds < 1:
        parser.error("--blocks and --rounds are at least 1")
    signal.signal(signal.SIGTERM, sigterm_as_ctrl_c)
    try:
        figures = measure(args.pairs, args.sizes, args.blocks, args.rounds)
    except BenchError as exc:
        sys.exit(f"stage_relay: {exc}")
    except KeyboardInterrupt:
        sys.exit("stage_relay: stopped")
    rows = [[f.pair, f"{f.kib:,}", f"{f.wire_s * 1e3:.1f}", f"{f.direct_s * 1e3:.1f}", f"{f.relayed_s * 1e3:.1f}", f"{f.ratio:.2f}"]
            for f in figures]
    print_table("Stage links on fleet8: a round (frame out, as many bytes back), median ms",
                ["pair", "KiB", "wire", "direct", "relayed", "relayed / direct"], rows,
                caption=f"{args.blocks} blocks of {args.rounds} rounds each way, alternating")


if __name__ == "__main__":
    main()
