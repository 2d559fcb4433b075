"""The coordinator's numpy runs its BLAS on one thread once an exchange exists (``coordinator.blas_threads``):
OpenBLAS's idle threads spin after each of the exchange's small per-step calls, at a CPU cost far above the work."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

threadpoolctl = pytest.importorskip("threadpoolctl")


def test_one_blas_thread_limits_numpys_blas_for_the_process() -> None:
    code = textwrap.dedent("""
        import numpy as np, threadpoolctl
        from edgefleet.coordinator.blas_threads import one_blas_thread
        before = [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
        one_blas_thread(); one_blas_thread()
        np.dot(np.ones(100_000, dtype=np.float32), np.ones(100_000, dtype=np.float32))
        after = [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
        print(before, after)
    """)
    env = {"OPENBLAS_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"}  # as on a 2-core board or coordinator
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=True)
    before, after = out.stdout.strip().split("] [")
    assert before.strip("[") and "2" in before  # numpy's BLAS had two threads
    assert set(after.strip("[]").split(", ")) == {"1"}
