"""``edge-coordinator demo``: a local fleet on an embedded broker, shown live."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from coordinator.local_broker import start_mosquitto
from coordinator.monitor import monitor_fleet
from protocol.settings import BrokerSettings

# Power models of the demo's boards, so each shows a different (estimated, and labelled so) figure.
_DEMO_BOARDS = [("demo-pi4", 2.7, 6.4), ("demo-pi5", 3.0, 9.5), ("demo-nano", 1.9, 10.0), ("demo-x86", 8.0, 35.0)]


def _agent_command(board_id: str, broker: str, idle_w: float, max_w: float, workdir: Path) -> list[str]:
    conf = workdir / f"{board_id}.toml"
    conf.write_text(f'board_id = "{board_id}"\n[power]\nsource = "estimated"\nidle_w = {idle_w}\nmax_w = {max_w}\n')
    return [sys.executable, "-m", "agent", "--config", str(conf), "--broker", broker]


def run_demo(*, boards: int, seconds: float, watch: Callable[..., None]) -> int:
    with start_mosquitto() as broker:
        procs = []
        try:
            for i in range(boards):
                board_id, idle_w, max_w = _DEMO_BOARDS[i % len(_DEMO_BOARDS)]
                if i >= len(_DEMO_BOARDS):
                    board_id = f"{board_id}-{i // len(_DEMO_BOARDS) + 1}"
                cmd = _agent_command(board_id, broker.address, idle_w, max_w, broker.workdir)
                procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            settings = BrokerSettings(host=broker.host, port=broker.port)
            print(f"broker={broker.address}  (in another terminal: EDGEFLEET_BROKER={broker.address} edge-coordinator status)")
            with monitor_fleet(settings) as view:
                watch(view, title=f"edgefleet demo @ {broker.address}  (Ctrl-C to stop)", seconds=seconds)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return 0
