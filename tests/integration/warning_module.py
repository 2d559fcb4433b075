"""A user's module that warns when it is built: ``train``'s quieting of Lightning must leave its warning showing."""

from __future__ import annotations

import warnings

from edgefleet.workloads.models import MLP

WARNING_TEXT = "warning_module: the user's own warning, raised from the user's file"


class WarningMLP(MLP):
    """The built-in MLP, warning once per process as it is built (as a user's module might about its options)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, lr: float = 1e-3) -> None:
        warnings.warn(WARNING_TEXT, UserWarning, stacklevel=1)
        super().__init__(input_shape, num_classes, lr=lr, layers=1, width=16)
