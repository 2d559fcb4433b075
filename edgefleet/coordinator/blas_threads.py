"""One BLAS thread for numpy in the coordinator's process.

numpy's bundled OpenBLAS starts a thread per CPU it sees and, after every threaded call, keeps them
spinning for a while in case another call follows. The coordinator makes small BLAS calls at every
step (the exchange's norm check of each board's gradient, ``np.dot``; the audits' distances,
``np.linalg.norm``), each a fraction of a millisecond of work, and on a machine whose cores the
boards' processes share the spinning cost far more than the work: measured on this project's 2-core
machine, ``np.linalg.norm`` of a LeNet-5 gradient (62k values) took 0.5 ms of CPU in the call and
51 ms in all over the 50 ms after it. With one thread there is nothing to spin.

torch's own threads (the replica's validation, the placed tail) are not BLAS threads seen here:
they stay as ``coordinator.run.replica_threads`` fits them. threadpoolctl comes with scikit-learn;
without it this is a no-op, said once in the debug log.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

_limited: list[Any] = []  # the threadpoolctl limit, kept for the process's life (once)


def one_blas_thread() -> None:
    """Limit numpy's BLAS to one thread for the rest of the process (idempotent)."""
    if _limited:
        return
    try:
        # numpy loads the BLAS library threadpoolctl limits; threadpoolctl is optional (scikit-learn brings it)
        import numpy  # noqa: F401
        from threadpoolctl import threadpool_limits
    except ImportError as exc:
        log.debug("numpy's BLAS threads left as they are (%s)", exc)
        _limited.append(None)
        return
    _limited.append(threadpool_limits(limits=1, user_api="blas"))
    log.debug("numpy's BLAS limited to one thread")


__all__ = ["one_blas_thread"]
