"""Planner tests, and the small fleet builders they share.

Boards are built from the lines the planner fits (``a + c * b`` seconds, ``m0 + m1 * b`` bytes),
measured at two batch sizes that lie exactly on them, so expected figures can be computed by hand.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from edgefleet.coordinator.planning.profiles import BatchPoint, BoardProfile, FleetProfile

BENCH = Path(__file__).resolve().parents[2] / "bench"
MB = 10**6
GB = 10**9
KEY = 'mlp{"layers":2}[1,32,32]'


def load_bench(file_name: str, module_name: str, *, helpers: bool = False) -> ModuleType:
    """A part of ``bench/`` loaded from its file ``file_name`` as ``module_name``: bench/ is a folder of scripts, not
    a package. ``helpers``: bench/ goes on ``sys.path`` first, for the modules beside it that the file imports
    (``_table``, ``_harness``), as when it runs as a script."""
    if helpers and str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(module_name, BENCH / file_name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def board(board_id: str, *, a: float = 0.05, c: float = 0.01, m0: float = 200 * MB, m1: float = 1 * MB,
          memory: int = 2 * GB, active_w: float = 6.0, idle_w: float = 2.5, link: float = 10 * MB,
          link_down: float | None = None, key: str = KEY, version: str = "0.1.0", power_source: str = "estimated",
          sizes: tuple[int, ...] = (8, 32), link_w: float | None = None,
          link_round: tuple[int, float] | None = None) -> BoardProfile:
    """A board whose profile points lie exactly on the given lines."""
    return BoardProfile(board_id=board_id, agent_version=version, model_key=key,
                        points=tuple(BatchPoint(b, a + c * b, round(m0 + m1 * b)) for b in sizes),
                        active_power_w=active_w, idle_power_w=idle_w, power_source=power_source,
                        memory_total_bytes=memory, link_bytes_per_s=link, link_down_bytes_per_s=link_down,
                        link_power_w=link_w, link_round_bytes=None if link_round is None else link_round[0],
                        link_round_s=None if link_round is None else link_round[1])


def fleet(*boards: BoardProfile, grad_bytes: int = 1 * MB, coordinator_link: float = 125 * MB,
          dataset_len: int = 6000, key: str = KEY, variant: dict[str, Any] | None = None) -> FleetProfile:
    return FleetProfile(model_key=key, grad_bytes=grad_bytes, coordinator_link_bytes_per_s=coordinator_link,
                        dataset_len=dataset_len, boards={b.board_id: b for b in boards}, variant=variant or {})


# Board kinds after lab/fleets/mixed4.toml: relative CPU speed, active/idle W, memory, link.
KINDS = {
    "pi4": (1.0, 6.4, 2.7, 1 * GB, 2.5 * MB),
    "pi5": (2.25, 7.0, 2.7, 2 * GB, 7.5 * MB),
    "nano": (0.75, 10.0, 2.0, 4 * GB, 12.5 * MB),
    "x86": (3.0, 20.0, 6.0, 8 * GB, 12.5 * MB),
}


def random_fleet(rng: np.random.Generator, n: int, *, grad_bytes: int = 250_000, key: str = KEY,
                 variant: dict[str, Any] | None = None, per_sample_s: float = 0.004) -> FleetProfile:
    """n boards of random kinds with +-25% spread in speed, intercept, power and link."""
    boards = []
    for i in range(n):
        kind = list(KINDS)[int(rng.integers(len(KINDS)))]
        speed, active, idle, memory, link = KINDS[kind]
        boards.append(board(f"{kind}-{i}", a=float(rng.uniform(0.01, 0.06)),
                            c=per_sample_s / speed * float(rng.uniform(0.8, 1.25)),
                            m0=250 * MB, m1=2 * MB, memory=memory, active_w=active * float(rng.uniform(0.85, 1.15)),
                            idle_w=idle, link=link * float(rng.uniform(0.6, 1.0)), key=key,
                            link_w=idle + 0.25 * (active - idle)))
    return fleet(*boards, grad_bytes=grad_bytes, coordinator_link=125 * MB, dataset_len=60_000, key=key,
                 variant=variant)


def random_variants(rng: np.random.Generator, n: int, layers: tuple[int, ...] = (2, 3)) -> dict[str, FleetProfile]:
    """The same boards profiled for several layer counts: more layers, more compute and gradient."""
    base = random_fleet(rng, n)
    out = {}
    for layers_ in layers:
        key = f'mlp{{"layers":{layers_}}}[1,32,32]'
        scale = layers_ / layers[0]
        boards = [board(b.board_id, a=b.time_fit.intercept, c=b.time_fit.slope * scale, m0=250 * MB,
                        m1=2 * MB * scale, memory=b.memory_total_bytes, active_w=b.active_power_w,
                        idle_w=b.idle_power_w, link=b.link_bytes_per_s, key=key) for b in base.boards.values()]
        out[f"layers={layers_}"] = fleet(*boards, grad_bytes=int(base.grad_bytes * scale), coordinator_link=125 * MB,
                                         dataset_len=base.dataset_len, key=key, variant={"layers": layers_})
    return out


def wild_variants(rng: np.random.Generator, n: int, scales: tuple[float, ...] = (1.0, 1.6)) -> dict[str, FleetProfile]:
    """Harder instances: intercepts up to 0.2 s, a 40x spread of speeds, links from 1 to 100 MB/s,
    3-25 W, memory that binds at large batches; one variant per compute scale."""
    spec = [{"a": float(rng.uniform(0, 0.2)), "c": float(np.exp(rng.uniform(np.log(0.0005), np.log(0.02)))),
             "m1": float(rng.uniform(1, 20)) * MB, "memory": int(rng.choice([1, 2, 4])) * GB,
             "active_w": float(rng.uniform(3, 25)), "idle_w": float(rng.uniform(1, 5)),
             "link": float(np.exp(rng.uniform(np.log(1 * MB), np.log(100 * MB))))} for _ in range(n)]
    coordinator_link = float(rng.uniform(12, 125)) * MB
    out = {}
    for scale in scales:
        key = f'mlp{{"scale":{scale}}}[1,32,32]'
        boards = [board(f"b{i}", a=p["a"], c=p["c"] * scale, m0=300 * MB, m1=p["m1"] * scale, memory=p["memory"],
                        active_w=p["active_w"], idle_w=p["idle_w"], link=p["link"], key=key)
                  for i, p in enumerate(spec)]
        out[f"scale={scale}"] = fleet(*boards, grad_bytes=int(2 * MB * scale), coordinator_link=coordinator_link,
                                      dataset_len=50_000, key=key, variant={"scale": scale})
    return out
