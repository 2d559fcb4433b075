"""Read a run directory for its report, whatever state the run left it in.

A run writes ``config.json`` (the resolved job), ``metrics.jsonl`` (one line per applied step, a
re-balance riding in the line of the step that decided it), ``result.json`` (at the end),
``plan.json`` (``train --auto``: the prediction and the measurement) and, when its power was
logged, ``power.jsonl`` (:mod:`.power_log`). A crashed run lacks some of them and may end in half
a line; an older or hand-edited one may hold values of the wrong type. Nothing here raises for
that: every file and line that cannot be used becomes a sentence in :attr:`RunData.missing`,
which the page shows, and the rest is reported.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgefleet.coordinator.report.power_log import POWER_FILE
from edgefleet.protocol.errors import ConfigError

log = logging.getLogger(__name__)

PLAUSIBLE = 1e12   # larger step figures are damage, not data
# checkpoints.RUN_FILES, repeated: that module imports torch, which a report has no use for.
RUN_FILES = ("config.json", "metrics.jsonl", "checkpoint.pt", "checkpoint.prev.pt", "result.json", "model.pt", "plan.json", "logs")


@dataclass(frozen=True, slots=True, kw_only=True)
class Rebalance:
    """A change of the boards' batch sizes, decided after ``step`` and in force from ``from_step``."""

    step: int
    from_step: int
    old_batch_sizes: dict[str, int]
    new_batch_sizes: dict[str, int]
    message: str
    elapsed_s: float | None            # run time of the deciding step's line


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One line of ``metrics.jsonl``: an applied step."""

    step: int
    elapsed_s: float | None            # seconds since the run's first step (resumes included)
    loss: float | None                 # the fleet's sample-weighted training loss
    compute_s: dict[str, float]        # each contributing board's compute time
    batch_sizes: dict[str, int]
    late: list[str]                    # boards left out of this step for missing its deadline
    refused: list[str]                 # boards whose gradients were refused
    logs: dict[str, float]             # what training_step logged
    val_metrics: dict[str, float]      # the validation at an epoch's end ({} on other steps)
    lr: list[float] = field(default_factory=list)  # the learning rate of each param group ([] in older runs)
    samples: int | None = None         # samples in the step's average (n)


@dataclass(frozen=True, slots=True, kw_only=True)
class PowerSample:
    """One board's power reading, as :class:`~edgefleet.coordinator.report.power_log.PowerLog` wrote it."""

    board_id: str
    seen_s: float                      # coordinator seconds since the power log was opened
    power_w: float | None
    power_source: str
    cpu_percent: float | None = None   # all cores, 0-100 (None: not reported, or an older log)
    temp_c: float | None = None        # the board's hottest sensor


@dataclass(frozen=True, slots=True, kw_only=True)
class RunData:
    """Everything the report shows about one run, and what it could not find."""

    run_dir: Path
    config: dict[str, Any]             # config.json ({} if missing)
    result: dict[str, Any] | None      # result.json (None: the run did not finish, or it is unreadable)
    plan: dict[str, Any] | None        # plan.json (None: the run was not planned)
    steps: list[StepRecord]
    rebalances: list[Rebalance]
    power: list[PowerSample]
    files: dict[str, bool]             # each file a run writes: present or not
    missing: list[str] = field(default_factory=list)   # one sentence per missing or damaged part

    @property
    def run_id(self) -> str:
        return _text(self.config.get("run_id")) or _text((self.result or {}).get("run_id")) or self.run_dir.name

    @property
    def boards(self) -> list[str]:
        """The job's boards in order, then any other board the steps or the power log name."""
        named = [b for b in _list(self.config.get("boards")) if isinstance(b, str)]
        for record in self.steps:
            named += [b for b in (*record.compute_s, *record.batch_sizes) if b not in named]
        named += [s.board_id for s in self.power if s.board_id not in named]
        return list(dict.fromkeys(named))


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None for anything else (a string, null, NaN, a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def reading(value: Any) -> float | None:
    """A per-step or per-sample figure: :func:`number`, but None beyond +-1e12 too (no plot can scale to that)."""
    v = number(value)
    return v if v is not None and abs(v) < PLAUSIBLE else None


def _numbers(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        return {}
    return {str(k): v for k, raw in value.items() if (v := reading(raw)) is not None}


def _ints(value: Any) -> dict[str, int]:
    return {k: int(v) for k, v in _numbers(value).items()}


def _names(value: Any) -> list[str]:
    """Board names from a list, or from a dict's keys (``refused`` maps a board to its reason)."""
    items = list(value) if isinstance(value, (list, dict)) else []
    return [str(b) for b in items]


def _read_json(path: Path, missing: list[str], absent: str) -> dict[str, Any] | None:
    if not path.exists():
        if absent:
            missing.append(absent)
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError) as exc:
        missing.append(f"{path.name} cannot be read ({exc}); its part of the report is left out.")
        return None
    if not isinstance(value, dict):
        missing.append(f"{path.name} holds a {type(value).__name__}, not an object; its part of the report is left out.")
        return None
    return value


def _read_lines(path: Path, missing: list[str]) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file; lines that are not one are counted in ``missing``."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        missing.append(f"{path.name} cannot be read ({exc}).")
        return []
    records, bad = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:
            value = None
        if isinstance(value, dict):
            records.append(value)
        else:
            bad += 1
    if bad:
        missing.append(f"{path.name}: {bad} line{'s' if bad != 1 else ''} not whole JSON (a crash cut the file short?) "
                       "left out.")
    return records


def _step(raw: dict[str, Any]) -> StepRecord | None:
    step = reading(raw.get("step"))
    if step is None:
        return None
    val = _numbers(raw.get("val_metrics")) or _numbers({k: raw.get(k) for k in ("val_accuracy", "val_loss")})  # older lines
    return StepRecord(step=int(step), elapsed_s=reading(raw.get("elapsed_s")), loss=reading(raw.get("loss")),
                      compute_s=_numbers(raw.get("compute_s")), batch_sizes=_ints(raw.get("batch_sizes")),
                      late=_names(raw.get("late")), refused=_names(raw.get("refused")), logs=_numbers(raw.get("logs")),
                      val_metrics=val, lr=_rates(raw.get("lr")), samples=_count(raw.get("n")))


def _rates(value: Any) -> list[float]:
    """Learning rates, one per param group: a list of numbers, or [] for anything else."""
    rates = [reading(v) for v in value] if isinstance(value, list) else []
    return [] if None in rates else [r for r in rates if r is not None]


def _count(value: Any) -> int | None:
    n = reading(value)
    return int(n) if n is not None and n >= 0 else None


def _rebalance(raw: Any, elapsed_s: float | None) -> Rebalance | None:
    if not isinstance(raw, dict) or reading(raw.get("step")) is None or reading(raw.get("from_step")) is None:
        return None
    return Rebalance(step=int(raw["step"]), from_step=int(raw["from_step"]), old_batch_sizes=_ints(raw.get("old_batch_sizes")),
                     new_batch_sizes=_ints(raw.get("new_batch_sizes")), message=str(raw.get("message", "")),
                     elapsed_s=elapsed_s)


def _power(raw: dict[str, Any]) -> PowerSample | None:
    seen = reading(raw.get("seen_s"))
    board = raw.get("board_id")
    if seen is None or not isinstance(board, str):
        return None
    return PowerSample(board_id=board, seen_s=seen, power_w=reading(raw.get("power_w")),
                       power_source=str(raw.get("power_source", "none")), cpu_percent=reading(raw.get("cpu_percent")),
                       temp_c=reading(raw.get("temp_c")))


def check_run_dir(run_dir: Path) -> dict[str, bool]:
    """Which of a run's files ``run_dir`` holds.

    Raises:
        ConfigError: ``run_dir`` is not a folder, or holds none of a run's files.
    """
    if not run_dir.exists():
        raise ConfigError(f"{run_dir} does not exist; give the run directory train printed (runs/<run-id>)")
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is a file, not a run directory; give the folder train printed (runs/<run-id>)")
    files = {name: (run_dir / name).exists() for name in (*RUN_FILES, POWER_FILE)}
    if not any(files.values()):
        raise ConfigError(f"{run_dir} is not a run directory (it holds none of {', '.join(RUN_FILES)}); "
                          "give the folder train printed (runs/<run-id>)")
    return files


def load_run(run_dir: Path) -> RunData:
    """Read ``run_dir``; every part that is missing or damaged is named in the result's ``missing``.

    Raises:
        ConfigError: ``run_dir`` is not a run directory (see :func:`check_run_dir`).
    """
    files = check_run_dir(run_dir)
    missing: list[str] = []
    config = _read_json(run_dir / "config.json", missing,
                        "config.json is missing: the job's settings (model, dataset, boards) are unknown.") or {}
    result = _read_json(run_dir / "result.json", missing,
                        "result.json is missing: the run did not finish (it crashed, was killed, or is still running); "
                        "the report shows the steps it logged.")
    plan = _read_json(run_dir / "plan.json", missing, "")
    steps, rebalances = [], []
    if files["metrics.jsonl"]:
        for raw in _read_lines(run_dir / "metrics.jsonl", missing):
            record = _step(raw)
            if record is None:
                continue
            steps.append(record)
            event = _rebalance(raw.get("rebalance"), record.elapsed_s)
            if event is not None:
                rebalances.append(event)
        if not steps:
            missing.append("metrics.jsonl holds no step: the run stopped before its first step was applied.")
    else:
        missing.append("metrics.jsonl is missing: no step was logged, so there is nothing to plot over steps.")
    power: list[PowerSample] = []
    if files[POWER_FILE]:
        power = [s for raw in _read_lines(run_dir / POWER_FILE, missing) if (s := _power(raw)) is not None]
    if not any(s.power_w is not None for s in power):
        missing.append(f"No power readings: this run directory has no {POWER_FILE} with power figures, so power and "
                       "energy per board cannot be shown.")
    log.debug("%s: %d steps, %d re-balances, %d power samples", run_dir, len(steps), len(rebalances), len(power))
    return RunData(run_dir=run_dir, config=config, result=result, plan=plan, steps=sorted(steps, key=lambda s: s.step),
                   rebalances=rebalances, power=power, files=files, missing=missing)


__all__ = ["PowerSample", "Rebalance", "RunData", "StepRecord", "check_run_dir", "load_run", "number", "reading"]
