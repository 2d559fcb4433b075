"""Training workloads shared by a board's training worker and the coordinator's replica.

* :mod:`workloads.models` - built-in LightningModules (GroupNorm by default, no dropout: split-exact).
* :mod:`workloads.datasets` - built-in datasets (digits, synthetic, npz).
* :mod:`workloads.registry` - model/dataset specs (built-in, ``package.module:Name``, entry points).
* :mod:`workloads.sharding` - which samples each board trains on at each step.

Needs the ``train`` extra (torch, pytorch-lightning, numpy, scikit-learn); the idle agent never
imports it. Names are loaded lazily, so ``from edgefleet.workloads import GlobalBatchPlan`` does not pay for
importing Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgefleet.workloads.datasets import (
        BUILTIN_DATASETS,
        ClassificationDataset,
        TensorClassificationDataset,
        load_digits_dataset,
        load_npz_dataset,
        make_synthetic_dataset,
    )
    from edgefleet.workloads.models import (
        BUILTIN_MODELS,
        MLP,
        ClassifierModule,
        ConvMLP,
        LeNet5,
        ResNetSmall,
        count_parameters,
    )
    from edgefleet.workloads.registry import (
        UserDatasetView,
        available_datasets,
        available_models,
        build_dataset,
        build_model,
        parse_options,
        resolve_dataset,
        resolve_model,
    )
    from edgefleet.workloads.sharding import (
        BoardBatchSampler,
        GlobalBatchPlan,
        LocalBatchPlan,
        LocalBatchSampler,
        StepBatchSampler,
    )

_HOME_MODULE = {
    "BUILTIN_DATASETS": "datasets", "ClassificationDataset": "datasets", "TensorClassificationDataset": "datasets",
    "load_digits_dataset": "datasets",
    "load_npz_dataset": "datasets", "make_synthetic_dataset": "datasets",
    "BUILTIN_MODELS": "models", "ClassifierModule": "models", "ConvMLP": "models", "LeNet5": "models", "MLP": "models",
    "ResNetSmall": "models", "count_parameters": "models",
    "UserDatasetView": "registry", "available_datasets": "registry", "available_models": "registry", "build_dataset": "registry",
    "build_model": "registry", "parse_options": "registry", "resolve_dataset": "registry", "resolve_model": "registry",
    "BoardBatchSampler": "sharding", "GlobalBatchPlan": "sharding", "LocalBatchPlan": "sharding",
    "LocalBatchSampler": "sharding", "StepBatchSampler": "sharding",
}

__all__ = [
    "BUILTIN_DATASETS",
    "BUILTIN_MODELS",
    "MLP",
    "BoardBatchSampler",
    "ClassificationDataset",
    "ClassifierModule",
    "ConvMLP",
    "GlobalBatchPlan",
    "LeNet5",
    "LocalBatchPlan",
    "LocalBatchSampler",
    "ResNetSmall",
    "StepBatchSampler",
    "TensorClassificationDataset",
    "UserDatasetView",
    "available_datasets",
    "available_models",
    "build_dataset",
    "build_model",
    "count_parameters",
    "load_digits_dataset",
    "load_npz_dataset",
    "make_synthetic_dataset",
    "parse_options",
    "resolve_dataset",
    "resolve_model",
]


def __getattr__(name: str) -> Any:
    # PEP 562: import the submodule on first use (pytorch_lightning alone takes seconds on a Pi).
    if name not in _HOME_MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME_MODULE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
