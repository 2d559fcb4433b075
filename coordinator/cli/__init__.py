"""``edge-coordinator``'s command line: argparse, progress displays and tables.

Each command turns its flags into the typed requests of the coordinator's services
(:mod:`~edgefleet.coordinator.train_job`, :mod:`~edgefleet.coordinator.auto_train`,
:mod:`~edgefleet.coordinator.profile_job`, :mod:`~edgefleet.coordinator.plan_job`) and renders what
they report. ``python -m edgefleet.coordinator.cli`` runs :func:`main`.
"""

from __future__ import annotations

from edgefleet.coordinator.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
