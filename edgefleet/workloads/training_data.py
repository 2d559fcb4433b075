"""A job's data as the user wrote it: a dataset factory or a LightningDataModule, kept unchanged.

The fleet decides which samples each board takes (``workloads.sharding``); everything else is the
user's: sample types and structures (any dtype, tuples, dicts, nested), and how samples become a
batch (the ``collate_fn`` of the DataModule's ``train_dataloader()``, or a ``collate_fn``
attribute of a factory's dataset, else PyTorch's ``default_collate``). The batch size, sampler and
shuffling of the user's DataLoader are replaced by the fleet's sampler, which gives every step the
same global batch however it is split.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.collate import default_collate

from edgefleet.protocol.errors import ConfigError
from edgefleet.workloads.lightning_api import package_of

log = logging.getLogger(__name__)


@dataclass
class TrainingData:
    """The train set and what goes with it.

    Attributes:
        train: The map-style training dataset (the user's own object, or a view of it).
        collate_fn: Turns a list of samples into a batch, as the user's DataLoader would.
        val_loader: The validation batches (the DataModule's ``val_dataloader()``, or the factory's
            ``val`` split), or None.
        source: What the user named, for messages (``dataset 'pkg.mod:fn'``).
        datamodule: The user's LightningDataModule (set up for ``fit``), or None: its batch-transfer
            hooks run on every replica (``workloads.module_setup.DataModuleHooks``).
    """

    train: Any
    collate_fn: Callable[[list[Any]], Any]
    val_loader: Callable[[], Any] | None
    source: str
    datamodule: Any = None

    def train_loader(self, batch_sampler: Any) -> DataLoader[Any]:
        """A DataLoader of this data whose batches the fleet's ``batch_sampler`` picks."""
        return DataLoader(self.train, batch_sampler=batch_sampler, collate_fn=self.collate_fn)


VAL_BATCH_SIZE = 256


def load_training_data(*, dataset: str = "", dataset_options: Mapping[str, Any] | None = None,
                       datamodule: str = "", datamodule_options: Mapping[str, Any] | None = None,
                       cached: bool = False, with_val: bool = True) -> TrainingData:
    """The job's data from a dataset spec or a DataModule spec (exactly one of them).

    Args:
        cached: Keep built-in datasets for the next job of a worker that stays.
        with_val: Also prepare the validation data (the coordinator's replica validates; boards do not).

    Raises:
        ConfigError: both or neither named, an unknown spec, a DataModule without
            ``train_dataloader()``, or an iterable-style dataset.
    """
    # Lightning and the built-in datasets: only when data is loaded
    from edgefleet.workloads.registry import build_datamodule, build_dataset, build_dataset_cached

    if bool(dataset) == bool(datamodule):
        raise ConfigError("name the data once: a dataset (--dataset) or a LightningDataModule (--datamodule), not both")
    if datamodule:
        return _from_datamodule(build_datamodule(datamodule, datamodule_options), datamodule, with_val)
    build = build_dataset_cached if cached else build_dataset
    train = build(dataset, "train", dataset_options)
    _check_map_style(train, f"dataset {dataset!r}")
    collate = getattr(train, "collate_fn", None)
    collate = collate if callable(collate) else default_collate
    val_loader = None
    if with_val:
        def val_loader() -> DataLoader[Any]:
            return DataLoader(build(dataset, "val", dataset_options), batch_size=VAL_BATCH_SIZE, collate_fn=collate)
    return TrainingData(train=train, collate_fn=collate, val_loader=val_loader, source=f"dataset {dataset!r}")


def _from_datamodule(module: Any, spec: str, with_val: bool) -> TrainingData:
    what = f"datamodule {spec!r}"
    try:
        module.prepare_data()
        module.setup("fit")
        loader = module.train_dataloader()
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{what}: preparing its training data failed ({type(exc).__name__}: {exc})") from exc
    if not isinstance(loader, DataLoader):
        raise ConfigError(f"{what}: train_dataloader() returned {type(loader).__name__}; edgefleet needs one "
                          "torch DataLoader over a map-style dataset (the fleet's sampler picks each board's samples)")
    _check_map_style(loader.dataset, what)
    val_loader = None
    if with_val and _has_val_dataloader(module):
        val_loader = module.val_dataloader
    return TrainingData(train=loader.dataset, collate_fn=loader.collate_fn or default_collate,
                        val_loader=val_loader, source=what, datamodule=module)


def _has_val_dataloader(module: Any) -> bool:
    base = package_of(module).LightningDataModule
    return getattr(type(module), "val_dataloader", None) is not getattr(base, "val_dataloader", None)


def _check_map_style(dataset: Any, what: str) -> None:
    if isinstance(dataset, IterableDataset):
        raise ConfigError(f"{what} is an IterableDataset ({type(dataset).__name__}): the fleet picks each board's "
                          "samples by index so that every step trains on the same global batch, and an "
                          "IterableDataset has no index; wrap the data in a map-style torch Dataset (with __len__ "
                          "and __getitem__)")
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ConfigError(f"{what} is {type(dataset).__name__}, not a map-style dataset (with __len__ and "
                          "__getitem__): the fleet picks each board's samples by index so that every step trains "
                          "on the same global batch; wrap the data in a map-style torch Dataset")
    if len(dataset) == 0:
        raise ConfigError(f"{what} is empty")


__all__ = ["VAL_BATCH_SIZE", "TrainingData", "load_training_data"]
