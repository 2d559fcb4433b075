"""``train``'s Lightning flags: a wrong value or a combination that cannot be honoured stops before any board."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgefleet.coordinator.cli import main
from tests.helpers import train_args


@pytest.mark.parametrize(("flags", "fragment"), [
    (("--precision", "8-mixed"), "precision '8-mixed' is not one of 32-true, bf16-mixed, 16-mixed"),
    (("--precision", "16-mixed", "--sync-every", "2"), "--precision 16-mixed cannot be combined with --sync-every 2"),
    (("--gradient-clip-val", "0"), "gradient_clip_val = 0.0 must be above 0"),
    (("--accumulate-grad-batches", "0"), "accumulate_grad_batches = 0 must be at least 1"),
    (("--log-every-n-steps", "0"), "--log-every-n-steps 0"),
    (("--datamodule", "tests.conformance.data:ClassificationDataModule", "--dataset-options", "n=5"),
     "--dataset-options belong to --dataset"),
    (("--datamodule", "tests.conformance.data:make_tokens"), "not a LightningDataModule subclass"),
    (("--auto", "--sync-every", "2"), "--sync-every 2 with --auto: the planner chooses the training mode"),
])
def test_bad_lightning_flags_stop_before_any_board(fleet_key: Path, flags: tuple[str, ...], fragment: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # --boards names a board nobody runs and the broker is unreachable: a flag must be refused before either matters.
    # The CLI's own main, in this process (one subprocess per case would import torch each time; the
    # subprocess path of the same refusals is test_bad_requests_fail_before_training_with_the_reason's).
    code = main(train_args(*flags, broker="127.0.0.1:9", fleet_key=fleet_key, boards="nobody", steps=5))
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert fragment in err and "Traceback" not in err
