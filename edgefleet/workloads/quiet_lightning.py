"""Lightning's chatter down to DEBUG, on the coordinator and in a board's worker, the user's warnings kept.

Every Trainer says "GPU available: False", "TPU available", a LitLogger advert and "Trainer.fit stopped";
``lightning/__init__`` adds a handler of its own (``INFO: ...``) that also propagates to the root
logger's (``INFO lightning.pytorch.utilities.rank_zero: ...``), so each line came twice, for the
coordinator's replica and its audit model alike, and a worker's 30-line stderr tail (what the agent
reports when it fails) was full of them. Deprecation warnings that torch raises inside Lightning's
own files are the libraries' business too. :func:`quiet_lightning` removes Lightning's handlers
(records go through the process's own, once), leaves its loggers at WARNING (DEBUG with ``verbose``:
``-v`` shows them) and sends warnings raised from the libraries' files to this module's DEBUG log; a
warning raised from any other file (the user's module, edgefleet's) shows as before.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import warnings
from collections.abc import Callable
from typing import TextIO

log = logging.getLogger(__name__)

# the packages whose INFO lines and warnings are not the user's
LIBRARY_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "torch", "torchmetrics",
                    "torchvision")
_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")
_IMPORTED = ("lightning", "pytorch_lightning")  # their __init__ adds the handlers: imported first, then undone


def _library_dirs() -> tuple[str, ...]:
    """The folders the library packages are installed in, each ending in a path separator."""
    found = []
    for name in LIBRARY_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for folder in (spec.submodule_search_locations or []) if spec is not None else []:
            found.append(os.path.join(os.path.realpath(folder), ""))
    return tuple(found)


class _LibraryWarnings:
    """``warnings.showwarning`` that logs the libraries' warnings at DEBUG and shows every other as before."""

    def __init__(self, show: Callable[..., None], library_dirs: tuple[str, ...]) -> None:
        self.show = show
        self.library_dirs = library_dirs

    def from_library(self, filename: str) -> bool:
        return os.path.realpath(filename).startswith(self.library_dirs)

    def __call__(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: TextIO | None = None, line: str | None = None) -> None:
        if self.from_library(filename):
            log.debug("%s:%s: %s: %s", filename, lineno, category.__name__, message)
            return
        self.show(message, category, filename, lineno, file, line)


def quiet_lightning(*, verbose: bool = False) -> None:
    """Lightning's INFO lines only with ``verbose`` and once, the libraries' warnings at DEBUG.

    Imports Lightning (both package names, where installed), since its ``__init__`` adds the
    handlers this removes: call it where a run is about to build a Trainer anyway. Calling it again
    changes nothing more.
    """
    for name in _IMPORTED:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:  # Lightning's own console handlers (ours are the root's)
                logger.removeHandler(handler)
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
    for name in ("lightning", "pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.WARNING)
    if not isinstance(warnings.showwarning, _LibraryWarnings):
        warnings.showwarning = _LibraryWarnings(warnings.showwarning, _library_dirs())


__all__ = ["LIBRARY_PACKAGES", "quiet_lightning"]
