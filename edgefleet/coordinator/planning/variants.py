"""Model variants: the option dicts a job's variant axes mean (``layers`` 2,3,4 x ``width`` 64,128).

``profile``, ``plan`` and ``train --auto`` take the same axes. Each axis lists the values to try
for one model option; the variants are their cross product, merged over the job's model options.
With no axis there is one variant, the model options as given.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

# command-line flag -> the model option it sets (mlp: layers, width; resnet_small: depth, width)
VARIANT_FLAGS: dict[str, str] = {"layers": "layers", "width": "width", "depth": "depth"}


def expand_variants(base_options: Mapping[str, Any], axes: Mapping[str, Sequence[int]]) -> list[dict[str, Any]]:
    """The model-option dicts to profile or plan over, one per variant (at least one).

    Args:
        base_options: The options every variant shares.
        axes: Model option -> the values to try, e.g. ``{"layers": [2, 3, 4]}``; empty axes are ignored.
    """
    used = [(name, list(values)) for name, values in axes.items() if values]
    if not used:
        return [dict(base_options)]
    names = [name for name, _ in used]
    return [dict(base_options) | dict(zip(names, combo)) for combo in itertools.product(*(vals for _, vals in used))]


__all__ = ["VARIANT_FLAGS", "expand_variants"]
