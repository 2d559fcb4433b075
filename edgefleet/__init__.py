"""edgefleet: train neural networks on a fleet of small boards.

The import root of the whole project. Its sub-packages are the repository's top-level folders
(``edgefleet/`` holds links to them, so the wheel, an editable install and the type checker all see
one tree):

- ``edgefleet.protocol``: the wire contract (messages, commands, exchange frames), no I/O;
- ``edgefleet.transport``: the MQTT and socket runtime both ends share;
- ``edgefleet.workloads``: models, datasets and the Lightning glue both ends build;
- ``edgefleet.agent``: ``edge-agent``, the service on every board;
- ``edgefleet.coordinator``: ``edge-coordinator``;
- ``edgefleet.lab``: the emulated fleet (``edge-lab``, the ``[lab]`` extra).
"""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("edgefleet")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
