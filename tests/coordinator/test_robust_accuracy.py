"""Issue 36's "within 1 point": with local data, one lying board costs a robust rule at most 1 point of accuracy.

In one process, with the exchange's own rules (``coordinator.exchange.robust_reduce.aggregate``) and the
simulation bench/robust_accuracy.py measures LeNet-5 with (bench/_robust_fleet.py): a small MLP on 8x8
digits, ``k`` boards with local data, once honest and once with the last board lying from step 3 (2,000x
its gradient; or turned around, at honest norm). For each rule at a board count where it is meant to hold,
the accuracy with the liar (the mean of the last evaluations, over three seeds) is at most 1 point under
the same rule's run without it. The exact mode (the sample-weighted mean) loses far more to the 2,000x
board, so the test can fail. A lying sample count never reaches a rule: the exchange refuses it
(tests/hostile/test_lying_boards.py).

Each seed's two runs start from one model and draw the same batches, on one thread: the difference is the
liar's, and the figures are the same on every run on one machine.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load() -> ModuleType:
    # bench/ is a folder of scripts, not a package: the module is loaded from its file.
    spec = importlib.util.spec_from_file_location("_robust_fleet", BENCH / "_robust_fleet.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


rf = _load()

WORKLOAD = rf.Workload(model="mlp", model_options={"layers": 1, "width": 32, "optimizer": "sgd", "lr": 0.05},
                       dataset_options={"size": 8}, batch=32, steps=300, eval_every=20)
SEEDS = (0, 1, 2)
MEAN_SEEDS = (0,)   # the exact mean is wrecked on every seed: one shows it
EVALUATIONS = 5      # the accuracy compared: the mean of the last five evaluations (steps 220 to 300)
POINT = 0.01
# (rule, boards, attack) where the rule is meant to hold; the median of 3 holds against the 2,000x board,
# not against a flipped one (about -1 point on this workload: docs/security.md)
HOLDS = [(rule, 5, attack) for rule in ("median", "trimmed-mean", "clip") for attack in ("scale", "flip")]
HOLDS.append(("median", 3, "scale"))

Runs = Callable[[str, int, str], list[Any]]  # the runs are bench/_robust_fleet.Outcome (a module loaded from its file)


@pytest.fixture(scope="module")
def runs() -> Iterator[Runs]:
    """Each (rule, boards, attack)'s runs over the seeds, computed once for the module, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    data = rf.load_data(WORKLOAD)
    done: dict[tuple[str, int, str], list[Any]] = {}

    def outcomes(rule: str, boards: int, attack: str) -> list[Any]:
        key = (rule, boards, attack)
        if key not in done:
            seeds = MEAN_SEEDS if rule == "mean" else SEEDS
            done[key] = [rf.simulate(rule, boards, attack, seed, WORKLOAD, data) for seed in seeds]
        return done[key]

    try:
        yield outcomes
    finally:
        torch.set_num_threads(threads)


def _change(runs: Runs, rule: str, boards: int, attack: str) -> float:
    """The liar's change in accuracy against the same rule's honest runs (a fraction; -0.01 is one point lost)."""
    return float(rf.change([*runs(rule, boards, "honest"), *runs(rule, boards, attack)], rule, boards, attack,
                           EVALUATIONS)[1])


@pytest.mark.parametrize(("rule", "boards", "attack"), HOLDS, ids=[f"{r}-{k}-{a}" for r, k, a in HOLDS])
def test_one_liar_costs_a_robust_rule_at_most_one_point(runs: Runs, rule: str, boards: int, attack: str) -> None:
    honest = [o.last(EVALUATIONS) for o in runs(rule, boards, "honest")]
    assert min(honest) > 0.9, honest  # the rule trains: a point is a point of a useful model
    change = _change(runs, rule, boards, attack)
    assert change >= -POINT, f"{rule} on {boards} boards, {attack}: {100 * change:+.2f} points against its honest run"


def test_the_exact_mean_is_wrecked_by_the_2000x_board(runs: Runs) -> None:
    """What the rules are for: without one, the same liar costs the same workload most of its accuracy."""
    change = _change(runs, "mean", 5, "scale")
    assert change < -30 * POINT, f"the mean with a 2,000x board: {100 * change:+.2f} points"
