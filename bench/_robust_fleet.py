"""A fleet in local-data mode with one lying board, simulated in one process with the exchange's own rules.

Shared by bench/robust_accuracy.py (LeNet-5, many steps: the figures) and
tests/coordinator/test_robust_accuracy.py (a small MLP, few steps: the "within 1 point" of issue 36),
so that the test checks the very simulation the figures come from. No sockets, no agents: every
board's gradient is computed here on its own shard, one board lies, the rule
(``coordinator.exchange.robust_reduce.aggregate``, or the exact mode's sample-weighted mean) reduces
the boards' gradients, and one optimizer step follows, as every replica of the fleet takes it.

* Each of ``boards`` boards holds local data (the coordinator holds none of it) and draws ``batch``
  samples a step from it with its own shuffle (``workloads.sharding.LocalBatchPlan``, board seed =
  its index). By default every board holds the whole training split, as the fleet's local-data tests
  run (every board has digits): the boards' data are alike. With ``Workload.disjoint`` each holds its
  own disjoint shard (every ``boards``-th sample from its index on): then a flipped gradient is
  gradient ascent on samples no honest board holds, a harder case than alike data.
* The last board lies from step :data:`LIE_FROM` on: ``scale`` sends :data:`SCALE` times its honest
  gradient, ``flip`` sends it turned around (honest norm), ``honest`` does not lie. Its sample count is
  honest: a lying count is refused by the exchange's step round before any rule sees it
  (tests/hostile/test_lying_boards.py).
* The honest run and the liar's run of one seed start from the same model and draw the same
  batches, so their difference is the liar's doing, not the draw's.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from edgefleet.coordinator.exchange.robust_reduce import aggregate
from edgefleet.workloads.registry import build_dataset, build_model
from edgefleet.workloads.sharding import LocalBatchPlan

log = logging.getLogger(__name__)

LIE_FROM = 3        # the liar's first lying step (the fleet tests' liars start there too)
SCALE = 2000.0      # the scaled attack's factor on the honest gradient
ATTACKS = ("honest", "scale", "flip")


@dataclass(frozen=True, slots=True)
class Workload:
    """What every simulated run trains: a registry model with SGD on a registry dataset."""

    model: str = "lenet5"
    model_options: Mapping[str, Any] = field(default_factory=lambda: {"optimizer": "sgd", "lr": 0.05})
    dataset: str = "digits"
    dataset_options: Mapping[str, Any] = field(default_factory=dict)
    batch: int = 32          # samples a board a step
    steps: int = 600
    eval_every: int = 50     # steps between validation accuracies
    disjoint: bool = False   # each board its own disjoint shard, instead of the whole split


@dataclass(frozen=True, slots=True)
class LocalData:
    """The workload's dataset as tensors: the training split (sharded over boards) and the validation split."""

    train: Any
    inputs: torch.Tensor
    targets: torch.Tensor
    val_inputs: torch.Tensor
    val_targets: torch.Tensor


@dataclass(frozen=True, slots=True)
class Outcome:
    """One simulated run: its validation accuracies, every ``eval_every`` steps."""

    rule: str
    boards: int
    attack: str
    seed: int
    accuracies: tuple[float, ...]

    @property
    def final(self) -> float:
        return self.accuracies[-1]

    def last(self, evaluations: int = 3) -> float:
        """The mean of the last ``evaluations`` accuracies (damps one evaluation's luck)."""
        return statistics.fmean(self.accuracies[-evaluations:])


def load_data(workload: Workload) -> LocalData:
    """Build the workload's dataset once; every run shards the same tensors."""
    train = build_dataset(workload.dataset, "train", dict(workload.dataset_options))
    val = build_dataset(workload.dataset, "val", dict(workload.dataset_options))
    return LocalData(train, train.inputs, train.targets, val.inputs, val.targets)


def board_shards(samples: int, boards: int, *, disjoint: bool) -> list[torch.Tensor]:
    """Each board's own samples: the whole split, or disjoint shards (every ``boards``-th index from the board's own)."""
    if disjoint:
        return [torch.arange(i, samples, boards) for i in range(boards)]
    return [torch.arange(samples)] * boards


def lie(gradient: np.ndarray, attack: str) -> None:
    """Turn the liar's honest ``gradient`` into ``attack``'s, in place."""
    if attack == "scale":
        gradient *= SCALE
    elif attack == "flip":
        gradient *= -1.0
    elif attack != "honest":
        raise ValueError(f"attack {attack!r} is not one of {', '.join(ATTACKS)}")


def reduce_into(rule: str, rows: np.ndarray, counts: Sequence[int], out: np.ndarray) -> None:
    """``rule``'s step gradient: the exact mode's sample-weighted mean for ``mean``, else the exchange's robust rule."""
    if rule == "mean":
        weights = np.asarray(counts, dtype=np.float64) / float(sum(counts))
        np.dot(weights.astype(np.float32), rows, out=out)
    else:
        aggregate(rule, rows, counts, out)


def accuracy(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """The share of ``inputs`` the model classifies right."""
    model.eval()
    with torch.no_grad():
        correct = int((model(inputs).argmax(dim=1) == targets).sum())
    model.train()
    return correct / len(targets)


def simulate(rule: str, boards: int, attack: str, seed: int, workload: Workload, data: LocalData) -> Outcome:
    """Train ``workload`` on ``boards`` simulated boards reduced by ``rule``, the last one lying by ``attack``.

    One backward a board a step through the model's own ``training_step`` (for models this small,
    ``torch.func.vmap`` over the boards was slower, not faster).
    """
    torch.manual_seed(seed)
    model = build_model(workload.model, dict(workload.model_options), data=data.train)
    optimizer = model.configure_optimizers()
    params = [p for p in model.parameters() if p.requires_grad]
    shards = board_shards(len(data.targets), boards, disjoint=workload.disjoint)
    plans = [LocalBatchPlan(len(shard), workload.batch, seed, board_seed=i) for i, shard in enumerate(shards)]
    rows = np.empty((boards, sum(p.numel() for p in params)), dtype=np.float32)
    out = np.empty(rows.shape[1], dtype=np.float32)
    counts = [workload.batch] * boards
    accuracies: list[float] = []
    for step in range(workload.steps):
        for i, (shard, plan) in enumerate(zip(shards, plans)):
            picked = shard[torch.as_tensor(plan.indices(step))]
            loss = model.training_step((data.inputs[picked], data.targets[picked]), step)
            gradient = torch.autograd.grad(loss, params)
            torch.cat([g.reshape(-1) for g in gradient], out=torch.from_numpy(rows[i]))
        if step >= LIE_FROM:
            lie(rows[-1], attack)
        reduce_into(rule, rows, counts, out)
        start = 0
        for p in params:
            p.grad = torch.from_numpy(out[start:start + p.numel()].copy()).reshape(p.shape)
            start += p.numel()
        optimizer.step()
        if (step + 1) % workload.eval_every == 0:
            accuracies.append(accuracy(model, data.val_inputs, data.val_targets))
    log.debug("%s, %d boards, %s, seed %d: %s", rule, boards, attack, seed, accuracies)
    return Outcome(rule, boards, attack, seed, tuple(accuracies))


def change(outcomes: Sequence[Outcome], rule: str, boards: int, attack: str, evaluations: int = 3) -> tuple[float, float]:
    """``attack``'s change in accuracy against the same rule's honest run of the same seed, averaged over seeds:
    (final, mean of the last ``evaluations``), as fractions (0.01 is one point)."""
    honest = {o.seed: o for o in outcomes if (o.rule, o.boards, o.attack) == (rule, boards, "honest")}
    runs = [o for o in outcomes if (o.rule, o.boards, o.attack) == (rule, boards, attack) and o.seed in honest]
    if not runs:
        raise ValueError(f"no {rule} run on {boards} boards with attack {attack} and an honest run of its seed")
    return (statistics.fmean(o.final - honest[o.seed].final for o in runs),
            statistics.fmean(o.last(evaluations) - honest[o.seed].last(evaluations) for o in runs))


__all__ = ["ATTACKS", "LIE_FROM", "SCALE", "LocalData", "Outcome", "Workload", "accuracy", "board_shards", "change",
           "lie", "load_data", "reduce_into", "simulate"]
