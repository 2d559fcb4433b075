"""Rolling a run back past a board that failed its audit, and going on without it.

A board is audited at random steps (``coordinator.audit.schedule``), so every step it contributed to
and that was not audited may carry a lie, back to its first: the run goes back to before that, the
run's start. :func:`save_start` keeps the replica's state at step 0 (``start.pt`` in the run
directory, beside the checkpoints) when a run with audits begins; :func:`roll_back` makes it the
run's checkpoint again, with the failing boards out of the job (their share of the global batch
divided among the others, so the global batches, and with them the mathematics, are the same), and
records why in ``audits.json``. ``train`` then resumes the run from it (``coordinator.run.train_job``):
the model it ends with is the one the other boards alone would have trained.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from edgefleet.coordinator.audit.auditor import AuditFailure
from edgefleet.coordinator.run.checkpoints import (
    CHECKPOINT,
    KEEP_PREVIOUS,
    atomic_torch_save,
    atomic_write_json,
    save_checkpoint,
)
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.protocol.errors import EdgeTrainError

log = logging.getLogger(__name__)

START = "start.pt"          # the replica's state at step 0, while audits may still roll the run back to it
AUDITS = "audits.json"      # the failed audits and the rollbacks they caused


class RollbackError(EdgeTrainError):
    """A board failed its audit and the run cannot go on without it (no start state, or no other board)."""


def save_start(run_dir: Path, state: dict[str, Any]) -> None:
    """Keep ``state`` (a checkpoint's, at step 0) as the state audits roll back to."""
    atomic_torch_save(run_dir / START, state)


def without_boards(spec: JobSpec, leaving: set[str]) -> JobSpec:
    """``spec`` without ``leaving``: their share of the global batch divided among the others, in proportion to
    their batches (largest remainders first), so that the global batch stays the same.

    Raises:
        RollbackError: no board would be left.
    """
    kept = [(board, size) for board, size in zip(spec.boards, spec.batch_sizes) if board not in leaving]
    if not kept:
        raise RollbackError(f"every board of the run failed its audit ({', '.join(sorted(leaving))}): no board is left "
                            "to train on; check those boards (their software, their keys) and start the run again")
    total, kept_total = sum(spec.batch_sizes), sum(size for _, size in kept)
    exact = [size * total / kept_total for _, size in kept]
    sizes = [int(x) for x in exact]
    for i in sorted(range(len(kept)), key=lambda i: (sizes[i] - exact[i], i))[:total - sum(sizes)]:
        sizes[i] += 1
    return dataclasses.replace(spec, boards=tuple(board for board, _ in kept), batch_sizes=tuple(sizes), force_split=None)


def roll_back(run_dir: Path, spec: JobSpec, failures: list[AuditFailure]) -> JobSpec:
    """Make the run's start its checkpoint again, without the boards of ``failures``; the job to resume.

    Raises:
        RollbackError: no start state is kept (a run begun without audits), or no board would be left.
        RunDirError: the run directory could not be written.
    """
    start = run_dir / START
    leaving = {failure.board_id for failure in failures}
    if not start.exists():
        raise RollbackError(f"{'; '.join(f.describe() for f in failures)}. The run cannot be rolled back: {run_dir} keeps "
                            f"no {START} (it began without audits). Start it again without "
                            f"{', '.join(sorted(leaving))} (--boards)")
    new_spec = without_boards(spec, leaving)
    state = load_start(run_dir)
    for name in (CHECKPOINT, KEEP_PREVIOUS):  # the checkpoints hold the lies: neither may be resumed from
        (run_dir / name).unlink(missing_ok=True)
    save_checkpoint(run_dir, state)
    atomic_write_json(run_dir / "config.json", new_spec.to_json())
    record = audit_record(run_dir)
    record.setdefault("rollbacks", []).append({
        "failures": [dataclasses.asdict(f) | {"message": f.describe()} for f in failures],
        "to_step": int(state["replica"]["step"]), "boards_left": list(new_spec.boards),
        "batch_sizes": list(new_spec.batch_sizes)})
    atomic_write_json(run_dir / AUDITS, record)
    log.warning("rolled the run back to step %s without %s", state["replica"]["step"], ", ".join(sorted(leaving)))
    return new_spec


def load_start(run_dir: Path) -> dict[str, Any]:
    """The state kept at the run's start (a checkpoint's dict).

    Raises:
        RollbackError: it cannot be read.
    """
    path = run_dir / START
    try:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)  # torch types it as Any
    except Exception as exc:  # a damaged or missing file: the run cannot go back to its start
        raise RollbackError(f"{path} cannot be read ({exc}): the run cannot be rolled back to its start; start it again "
                            "without the board that failed its audit (--boards)") from None
    return state


def audit_record(run_dir: Path) -> dict[str, Any]:
    """``audits.json`` as written so far (empty: no board failed an audit)."""
    path = run_dir / AUDITS
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


__all__ = ["AUDITS", "START", "RollbackError", "audit_record", "load_start", "roll_back", "save_start", "without_boards"]
