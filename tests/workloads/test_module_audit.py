"""The launch check for torchmetrics in training hooks: refused with the attribute, hook and fix named; accepted
when the Metric is used in validation only or not at all; and never importing torchmetrics itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch import nn

from edgefleet.protocol.errors import ConfigError
from edgefleet.workloads.module_audit import audit_training_metrics, is_metric, metric_attributes
from tests.workloads import audit_modules as modules

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("module", "attribute", "where"), [
    (modules.AccuracyInTrainingStep, "train_acc", "training_step uses self.train_acc"),
    (modules.AccuracyInSharedStep, "train_acc", "training_step (through self._shared_step()) uses self.train_acc"),
    (modules.AccuracyByGetattr, "train_acc", "training_step (through self._shared_step()) calls getattr(self, "),
    (modules.CollectionAtEpochEnd, "train_metrics", "on_train_batch_end uses self.train_metrics (MetricCollection)"),
    (modules.LightningPackageAccuracy, "train_acc", "training_step uses self.train_acc"),
])
def test_a_metric_in_training_hooks_is_refused_naming_it(module: type, attribute: str, where: str) -> None:
    # Prepare
    model = module()

    # Execute
    with pytest.raises(ConfigError) as refused:
        audit_training_metrics(model)

    # Assert
    message = str(refused.value)
    assert "torchmetrics" in message and attribute in message and where in message
    assert "does not merge Metric states" in message  # why
    assert "(preds == y).float().mean()" in message and "validation_step only" in message  # what to do


def test_every_training_hook_using_the_collection_is_named() -> None:
    with pytest.raises(ConfigError) as refused:
        audit_training_metrics(modules.CollectionAtEpochEnd())

    assert "on_train_epoch_end uses self.train_metrics" in str(refused.value)


def test_a_metric_in_validation_only_is_accepted() -> None:
    audit_training_metrics(modules.AccuracyInValidationOnly())


def test_a_module_without_metrics_is_accepted() -> None:
    audit_training_metrics(modules._Classifier())


def test_a_metric_registered_twice_is_found_under_both_names() -> None:
    # Prepare: nn.Module's named_modules() would report the second name only on request
    model = modules.AccuracyInTrainingStep()
    model.metric = model.train_acc

    # Execute
    found = metric_attributes(model)

    # Assert
    assert {"train_acc", "metric"} <= set(found)
    assert is_metric(model.train_acc) and not is_metric(model.net)


def test_a_metric_in_a_module_dict_is_found_through_the_container() -> None:
    model = modules._Classifier()
    model.metrics = nn.ModuleDict({"fit_acc": modules._accuracy()})

    assert metric_attributes(model)["metrics"].startswith("ModuleDict holding metrics.fit_acc")


def test_an_uninspectable_hook_is_skipped_not_crashed_on() -> None:
    # Prepare: a C function and a functools.partial as hooks have no bytecode to read
    import functools

    klass = type("CHooks", (modules.AccuracyInValidationOnly,), {
        "on_train_batch_start": functools.partial(print, "start"), "on_after_backward": len})

    # Execute / Assert
    audit_training_metrics(klass())


def test_the_audit_does_not_import_torchmetrics() -> None:
    # Prepare: a fresh interpreter, torch only
    script = textwrap.dedent("""
        import sys
        import edgefleet.workloads.module_audit as audit
        from tests.workloads.plain_module import PlainAccuracy
        audit.audit_training_metrics(PlainAccuracy())
        print("torchmetrics" in sys.modules)
    """)

    # Execute
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)

    # Assert
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
