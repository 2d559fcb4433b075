"""Small helpers shared by the tests: waiting on conditions (never sleeping to synchronise), a fleet key, an
agent's config file and the ``edge-coordinator train`` command line."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from edgefleet.transport.fleet_key import generate_key_hex

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
COORDINATOR = (sys.executable, "-m", "edgefleet.coordinator.cli")  # ``edge-coordinator`` as a subprocess runs it


def wait_until(predicate: Callable[[], T], *, timeout_s: float, interval_s: float = 0.05, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy; fail the test with ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def coordinator(*args: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    """Run the real ``edge-coordinator`` CLI in a subprocess."""
    return subprocess.run([*COORDINATOR, *args], capture_output=True, text=True, timeout=timeout_s)


def status_json(broker: str, *, config: Path | None = None) -> dict[str, dict[str, Any]]:
    """``edge-coordinator status --json`` as ``{board_id: row}``; ``{}`` if the CLI failed."""
    global_args = ("--config", str(config)) if config else ()
    result = coordinator("--broker", broker, *global_args, "status", "--json", "--wait", "2")
    if result.returncode != 0:
        assert "Traceback" not in result.stderr, result.stderr
        return {}
    return {row["board_id"]: row for row in json.loads(result.stdout)}


def interrupt_after(cmd: list[str], progress: Callable[[], int], at_least: int, *, what: str,
                    timeout_s: float = 180) -> tuple[int, str, str]:
    """Run ``cmd``, press Ctrl-C (SIGINT) once ``progress()`` reaches ``at_least``; (exit code, stdout, stderr)."""
    import signal

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: progress() >= at_least, timeout_s=timeout_s, what=what)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err


def wait_boards_online(broker: str, boards: list[str], *, timeout_s: float = 30) -> None:
    """Until ``edge-coordinator status`` shows every board in ``boards`` online (as train checks before it starts)."""
    wait_until(lambda: all(status_json(broker).get(board, {}).get("state") == "online" for board in boards),
               timeout_s=timeout_s, interval_s=0.2, what=f"{', '.join(boards)} online")


def write_fleet_key(path: Path) -> Path:
    """A new fleet key at ``path``, hex and owner-only (as ``edge-coordinator keygen`` leaves it); ``path``."""
    path.write_text(generate_key_hex() + "\n")
    path.chmod(0o600)
    return path


def agent_config(board_id: str, *, key: Path | None = None, power: str | None = "estimated", idle_w: float | None = None,
                 max_w: float | None = None, keep_worker: bool | None = None, extra: str = "") -> str:
    """An ``edge-agent`` TOML config: the board's id, the fleet key it trusts, its power model, ``[training]``."""
    text = f'board_id = "{board_id}"\n'
    if key is not None:
        text += f'[security]\nfleet_key_file = "{key}"\n'
    if power is not None:
        text += f'[power]\nsource = "{power}"\n'
        text += "".join(f"{name} = {value}\n" for name, value in (("idle_w", idle_w), ("max_w", max_w)) if value is not None)
    if keep_worker is not None:
        text += f"[training]\nkeep_worker = {'true' if keep_worker else 'false'}\n"
    return text + extra


def _joined(value: str | int | Sequence[Any]) -> str:
    return value if isinstance(value, str) else str(value) if isinstance(value, int) else ",".join(map(str, value))


def _options(value: str | Mapping[str, Any]) -> str:
    return value if isinstance(value, str) else ",".join(f"{k}={v}" for k, v in value.items())


_TRAIN_FLAGS = {"boards": ("--boards", _joined), "batch": ("--batch", _joined), "model": ("--model", str),
                "model_options": ("--model-options", _options), "dataset": ("--dataset", str),
                "dataset_options": ("--dataset-options", _options), "datamodule": ("--datamodule", str),
                "datamodule_options": ("--datamodule-options", _options), "seed": ("--seed", str),
                "steps": ("--steps", str), "epochs": ("--epochs", str), "threads": ("--threads", str),
                "checkpoint_every": ("--checkpoint-every", str), "run_dir": ("--run-dir", str), "resume": ("--resume", str)}


def train_args(*extra: str, broker: Any = None, config: Path | None = None, fleet_key: Path | None = None,
               no_rebalance: bool = False, **flags: Any) -> list[str]:
    """The arguments of ``edge-coordinator [--broker B] [--config C] train …``, without the program.

    ``broker`` is an address or anything with one (a ``LocalBroker``); every keyword of ``_TRAIN_FLAGS`` that is not
    None becomes its flag (sequences joined with commas, options mappings as ``k=v,…``); ``extra`` follows as given.
    """
    unknown = set(flags) - set(_TRAIN_FLAGS)
    assert not unknown, f"train_args: no flag for {', '.join(sorted(unknown))}; pass it in extra"
    args: list[str] = []
    if broker is not None:
        args += ["--broker", str(getattr(broker, "address", broker))]
    if config is not None:
        args += ["--config", str(config)]
    args.append("train")
    if fleet_key is not None:
        args += ["--fleet-key", str(fleet_key)]
    for name, (flag, text) in _TRAIN_FLAGS.items():
        if flags.get(name) is not None:
            args += [flag, text(flags[name])]
    if no_rebalance:
        args.append("--no-rebalance")
    return [*args, *extra]


def train_command(*extra: str, **options: Any) -> list[str]:
    """``edge-coordinator … train …`` as a subprocess runs it: ``train_args(*extra, **options)`` after the program."""
    return [*COORDINATOR, *train_args(*extra, **options)]


def plain_lenet_training(steps: int, global_batch: int, *, seed: int, lr: float = 0.05,
                         optimizer: str = "sgd") -> dict[str, torch.Tensor]:
    """LeNet-5 on digits with SGD in one plain process, no agents, no exchange: the reference a fleet's model must equal
    (the same seed's initial weights and global batches)."""
    import torch  # the training stack: only for the tests that train

    from edgefleet.workloads.params import single_optimizer
    from edgefleet.workloads.registry import build_dataset, build_model
    from edgefleet.workloads.sharding import GlobalBatchPlan

    dataset = build_dataset("digits", "train", {})
    torch.manual_seed(seed)
    model = build_model("lenet5", {"optimizer": optimizer, "lr": lr}, data=dataset)
    stepper = single_optimizer(model.configure_optimizers())
    plan = GlobalBatchPlan(len(dataset), [global_batch], seed)
    for step in range(steps):
        samples = [dataset[i] for i in plan.global_indices(step)]
        x, y = torch.stack([s[0] for s in samples]), torch.stack([torch.as_tensor(s[1]) for s in samples])
        loss = torch.nn.functional.cross_entropy(model(x), y)
        stepper.zero_grad()
        loss.backward()
        stepper.step()
    state: dict[str, torch.Tensor] = model.state_dict()
    return state


def max_relative_error(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The largest relative L2 difference of two state dicts' tensors (same keys)."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in a)
