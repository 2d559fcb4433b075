"""The training worker's heap: keep freed memory for the next step instead of faulting it in again.

glibc's malloc serves blocks above its mmap threshold (128 kB at start, raised as such blocks are
freed) with fresh ``mmap`` pages, and returns the top of the heap to the kernel once 128 kB are
free there. A training step allocates and frees the same activations every step, so by default
every step page-faults and zero-fills them again. With PyTorch CPU training of the small residual
CNN at batch 64 that is 7,000-13,000 faults a step: 55 ms a step instead of 33 on a free core of
this machine, 103 instead of 71 at 0.45 of a core and 366 instead of 242 at 0.15, with two to six
times the spread (``bench/worker_heap.py``). The cost is CPU time, so it grows on a slow board.

The worker therefore starts with both thresholds raised (:func:`worker_environment`): blocks up
to 32 MB (glibc's largest threshold on 64-bit) come from the heap, and free memory stays there.
A value the agent itself was started with (``Environment=`` in its unit) is kept. A worker kept
for the next job gives what the last one freed back with :func:`release_free_heap`, so that the
next job's peak-memory figure is its own. Other C libraries ignore the variables.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

HEAP_SETTINGS = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024),   # glibc refuses more than HEAP_MAX_SIZE / 2 = 32 MB
    "MALLOC_TRIM_THRESHOLD_": str(64 * 1024 ** 3),      # never trim after a step; release_free_heap does
}


def worker_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with :data:`HEAP_SETTINGS` where not already set."""
    env = dict(os.environ if base is None else base)
    for name, value in HEAP_SETTINGS.items():
        env.setdefault(name, value)
    return env


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ldconfig); None where there is none."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        log.debug("no malloc_trim in %s; the heap keeps its free memory", name)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return the heap's free memory to the kernel (glibc ``malloc_trim(0)``); False where there is none."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


__all__ = ["HEAP_SETTINGS", "release_free_heap", "worker_environment"]
