"""The agent's idle path imports no torch, Lightning or numpy: a board that only reports telemetry
stays at <= 40 MB (bench/agent_footprint.py). The modules that need torch (the training worker,
``agent.grad_stream``, ``agent.local_sgd``) are imported by the worker process only."""

from __future__ import annotations

import subprocess
import sys

IDLE_MODULES = ("edgefleet.agent.__main__", "edgefleet.agent.daemon", "edgefleet.agent.job_runner",
                "edgefleet.agent.sensors.sampler", "edgefleet.agent.home_assistant")
HEAVY = ("torch", "lightning", "pytorch_lightning", "numpy")


def test_importing_the_agents_idle_modules_loads_nothing_heavy() -> None:
    code = (f"import sys\nfor m in {IDLE_MODULES!r}: __import__(m)\n"
            f"print(','.join(sorted(h for h in {HEAVY!r} if h in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", f"the agent's idle path imports {done.stdout.strip()}"
