"""Where scripts/setup takes torch from: PyTorch's CPU index when it answers, else pip's own configuration.

PyPI's Linux torch is the CUDA build (about 2.7 GB with its NVIDIA libraries); the CPU build
(``torch==X+cpu``, about 190 MB) comes from https://download.pytorch.org/whl/cpu. This prints the
pip arguments that pick the index, one a line, and says on stderr which it chose and why:

* ``EDGEFLEET_TORCH_INDEX=URL``: that index (a mirror of the CPU index); ``EDGEFLEET_TORCH_INDEX=pip``:
  pip's configured indexes, as they are (no probe);
* else the CPU index if a HEAD request reaches it within ``PROBE_TIMEOUT_S``;
* else pip's configured indexes (a firewalled machine whose pip.conf names a mirror or a wheel folder).
  scripts/setup then checks that the torch it got has no CUDA, and says how to fix it if it has.

Standard library only: it runs under the system's python3, before any virtual environment exists.

Usage: python3 scripts/torch_index.py     # prints e.g. "--index-url\\nhttps://download.pytorch.org/whl/cpu"
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT_S = 10.0
ENV_VAR = "EDGEFLEET_TORCH_INDEX"
PIP_CONFIGURED = "pip"  # the value of ENV_VAR that means: pip's own configuration, no probe


@dataclass(frozen=True)
class TorchIndex:
    """The pip arguments that choose torch's index, and a line saying which was chosen."""

    pip_args: tuple[str, ...]  # e.g. ("--index-url", CPU_INDEX); () for pip's configured indexes
    reason: str


def reachable(url: str, *, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True if ``url`` answers a HEAD request with any HTTP status below 500 within ``timeout_s``."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s):
            return True
    except urllib.error.HTTPError as exc:  # it answered: an index may refuse HEAD on a folder (403, 405)
        return exc.code < 500
    except (OSError, ValueError):  # DNS, refused, timed out, TLS, a malformed URL
        return False


def choose_index(env: Mapping[str, str], *, url: str = CPU_INDEX, timeout_s: float = PROBE_TIMEOUT_S) -> TorchIndex:
    """Pick torch's index: ``env[ENV_VAR]`` if set, else ``url`` if it answers, else pip's configuration."""
    chosen = env.get(ENV_VAR, "").strip()
    if chosen == PIP_CONFIGURED:
        return TorchIndex((), f"{ENV_VAR}=pip: torch from pip's configured indexes (no probe)")
    if chosen:
        return TorchIndex(("--index-url", chosen), f"{ENV_VAR}: torch from {chosen}")
    if reachable(url, timeout_s=timeout_s):
        return TorchIndex(("--index-url", url), f"torch from PyTorch's CPU index, {url}")
    return TorchIndex((), f"{url} did not answer within {timeout_s:g} s: torch from pip's configured indexes "
                          f"(pip config list shows them); {ENV_VAR}=URL names a mirror of the CPU index instead")


def main() -> int:
    index = choose_index(os.environ)
    print(f"setup: {index.reason}", file=sys.stderr)
    for arg in index.pip_args:
        print(arg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
