"""How full the file systems under the agent's folders are: its state_dir ("data") and its working directory ("run").

A board that fills its SD card stops keeping nonces, logs and checkpoints; the figures are those of
the file system each folder is on (``statvfs``, as ``df`` shows them), not the folder's own size,
which would need a walk of the tree on every sample. ``used`` counts every block in use; blocks
reserved for root are in neither used nor free, so a full disk can show used < total.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

NAME = "disk"
FOLDERS = ("data", "run")  # the field stems: disk_data_*, disk_run_*


def disk_fields(folder: str, path: Path) -> dict[str, Any]:
    """``disk_<folder>_used_bytes`` and ``disk_<folder>_total_bytes`` of the file system holding ``path``.

    Raises:
        OSError: ``path`` is missing or cannot be stat'ed.
    """
    usage = shutil.disk_usage(path)
    return {f"disk_{folder}_used_bytes": int(usage.used), f"disk_{folder}_total_bytes": int(usage.total)}


class DiskSource:
    """Disk usage of the agent's folders.

    Args:
        folders: ``{"data": state_dir, "run": working directory}``; a folder left out (no state_dir)
            is not reported.
    """

    name = NAME

    def __init__(self, folders: Mapping[str, Path]) -> None:
        unknown = set(folders) - set(FOLDERS)
        if unknown:
            raise ValueError(f"unknown disk folders {sorted(unknown)}; expected {FOLDERS}")
        self.folders = dict(folders)
        self._missing: set[str] = set()

    def available(self) -> bool:
        """True if there is a folder to report."""
        return bool(self.folders)

    def read(self) -> dict[str, Any]:
        """The used and total bytes per folder; None for a folder that cannot be read."""
        fields: dict[str, Any] = {}
        for folder, path in self.folders.items():
            try:
                fields.update(disk_fields(folder, path))
            except OSError as exc:
                if folder not in self._missing:
                    log.debug("disk usage of %s (%s) unreadable: %s (reported as None)", folder, path, exc)
                    self._missing.add(folder)
                fields.update({f"disk_{folder}_used_bytes": None, f"disk_{folder}_total_bytes": None})
        return fields


__all__ = ["FOLDERS", "NAME", "DiskSource", "disk_fields"]
