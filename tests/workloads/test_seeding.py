"""Seeds from the run: the same run draws the same numbers, whatever the process did before."""

from __future__ import annotations

import random

import numpy as np
import torch

from edgefleet.workloads.fleet_trainer import EpochBatchSampler, position_of
from edgefleet.workloads.seeding import COMPUTE, DATA, REPLICA_RANK, BatchSeeder, seed_for


def test_a_seed_depends_on_the_run_the_board_the_batch_and_the_purpose() -> None:
    base = seed_for(3, 0, 7, COMPUTE)
    assert base == seed_for(3, 0, 7, COMPUTE) and 0 <= base < 2**63
    others = {seed_for(4, 0, 7, COMPUTE), seed_for(3, 1, 7, COMPUTE), seed_for(3, 0, 8, COMPUTE),
              seed_for(3, 0, 7, DATA), seed_for(3, REPLICA_RANK, 7, COMPUTE)}
    assert base not in others and len(others) == 5


def _draws() -> tuple[float, float, float]:
    return float(torch.rand(())), random.random(), float(np.random.rand())


def test_every_generator_draws_the_same_after_the_same_batch_whatever_came_before() -> None:
    seeder = BatchSeeder(run_seed=3, rank=1, batches_per_epoch=5)
    torch.rand(100), random.random()  # a process that did other things first
    seeder.before_step(epoch=1, batch_idx=2)
    first = _draws()
    seeder.before_step(epoch=0, batch_idx=0)
    seeder.before_step(epoch=1, batch_idx=2)
    assert _draws() == first
    seeder.before_loading(7)  # the same batch (epoch 1, batch 2), another purpose: other numbers
    assert _draws() != first


def test_the_sampler_seeds_each_batch_just_before_its_samples_are_loaded_also_when_resumed() -> None:
    loaded: list[int] = []
    start = position_of(7, batches_per_epoch=5)  # a resumed run: epoch 1, batch 2
    sampler = EpochBatchSampler(lambda batch: [batch], start, before_batch=loaded.append)
    sampler.set_epoch(start.epoch)
    assert [indices for indices in sampler] == [[7], [8], [9]] and loaded == [7, 8, 9]
