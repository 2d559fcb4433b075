"""A model cut into three pipeline stages trains on three processes linked by authenticated TLS, with
GPipe micro-batches, to the parameters single-process ``Trainer.fit`` reaches (issue 35)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from edgefleet.brokers.ports import free_port
from edgefleet.protocol.signing import ed25519_public_key, generate_ed25519_seed
from edgefleet.workloads.fleet_trainer import TrainerOptions, make_trainer
from edgefleet.workloads.lightning_api import package_of
from edgefleet.workloads.stage_cut import cut_stages, stage_shapes
from tests.pipeline.stage_process import BATCH, make_data, make_model

SCRIPT = Path(__file__).with_name("stage_process.py")
ROOT = Path(__file__).resolve().parents[2]
CUTS = ["net.2", "net.8"]  # conv 1 and its pool | conv 2 to the first dense layer | the last two dense layers
STEPS, MICRO_BATCHES, SEED = 20, 4, 7


def _reference() -> dict[str, torch.Tensor]:
    model = make_model(SEED)
    trainer = make_trainer(package_of(model), options=TrainerOptions(), total_steps=STEPS, callbacks=[],
                           accelerator="cpu")
    trainer.fit(model, train_dataloaders=DataLoader(make_data(SEED), batch_size=BATCH, shuffle=False))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _configs(tmp_path: Path, *, tls: bool = True) -> list[dict[str, object]]:
    boards = [f"stage-board-{k}" for k in range(len(CUTS) + 1)]
    seeds = [generate_ed25519_seed() for _ in boards]
    peers = [{"board_id": b, "host": "127.0.0.1", "port": free_port(), "public_key": ed25519_public_key(s).hex()}
             for b, s in zip(boards, seeds)]
    staged = cut_stages(make_model(SEED), CUTS, micro_batches=MICRO_BATCHES)
    shapes = [list(s) for s in stage_shapes(staged, torch.zeros(2, 1, 32, 32))]
    return [{"job_id": "job-pipe", "stage": k, "peers": peers, "shapes": shapes, "cuts": CUTS,
             "micro_batches": MICRO_BATCHES, "steps": STEPS, "seed": SEED, "seed_hex": seeds[k].hex(),
             "tls": tls, "out": str(tmp_path / f"stage{k}.pt")}
            for k in range(len(boards))]


def _run(tmp_path: Path, configs: list[dict[str, object]]) -> list[int]:
    procs = []
    for config in configs:
        path = tmp_path / f"stage{config['stage']}.json"
        path.write_text(json.dumps(config))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(path)], cwd=ROOT,
                                      env={**_env(), "PYTHONPATH": str(ROOT)}))
    try:
        return [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_three_stages_over_tls_with_four_micro_batches_equal_trainer_fit(tmp_path: Path) -> None:
    configs = _configs(tmp_path)
    codes = _run(tmp_path, configs)
    faults = [Path(str(c["out"]) + ".fault") for c in configs]
    assert codes == [0, 0, 0], [f.read_text() for f in faults if f.exists()]
    fleet: dict[str, torch.Tensor] = {}
    for config in configs:
        fleet.update(torch.load(str(config["out"])))
    reference = _reference()
    assert set(fleet) == set(reference)  # every parameter trained by exactly one stage
    flat_fleet = torch.cat([fleet[n].reshape(-1) for n in reference])
    flat_ref = torch.cat([p.reshape(-1) for p in reference.values()])
    start = torch.cat([p.detach().reshape(-1) for p in make_model(SEED).parameters()])
    assert float((flat_ref - start).norm()) > 0.05  # it trained
    assert float((flat_fleet - flat_ref).norm() / flat_ref.norm()) <= 1e-5


@pytest.mark.slow
def test_a_stage_host_that_dies_mid_run_ends_the_others_naming_it(tmp_path: Path) -> None:
    configs = _configs(tmp_path)
    configs[1]["die_at"] = 5
    for config in configs:
        config["stall_s"] = 30.0
    codes = _run(tmp_path, configs)
    assert codes == [3, 9, 3]
    for k in (0, 2):
        fault = Path(str(configs[k]["out"]) + ".fault").read_text()
        assert "stage-board-1 (stage 1)" in fault, fault
        assert not Path(str(configs[k]["out"])).exists()  # nothing written as if the run had finished
