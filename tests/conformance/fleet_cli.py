"""The conformance fleet's job as the real CLI runs it: one command line per case, and a run interrupted and resumed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conformance.conftest import BOARDS
from tests.conformance.reference import Case
from tests.conftest import Fleet
from tests.helpers import interrupt_after

BATCHES = "4,8,12"
GLOBAL_BATCH = 24
STEPS = 20
SEED = 3
TOLERANCE = 1e-5
INTERRUPT_AFTER = 4  # steps before Ctrl-C: mid-run, mid-epoch for the small data sets
_FLAGS = {"gradient_clip_val": "--gradient-clip-val", "gradient_clip_algorithm": "--gradient-clip-algorithm",
          "accumulate_grad_batches": "--accumulate-grad-batches", "precision": "--precision"}


def cli_command(fleet: Fleet, case: Case, run_dir: Path, *extra: str) -> list[str]:
    """``edge-coordinator train`` for ``case`` on the three boards at 4/8/12, ``STEPS`` steps, one torch thread."""
    data: dict[str, Any] = ({"datamodule": case.datamodule, "datamodule_options": case.datamodule_options} if case.datamodule
                            else {"dataset": str(case.dataset), "dataset_options": case.dataset_options})
    trainer = [arg for name, value in case.trainer.items()
               for arg in (["--deterministic"] if name == "deterministic" else [_FLAGS[name], str(value)])]
    return fleet.train_command(*trainer, *extra, boards=BOARDS, batch=BATCHES, steps=STEPS, seed=SEED, threads=1,
                               no_rebalance=True, run_dir=run_dir, model=case.model, model_options=case.model_options, **data)


def steps_of(run_dir: Path) -> list[dict[str, Any]]:
    """The run's ``metrics.jsonl`` records (none yet: [])."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def interrupt_then_resume(fleet: Fleet, case: Case, run_dir: Path) -> dict[str, Any]:
    """Train ``case`` with a checkpoint every step, Ctrl-C it mid-run, then ``--resume`` it to the end.

    Returns the replica's state the interrupted run's ``checkpoint.pt`` held (``step``, ``model``, ``module``, ...).
    """
    import torch

    cmd = cli_command(fleet, case, run_dir, "--checkpoint-every", "1")
    code, out, err = interrupt_after(cmd, lambda: len(steps_of(run_dir)), INTERRUPT_AFTER,
                                     what=f"{INTERRUPT_AFTER} steps before the interruption")
    assert code == 130, err + out
    stopped_at = json.loads((run_dir / "result.json").read_text())["steps"]
    assert INTERRUPT_AFTER <= stopped_at < STEPS
    checkpointed: dict[str, Any] = torch.load(run_dir / "checkpoint.pt", weights_only=True)["replica"]
    resumed = fleet.train(resume=run_dir, timeout_s=300)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert [s["step"] for s in steps_of(run_dir)] == list(range(STEPS))
    return checkpointed
