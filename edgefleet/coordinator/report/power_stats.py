"""Each board's power and energy, CPU load and temperature over a run, from its logged telemetry samples."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from edgefleet.coordinator.report.run_data import PowerSample
from edgefleet.protocol.messages import is_measured

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class BoardEnergy:
    """One board's power over the time its power was logged."""

    board_id: str
    samples: int                 # samples with a power figure
    span_s: float                # from its first to its last such sample
    mean_power_w: float          # time-weighted mean (the plain mean of one sample)
    energy_j: float              # the trapezoid integral over span_s
    sources: tuple[str, ...]     # where the figures came from ("estimated", a sensor name)

    @property
    def measured(self) -> bool:
        """True when every figure came from a sensor, none from the agent's CPU-load estimate."""
        return all(is_measured(s) for s in self.sources)


def board_energy(samples: Iterable[PowerSample]) -> dict[str, BoardEnergy]:
    """Per board: its mean power and the energy it drew between its first and last sample (trapezoids)."""
    by_board: dict[str, list[PowerSample]] = {}
    for s in samples:
        if s.power_w is not None:
            by_board.setdefault(s.board_id, []).append(s)
    out = {}
    for board, seen in by_board.items():
        seen.sort(key=lambda s: s.seen_s)
        energy = sum((b.seen_s - a.seen_s) * ((a.power_w or 0.0) + (b.power_w or 0.0)) / 2 for a, b in itertools.pairwise(seen))
        span = seen[-1].seen_s - seen[0].seen_s
        mean = energy / span if span > 0 else sum(s.power_w or 0.0 for s in seen) / len(seen)
        out[board] = BoardEnergy(board_id=board, samples=len(seen), span_s=span, mean_power_w=mean, energy_j=energy,
                                 sources=tuple(sorted({s.power_source for s in seen})))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class BoardLoad:
    """One board's CPU load and temperature over the time its telemetry was logged."""

    board_id: str
    mean_cpu_percent: float | None   # the plain mean of its samples (None: none reported CPU)
    max_temp_c: float | None         # the hottest reading


def board_load(samples: Iterable[PowerSample]) -> dict[str, BoardLoad]:
    """Per board that reported either: its mean CPU load and its highest temperature."""
    cpu: dict[str, list[float]] = {}
    temp: dict[str, list[float]] = {}
    for s in samples:
        if s.cpu_percent is not None:
            cpu.setdefault(s.board_id, []).append(s.cpu_percent)
        if s.temp_c is not None:
            temp.setdefault(s.board_id, []).append(s.temp_c)
    return {b: BoardLoad(board_id=b, mean_cpu_percent=sum(cpu[b]) / len(cpu[b]) if b in cpu else None,
                         max_temp_c=max(temp[b]) if b in temp else None) for b in (*cpu, *temp)}


__all__ = ["BoardEnergy", "BoardLoad", "board_energy", "board_load"]
