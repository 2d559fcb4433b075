"""The replica validates with the threads the machine has free: fewer when others keep its CPUs busy."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil
import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from edgefleet.coordinator.run.replica import Replica
from edgefleet.coordinator.run.replica_threads import FreeCpuThreads, threads_for_free_cores


@pytest.mark.parametrize(("usable", "others", "expected"), [
    (2.0, 1.44, 1),   # the lab: eight boards on a 2-core host
    (2.0, 0.1, 2),    # a quiet coordinator machine keeps both
    (2.0, 0.3, 1),    # a core busy 30% of the time is not free
    (8.0, 2.5, 5),
    (0.5, 0.0, 1),    # a quota under one core: one thread
    (2.0, -0.5, 2),   # a reading that came out negative counts as nothing busy
    (4.0, 9.0, 1),    # busier than the machine: still one
])
def test_threads_follow_the_free_cores(usable: float, others: float, expected: int) -> None:
    assert threads_for_free_cores(usable, others) == expected


@pytest.fixture
def busy_cpus() -> Iterator[list[psutil.Process]]:
    """One spinning process per CPU this test may use."""
    count = len(os.sched_getaffinity(0))
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield [psutil.Process(p.pid) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_busy_cpus_leave_one_thread(busy_cpus: list[psutil.Process]) -> None:
    fitter = FreeCpuThreads(usable=float(len(busy_cpus)))
    started = [p.cpu_times() for p in busy_cpus]
    deadline = time.monotonic() + 30
    while any(p.cpu_times().user - s.user < 0.5 for p, s in zip(busy_cpus, started)):  # each spun half a second
        assert time.monotonic() < deadline, "the spinning processes got no CPU"
        time.sleep(0.05)
    assert fitter.threads() == 1


class _Recording(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.validated_with: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.layer(batch[0]).sum()
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validated_with.append(torch.get_num_threads())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_replica_validates_with_the_threads_it_is_given() -> None:
    before = torch.get_num_threads()
    model = _Recording()
    asked: list[int] = []

    def one_thread() -> int:
        asked.append(1)
        return 1

    val = DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2)
    replica = Replica(model, batches_per_epoch=2, total_steps=2, val_loader=lambda: val, validation_threads=one_thread)
    try:
        for _ in range(2):
            replica.apply(np.zeros(3, dtype=np.float32))
    finally:
        replica.close()
        torch.set_num_threads(before)
    assert asked == [1] and model.validated_with == [1, 1]
