"""Explain torch's device-mismatch error as the mistake in the user's module it almost always is.

On a GPU board (a Jetson) Lightning moves the module and each batch to ``cuda:0``; a tensor the
module builds itself without ``device=`` (``torch.arange(x.shape[1])`` in ``forward``) stays on
the CPU, and the first operation mixing the two fails deep inside torch. The same module trains
on every CPU board and on the coordinator, so the user has never seen the error: the message
points at the line in their own code and says how to create the tensor where it belongs.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import sysconfig
import traceback

log = logging.getLogger(__name__)

# torch's wordings across versions (and the CUDA kernels' own) of "a CPU tensor met a GPU one".
_MISMATCH = [re.compile(pattern, re.IGNORECASE | re.DOTALL) for pattern in (
    r"Expected all tensors to be on the same device.*\bcpu\b",  # "... found at least two devices, cuda:0 and cpu!"
    r"Expected object of device type cuda but got device type cpu",  # torch < 1.5
    r"Tensor for argument #\d+ .* is on CPU",  # cuDNN, native checks
    r"Input type \(torch\.\w+\) and weight type \(torch\.cuda\.\w+\) should be the same",  # conv with a CPU input
    r"indices should be either on cpu or on the same device as the indexed tensor \(cpu\)",
    r"Tensor on device (?:cpu is not on the expected device cuda|cuda\S* is not on the expected device cpu)",  # prims
)]
_CUDA_DEVICE = re.compile(r"\bcuda(?::\d+)?\b")
_CAUSES_FOLLOWED = 5  # Lightning or a DataLoader may re-raise it as the cause of another error
# Not the user's code: torch and Lightning (where the error surfaces), edgefleet (what runs the module).
_LIBRARY_PACKAGES = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities",
                     "torchmetrics", "edgefleet")


def _mismatch(exc: BaseException) -> BaseException | None:
    """``exc`` or the first exception in its cause chain whose message is a CPU/GPU mismatch."""
    current: BaseException | None = exc
    for _ in range(_CAUSES_FOLLOWED):
        if current is None:
            return None
        text = str(current)
        if isinstance(current, RuntimeError) and any(pattern.search(text) for pattern in _MISMATCH):
            return current
        current = current.__cause__ or current.__context__
    return None


def _library_roots() -> tuple[str, ...]:
    """Directories whose files are not the user's: the loaded library packages and the standard library."""
    roots: list[str] = []
    for name in _LIBRARY_PACKAGES:
        package = sys.modules.get(name)  # only what is loaded: explaining an error imports nothing
        roots += [os.path.realpath(path) for path in getattr(package, "__path__", [])]
    for name, module in list(sys.modules.items()):  # edgefleet's sub-packages are links to top-level folders
        if name.startswith("edgefleet.") and name.count(".") == 1:
            roots += [os.path.realpath(path) for path in getattr(module, "__path__", [])]
    return tuple(root + os.sep for root in roots)


def _stdlib_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[key]) + os.sep for key in ("stdlib", "platstdlib") if key in paths})


def _is_user_file(filename: str, libraries: tuple[str, ...], stdlib: tuple[str, ...]) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>, torch.fx's generated code: no line to show
        return False
    path = os.path.realpath(filename)
    if path.startswith(libraries):
        return False
    parts = path.split(os.sep)
    installed = "site-packages" in parts or "dist-packages" in parts  # a user package installed under the stdlib dir
    return installed or not path.startswith(stdlib)


def user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``exc``'s traceback in the user's own code, or None if there is none."""
    libraries, stdlib = _library_roots(), _stdlib_roots()
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
              if _is_user_file(frame.filename, libraries, stdlib)]
    return frames[-1] if frames else None


def explain_device_error(exc: BaseException) -> str | None:
    """What to tell the user about a CPU/GPU tensor mismatch in their module; None for any other error.

    Args:
        exc: The exception the board's ``trainer.fit`` raised (its cause chain is searched too).

    Returns:
        One message naming the user's file, line and source line, and the fix; or None when
        ``exc`` is not a device mismatch.
    """
    mismatch = _mismatch(exc)
    if mismatch is None:
        return None
    frame = user_frame(mismatch) or user_frame(exc)
    if frame is not None:
        source = f" (`{frame.line.strip()}`)" if frame.line else ""
        where = f" at {frame.filename}:{frame.lineno}{source}"
    else:
        where = " (no line of your code is in the traceback)"
    found = _CUDA_DEVICE.search(str(mismatch))
    gpu = found.group(0) if found else "the GPU"
    first_line = str(mismatch).strip().splitlines()[0] if str(mismatch).strip() else type(mismatch).__name__
    return (f"a tensor made on the CPU inside your module met the module's tensors on {gpu}{where}. On a GPU "
            "board the module and each batch are moved to the GPU, but a tensor your code creates without a "
            "device (torch.arange, torch.zeros, torch.tensor, ...) stays on the CPU. Create it on the input's "
            "device (torch.arange(n, device=x.device)), move it with .to(self.device) or .type_as(x), or, if it "
            "does not change, register it once in __init__ with self.register_buffer(name, tensor) so it moves "
            f"with the module. (torch: {first_line})")


__all__ = ["explain_device_error", "user_frame"]
