"""One pipeline stage host, as its own process, for the pipeline tests: ``python stage_process.py CONFIG.json``.

The config (written by ``tests/pipeline/test_stage_pipeline.py``) names the stage, every stage's
host and its board's public key, this board's key seed, the cuts and the run; the
process trains its stage with the real stage links and the user's module in its own Lightning
Trainer, then writes its stage's parameters (``torch.save``) to ``out``. On a fault it writes the
one-line reason to ``out + ".fault"`` and exits 3.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from edgefleet.agent.stage_links import StageEndpoint, StageFault, StageLinkPlan, StagePeer
from edgefleet.agent.stage_runtime import FirstStage, StageHost
from edgefleet.workloads.fleet_trainer import TrainerOptions, make_trainer
from edgefleet.workloads.lightning_api import package_of
from edgefleet.workloads.models import LeNet5
from edgefleet.workloads.quiet_lightning import quiet_lightning
from edgefleet.workloads.stage_cut import cut_stages

BATCH, SAMPLES = 16, 160  # 10 batches an epoch


class ScheduledLeNet(LeNet5):
    """LeNet-5 with Adam and a per-step LR schedule: the stages must step both as Trainer.fit does."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=2e-3)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def make_model(seed: int) -> ScheduledLeNet:
    torch.manual_seed(seed)
    return ScheduledLeNet((1, 32, 32), 10)


def make_data(seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(SAMPLES, 1, 32, 32, generator=generator)
    y = torch.randint(0, 10, (SAMPLES,), generator=generator)
    return TensorDataset(x, y)


def main(config_path: str) -> int:
    config = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    quiet_lightning()
    stage = int(config["stage"])
    model = make_model(config["seed"])
    staged = cut_stages(model, config["cuts"], micro_batches=config["micro_batches"])
    peers = [StagePeer(**p) for p in config["peers"]]
    plan = StageLinkPlan(job_id=config["job_id"], stage=stage, peers=peers,
                         shapes=[tuple(s) for s in config["shapes"]], max_rows=BATCH,
                         micro_batches=config["micro_batches"], tls=config.get("tls", True))
    endpoint = StageEndpoint(plan, seed=bytes.fromhex(config["seed_hex"]), stall_timeout_s=config.get("stall_s", 60.0))
    endpoint.listen("127.0.0.1", peers[stage].port)
    try:
        endpoint.connect()
        endpoint.wait_connected()
        if stage == 0:
            FirstStage(staged, endpoint, config["micro_batches"]).install(model)
            loader: DataLoader[Any] = DataLoader(make_data(config["seed"]), batch_size=BATCH, shuffle=False)
        else:
            host = StageHost(staged, stage, endpoint)
            host.install(model)
            if config.get("die_at") is not None:  # the crash test: this host's process dies mid-run
                step_of = host.training_step

                def dying_step(batch: Any, batch_idx: int) -> torch.Tensor:
                    if host.step == config["die_at"]:
                        os._exit(9)
                    return step_of(batch, batch_idx)

                # on this instance, as StageHost.install does (mypy refuses assigning to a method)
                model.training_step = dying_step  # type: ignore[method-assign]
            loader = DataLoader(TensorDataset(torch.arange(SAMPLES // BATCH)), batch_size=1)  # the step numbers
        trainer = make_trainer(package_of(model), options=TrainerOptions(), total_steps=config["steps"], callbacks=[],
                               accelerator="cpu")
        trainer.fit(model, train_dataloaders=loader)
    except StageFault as fault:
        Path(config["out"] + ".fault").write_text(str(fault))
        endpoint.close(str(fault))
        return 3
    endpoint.close()
    mine = {id(p) for p in staged.params[stage]}
    torch.save({n: p.detach().clone() for n, p in model.named_parameters() if id(p) in mine}, config["out"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
