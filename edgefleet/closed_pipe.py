"""A command whose reader closes the pipe early (``status --json | head``) ends quietly, not with a traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

SIGPIPE_EXIT = 141  # what a shell reports for a writer whose reader went away (128 + SIGPIPE)


def quiet_on_closed_pipe(run: Callable[[], int]) -> int:
    """``run()``'s exit status, or :data:`SIGPIPE_EXIT` once stdout's reader has gone."""
    try:
        try:
            return run()
        finally:
            sys.stdout.flush()  # inside the try: a closed pipe fails here, not in the interpreter's exit
    except BrokenPipeError:
        # Python's documented recipe (signal module, "Note on SIGPIPE"): point stdout at devnull so
        # the flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return SIGPIPE_EXIT


__all__ = ["SIGPIPE_EXIT", "quiet_on_closed_pipe"]
