"""Reading a benchmark's board process: the next message it put on its result queue, or why none came.

Shared by the benchmarks that run a board in a process of its own (``overlap.py``,
``step_fixed_costs.py``): the board puts ``(kind, value)`` tuples, ``("error", text)`` when it failed.
"""

from __future__ import annotations

import queue
import time
from typing import Any


def next_message(results: Any, process: Any, kind: str, timeout_s: float, error: type[Exception]) -> Any:
    """The value of the board's next message, which must be ``kind``.

    Raises:
        error: the board reported an error, sent another kind, ended, or said nothing for ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = results.get(timeout=0.2)
        except queue.Empty:  # only that: a signal's exception raised inside get() must stop the run
            if not process.is_alive():
                raise error(f"the board process ended (exit code {process.exitcode})") from None
            if time.monotonic() > deadline:
                raise error(f"no {kind!r} from the board within {timeout_s:g} s") from None
            continue
        if got[0] == "error":
            raise error(got[1])
        if got[0] != kind:
            raise error(f"expected {kind!r} from the board, got {got[0]!r}")
        return got[1]
