"""``edge-coordinator``'s command line: argparse, progress displays and tables.

Each command turns its flags into the typed requests of the coordinator's services
(:mod:`~edgefleet.coordinator.run.train_job`, :mod:`~edgefleet.coordinator.run.auto_train`,
:mod:`~edgefleet.coordinator.planning.profile_job`, :mod:`~edgefleet.coordinator.planning.plan_job`) and renders what
they report. ``python -m edgefleet.coordinator.cli`` runs :func:`main`.
"""

from __future__ import annotations

from edgefleet.coordinator.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
