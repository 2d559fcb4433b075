"""A Jetson's integrated GPU: load, and the memory it maps, from jtop or else from sysfs.

jetson-stats (``jtop``) gives ``jtop.gpu`` = ``{NAME: {'type': 'integrated', 'status': {'load': %,
'railgate', '3d_scaling', …}, 'freq': {…}}}`` and ``jtop.memory['RAM']`` = ``{'tot', 'used', 'shared', …}``
in kB (1024 bytes: /proc/meminfo's unit). The iGPU has no memory of its own: ``shared`` is the part of
RAM mapped for the GPU (NvMap) and the total it can use is the board's RAM. jtop's own GPU service
reads the load from the iGPU device's ``load`` file, in tenths of a percent; without jtop we read the
same file: the devfreq device whose device-tree name is a GPU (``gpu``, ``ga10b`` on Orin, ``gv11b``
on Xavier, ``gp10b`` on TX2), else the older ``devices/gpu.0/load``. Without jtop the memory is
not reported (None).

Missing files give None and are logged once at DEBUG: a board without the GPU simply does not
have this source.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

NAME = "gpu-jetson"
GPU_NAMES = ("gpu", "ga10b", "gv11b", "gp10b")  # the device-tree names jtop treats as an iGPU
LEGACY_LOAD_FILES = ("devices/gpu.0/load", "devices/57000000.gpu/load", "devices/platform/host1x/57000000.gpu/load")
KIB = 1024  # jtop reports memory in /proc/meminfo's kB, which are KiB


def _as_dict(value: Any) -> dict[Any, Any]:
    """A plain dict of ``value``: jtop's ``gpu`` and ``memory`` are dict-like objects (GenericInterface), not dicts."""
    if isinstance(value, dict):
        return value
    items = getattr(value, "items", None)
    try:
        return dict(items()) if callable(items) else {}
    except (TypeError, ValueError):
        return {}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def parse_jtop_gpu(gpu: Any, memory: Any) -> dict[str, Any]:
    """``jtop.gpu`` and ``jtop.memory`` as telemetry fields.

    Args:
        gpu: ``jtop().gpu`` (a dict or jtop's dict-like object); the first integrated GPU's
            ``status.load`` (%) is used.
        memory: ``jtop().memory``; ``RAM.shared`` (GPU-mapped, kB) and ``RAM.tot`` (kB).

    Returns:
        ``gpu_load_percent``, ``gpu_mem_used_bytes``, ``gpu_mem_total_bytes``; None for what is missing
        or not a number. Never raises.
    """
    load = None
    for entry in _as_dict(gpu).values():
        if isinstance(entry, dict) and entry.get("type") == "integrated":
            status = entry.get("status")
            load = _number(status.get("load")) if isinstance(status, dict) else None
            break
    ram = _as_dict(memory).get("RAM")
    shared = _number(ram.get("shared")) if isinstance(ram, dict) else None
    total = _number(ram.get("tot")) if isinstance(ram, dict) else None
    if load is not None and not 0 <= load <= 100:
        load = None
    used_bytes = int(shared * KIB) if shared is not None and shared >= 0 else None
    total_bytes = int(total * KIB) if total is not None and total > 0 else None
    if used_bytes is not None and total_bytes is not None and used_bytes > total_bytes:
        used_bytes = None  # not a reading we can trust
    return {"gpu_load_percent": load, "gpu_mem_used_bytes": used_bytes, "gpu_mem_total_bytes": total_bytes}


def parse_gpu_load(text: str) -> float | None:
    """The iGPU ``load`` file (``"48\\n"``: tenths of a percent) in percent; garbage or > 100 % gives None."""
    try:
        tenths = int(text.strip())
    except ValueError:
        return None
    return tenths / 10 if 0 <= tenths <= 1000 else None


def find_gpu_load_file(sysfs_root: Path) -> Path | None:
    """The iGPU's ``load`` file under ``sysfs_root``, found as jtop finds the GPU; None if there is none."""
    for dev in sorted((sysfs_root / "class" / "devfreq").glob("*")):
        try:
            name = (dev / "device" / "of_node" / "name").read_bytes().rstrip(b"\0\n ").decode(errors="replace")
        except OSError:
            continue
        load = dev / "device" / "load"
        if name in GPU_NAMES and load.is_file():
            return load
    return next((sysfs_root / p for p in LEGACY_LOAD_FILES if (sysfs_root / p).is_file()), None)


@dataclass
class JetsonGpuSource:
    """GPU load and memory of a Jetson.

    Attributes:
        sysfs_root: normally ``/sys``.
        jtop_client: returns the running jtop client, or None (the power source's, when it is jtop:
            one client per agent).
    """

    sysfs_root: Path
    jtop_client: Any = None
    name: str = field(default=NAME, init=False)
    _load_file: Path | None = field(default=None, init=False, repr=False)
    _missing_logged: bool = field(default=False, init=False, repr=False)

    def _client(self) -> Any:
        return self.jtop_client() if callable(self.jtop_client) else None

    def available(self) -> bool:
        """True on a board with an iGPU load file or a jtop client. Never raises."""
        try:
            self._load_file = find_gpu_load_file(self.sysfs_root)
        except OSError:
            self._load_file = None
        return self._load_file is not None or self._client() is not None

    def read(self) -> dict[str, Any]:
        """The GPU fields; what cannot be read is None."""
        gpu = memory = None
        client = self._client()
        if client is not None:
            try:
                gpu, memory = client.gpu, client.memory
            except Exception as exc:  # JtopException when the service went away; the sysfs load still works
                if not self._missing_logged:
                    log.debug("jtop gpu/memory unreadable: %s", exc)
                    self._missing_logged = True
        fields = parse_jtop_gpu(gpu, memory)
        if fields["gpu_load_percent"] is None and self._load_file is not None:
            try:
                fields["gpu_load_percent"] = parse_gpu_load(self._load_file.read_text(errors="replace"))
            except OSError as exc:
                if not self._missing_logged:
                    log.debug("GPU load file %s unreadable: %s (reported as None)", self._load_file, exc)
                    self._missing_logged = True
        return fields


__all__ = ["GPU_NAMES", "NAME", "JetsonGpuSource", "find_gpu_load_file", "parse_gpu_load", "parse_jtop_gpu"]
