"""``python -m edgefleet.coordinator.cli``: the same as ``edge-coordinator``."""

from __future__ import annotations

import sys

from edgefleet.coordinator.cli.main import main

sys.exit(main())
