"""Lightning's chatter goes to DEBUG in a real Trainer's process, the user's warnings stay: as on the coordinator
(whose root logger has a handler) and in a board's worker (which has none)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

USER_MODULE = '''
import warnings

import torch
import pytorch_lightning as pl


class UserModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        warnings.warn("user_model: the user's own warning", UserWarning, stacklevel=1)
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
'''

SCRIPT = '''
import logging
import sys
import warnings

import torch

if sys.argv[1] == "root-handler":  # the coordinator: edge-coordinator configures the root logger first
    logging.basicConfig(level=logging.DEBUG if sys.argv[2] == "verbose" else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")

import pytorch_lightning as pl
import lightning.pytorch as lp  # noqa: F401  (a module of the other package name adds its handlers too)
from lightning.fabric.utilities import rank_zero

from edgefleet.workloads.quiet_lightning import quiet_lightning

quiet_lightning(verbose=sys.argv[2] == "verbose")
from user_model import UserModel

# a deprecation raised from inside a library's file, as torch's LeafSpec one inside Lightning's _pytree.py
warnings.warn_explicit("library_file: something is deprecated", FutureWarning, filename=rank_zero.__file__, lineno=1)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, accelerator="cpu")
trainer.fit(UserModel(), data)
print("fitted", file=sys.stderr)
'''


@pytest.mark.parametrize("setup", ["root-handler", "no-handler"])
def test_a_trainer_says_nothing_of_its_own_but_the_users_warning_shows(tmp_path: Path, setup: str) -> None:
    # Prepare: the user's module in its own file
    (tmp_path / "user_model.py").write_text(USER_MODULE)

    # Execute: a real Trainer.fit in a fresh process
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), setup, "quiet"], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})

    # Assert
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "fitted" in done.stderr, output[-3000:]
    for chatter in ("GPU available", "TPU available", "litlogger", "LitLogger", "max_steps=2` reached", "INFO",
                    "library_file"):
        assert chatter not in output, (chatter, output[-3000:])
    assert output.count("UserWarning: user_model: the user's own warning") == 1, output[-3000:]
    assert "user_model.py" in output  # shown where the user raised it


def test_verbose_shows_lightnings_lines_once(tmp_path: Path) -> None:
    (tmp_path / "user_model.py").write_text(USER_MODULE)

    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), "root-handler", "verbose"], capture_output=True,
                          text=True, timeout=240, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})

    assert done.returncode == 0, done.stderr[-3000:]
    gpu = [line for line in done.stderr.splitlines() if "GPU available" in line]
    assert len(gpu) == 1, done.stderr[-3000:]  # was twice: "INFO: ..." and "INFO lightning.pytorch...: ..."
    assert "library_file: something is deprecated" in done.stderr  # at DEBUG, with -v
