"""The two Lightning packages: ``pytorch_lightning`` and ``lightning.pytorch``.

They ship the same code under two names, and their classes are distinct: a module derived from
``lightning.pytorch.LightningModule`` must be fitted by ``lightning.pytorch.Trainer`` (the other
package's Trainer refuses it), and an ``isinstance`` check against one package misses the other's
classes. Everything edgefleet builds around a user's module (the Trainer, its callbacks, the
loggers) comes from the package the module itself derives from.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

PACKAGES = ("pytorch_lightning", "lightning.pytorch")


def _loaded(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def installed_packages() -> list[ModuleType]:
    """The Lightning packages importable here (``pytorch_lightning`` first)."""
    return [package for package in map(_loaded, PACKAGES) if package is not None]


def package_of(obj: Any) -> ModuleType:
    """The Lightning package whose ``LightningModule`` or ``LightningDataModule`` ``obj`` (a class or instance) derives from.

    Raises:
        TypeError: ``obj`` derives from neither package's classes.
    """
    cls = obj if isinstance(obj, type) else type(obj)
    for package in installed_packages():
        if issubclass(cls, (package.LightningModule, package.LightningDataModule)):
            return package
    raise TypeError(f"{cls.__qualname__} is not a LightningModule or LightningDataModule of "
                    f"{' or '.join(PACKAGES)}")


def is_lightning_module_class(obj: Any) -> bool:
    """True for a class deriving from either package's ``LightningModule``."""
    return isinstance(obj, type) and any(issubclass(obj, p.LightningModule) for p in installed_packages())


def is_datamodule_class(obj: Any) -> bool:
    """True for a class deriving from either package's ``LightningDataModule``."""
    return isinstance(obj, type) and any(issubclass(obj, p.LightningDataModule) for p in installed_packages())


def callback_class(package: ModuleType, mixin: type, name: str) -> type:
    """``mixin``'s hooks as a Callback of ``package`` (a Trainer of one package checks callbacks against its own class)."""
    return type(name, (mixin, package.Callback), {"__module__": mixin.__module__, "__doc__": mixin.__doc__})


def overrides(model: Any, hook: str) -> bool:
    """Whether ``model``'s class overrides ``hook`` of its package's ``LightningModule``."""
    base = package_of(model).LightningModule
    own = getattr(type(model), hook, None)
    return own is not None and own is not getattr(base, hook, None)


__all__ = ["PACKAGES", "callback_class", "installed_packages", "is_datamodule_class", "is_lightning_module_class",
           "overrides", "package_of"]
