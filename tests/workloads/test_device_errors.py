"""The device-mismatch explanation: every torch wording recognised, the user's line named, nothing else explained."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

from edgefleet.workloads.device_errors import explain_device_error, user_frame
from tests.workloads import device_user_code

# What torch has said over its versions when a CPU tensor meets a GPU one.
TORCH_MESSAGES = [
    "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
    "Expected all tensors to be on the same device, but found at least two devices, cpu and cuda:0! "
    "(when checking argument for argument mat1 in method wrapper_CUDA_addmm)",
    "Expected all tensors to be on the same device, but got mat2 is on cpu, different from other tensors on "
    "cuda:0 (when checking argument in method wrapper_CUDA_mm)",
    "Expected object of device type cuda but got device type cpu for argument #2 'other' in call to _th_add",
    "Tensor for argument #2 'mat1' is on CPU, but expected it to be on GPU (while checking arguments for addmm)",
    "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be the same or input should "
    "be a MKLDNN tensor and weight is a dense tensor",
    "indices should be either on cpu or on the same device as the indexed tensor (cpu)",
    "Tensor on device cpu is not on the expected device cuda:0!",
]


def _line_of(function: Callable[..., Any], text: str) -> int:
    """The line number of the line of ``function`` containing ``text``."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _raised(function: Callable[..., Any], *args: object) -> BaseException:
    with pytest.raises(Exception) as caught:
        function(*args)
    return caught.value


@pytest.mark.parametrize("message", TORCH_MESSAGES)
def test_each_torch_wording_names_the_users_line_and_the_fix(message: str) -> None:
    # Prepare
    exc = _raised(device_user_code.positions_forward, torch.ones(2, 3), message)

    # Execute
    explained = explain_device_error(exc)

    # Assert
    assert explained is not None
    line = _line_of(device_user_code.positions_forward, "raise RuntimeError(message)")
    assert f"device_user_code.py:{line}" in explained
    assert "raise RuntimeError(message)" in explained  # the source line itself
    assert "a tensor made on the CPU inside your module" in explained
    assert "device=x.device" in explained and ".to(self.device)" in explained and "register_buffer" in explained
    assert "Traceback" not in explained


def test_names_the_gpu_of_the_message() -> None:
    exc = _raised(device_user_code.positions_forward, torch.ones(2, 3), TORCH_MESSAGES[0])

    assert "on cuda:0 at " in (explain_device_error(exc) or "")


def test_a_standard_library_frame_is_passed_over_for_the_users_line() -> None:
    exc = _raised(device_user_code.forward_through_stdlib, TORCH_MESSAGES[2])

    explained = explain_device_error(exc)

    assert explained is not None
    assert f"device_user_code.py:{_line_of(device_user_code.forward_through_stdlib, '# the user')}" in explained
    assert "concurrent" not in explained.split(". On a GPU")[0]


def test_a_torch_frame_is_passed_over_for_the_users_line() -> None:
    exc = _raised(device_user_code.forward_through_torch)

    frame = user_frame(exc)

    assert frame is not None
    assert frame.filename.endswith("device_user_code.py")
    assert frame.lineno == _line_of(device_user_code.forward_through_torch, "# the user")


def test_the_cause_of_a_wrapping_error_is_explained() -> None:
    inner = _raised(device_user_code.positions_forward, torch.ones(2, 3), TORCH_MESSAGES[0])
    try:
        raise ValueError("the step failed") from inner
    except ValueError as outer:
        explained = explain_device_error(outer)

    assert explained is not None and "device_user_code.py" in explained


def test_another_runtime_error_is_not_explained() -> None:
    exc = _raised(device_user_code.positions_forward, torch.ones(2, 3),
                  "mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)")

    assert explain_device_error(exc) is None


def test_a_real_torch_error_that_is_not_about_devices_is_not_explained() -> None:
    exc = _raised(torch.mm, torch.ones(2, 3), torch.ones(4, 5))

    assert explain_device_error(exc) is None
