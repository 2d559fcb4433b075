"""The ways a step's gradients may be reduced (``train --aggregate``): the names the job's spec and the exchange share.

``mean`` is the exact mode (the sample-weighted mean, DDP's mathematics); the others are robust rules
(``coordinator.exchange.robust_reduce``) that bound what one board can do to a step, inexactly.
"""

from __future__ import annotations

AGGREGATES = ("mean", "trimmed-mean", "median", "clip")

__all__ = ["AGGREGATES"]
