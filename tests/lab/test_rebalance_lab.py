"""Adapting during training on the emulated fleet: a board loses two thirds of its CPU mid-job (a Pi
throttling under heat), the coordinator re-balances the batch sizes, and the step time comes back.

Three boards train ``resnet_small`` with batch sizes proportional to their CPU quotas (0.70, 0.50
and 0.25 core: every board takes about 0.5 s a step, ~3.4 ms of CPU a sample). After the
rebalancer has its reference, the test cuts the 0.25 board to a third. Its steps take three times
as long and hold up the fleet until the re-balance, announced two steps ahead, moves most of its
samples to the others; once the new sizes have a reference of their own, the rebalancer may
correct its split once. The fleet then has 1.28 instead of 1.45 cores, so the best a re-split can
do is 1.13x the step time before the cut. The test asks for a split near that optimum (the cut
board keeps at most 1.5x its share of the remaining CPU) and for a step time within 1.35x. The
host adds its own share: the cut board, with 1.7 ms of CPU every 20 ms, spends 10-20% more CPU
per sample than before, one sample more or less on it is 10% of a step, and per-sample times
wander by up to 15% between runs. On a quiet host, four runs came back at 1.02-1.27x. Before the
rebalancer split by the steps since the drift and checked its own splits, one CI run came back at
1.40x, and one local run split 87,62,31 -> 99,60,21 on a median that had turned on a slow outlier
and stayed there. A board that needs over 1.3x the CPU time per sample after the re-balance than
before (at its quota) was not given its quota by the host: the test then skips, naming the figures.
Below that, the boards that kept their quota measure what the host took from all of them (one CI
run: 1.16x and 1.24x more CPU time per sample, step time 1.39x), and the bound scales by it.

The assertion message gives the measured figures.

Step time is the interval between consecutive steps in metrics.jsonl (``elapsed_s``), which also
counts the coordinator's share of a step; the per-step medians absorb single outliers.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest

from edgefleet.coordinator.exchange.server import SPLIT_LEAD_STEPS
from edgefleet.lab.fleet_file import FleetError, parse_fleet
from edgefleet.lab.lab import Lab, agent_supports_fleet_key
from edgefleet.lab.measurements import HostSteal, skip_if_stolen
from tests.helpers import train_command, wait_until, write_fleet_key
from tests.lab.quota_fleet import quota_fleet_toml

QUOTAS = {"big": 0.70, "mid": 0.50, "small": 0.25}
BATCHES = {"big": 87, "mid": 62, "small": 31}   # ~3.4 ms of CPU per sample: ~0.5 s a step on each board
CUT = "small"
WARMUP_STEPS = 2          # coordinator.run.training.REBALANCE_WARMUP_STEPS
WINDOW = 5                # the rebalancer's window (its default)
REFERENCE_STEPS = 2 * WINDOW  # the steps at a split before the rebalancer judges it (Rebalancer.reference_steps)
STEPS_AFTER = REFERENCE_STEPS + 2  # steps measured after the re-balance took effect: past the check of its own split
# A 20 ms CFS period instead of the kernel's 100 ms: a throttled board then waits at most 20 ms for
# its next slice, not up to 100 ms, which at ~0.5 s steps would be noise the size of the effect.
CFS_PERIOD_US = 20_000
# While the workers import torch and Lightning (~9 s of CPU each), every board may use a whole core.
STARTUP_QUOTA = 1.0
# The lab machine is shared; measured speeds wander by up to ~20% between windows of steps. The cut
# is a +200% drift, so a higher threshold than the default 0.15 loses nothing and keeps noise out.
THRESHOLD = 0.3
MAX_RATIO = 1.35
SPLIT_SLACK = 1.5         # the cut board's new batch may be this many times its share of the CPU left
# A board's CPU time per sample (compute time x quota / batch) is its own: ~3.4 ms here, ~10% more at
# the cut board's small batch. When it grows by more than this between the windows compared, the host
# did not give the boards their quotas (other load, the hypervisor) and the step times say nothing.
HOST_SLACK = 1.3


def _lines(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def _periods(lines: list[dict[str, Any]], first: int, last: int) -> list[float]:
    """Wall time of steps ``first..last``: the interval since the step before."""
    elapsed = {line["step"]: line["elapsed_s"] for line in lines}
    return [elapsed[s] - elapsed[s - 1] for s in range(max(first, 1), last + 1) if s in elapsed and s - 1 in elapsed]


def _cpu_per_sample(lines: list[dict[str, Any]], first: int, last: int, quotas: dict[str, float]) -> dict[str, float]:
    """Each board's median CPU time per sample over steps ``first..last``, at ``quotas``."""
    window = [line for line in lines if first <= line["step"] <= last]
    return {b: statistics.median(line["compute_s"][b] * q / line["batch_sizes"][b] for line in window)
            for b, q in quotas.items()}


def _rebalances(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line["rebalance"] for line in lines if "rebalance" in line]


def test_a_board_cut_to_a_third_of_its_cpu_is_rebalanced_and_the_step_time_recovers(tmp_path: Path, no_lab: None) -> None:
    if not agent_supports_fleet_key():
        pytest.skip("this edge-agent has no [security] section: it can't verify training commands")
    try:
        fleet = parse_fleet(quota_fleet_toml("rebalance", QUOTAS), source="rebalance fleet")
    except FleetError as exc:
        pytest.skip(f"the fleet does not fit this machine: {exc}")
    key = write_fleet_key(tmp_path / "fleet.key")
    run_dir = tmp_path / "run"

    with Lab(fleet, fleet_key_file=key, logs_dir=tmp_path / "logs") as lab:
        lab.wait_online(timeout_s=60)
        for board in QUOTAS:
            lab.board(board).cgroup.set_cpu_quota(STARTUP_QUOTA, period_us=CFS_PERIOD_US)
        # Audits stay on: an audit recomputes a board's slice of this ResNet on the coordinator (up to a second on one
        # thread) while the replica trails the exchange, off the step's path (it lengthened steps 1.56-1.91x inside it;
        # and until the next audit was drawn as the exchange copies a vector, a lagging replica audited every step).
        cmd = train_command("--rebalance-threshold", str(THRESHOLD), broker=lab.broker_address,
                            fleet_key=key, boards=list(QUOTAS),
                            batch=[BATCHES[b] for b in QUOTAS], model="resnet_small",
                            model_options="width=48,optimizer=sgd,lr=0.05", dataset="synthetic",
                            dataset_options="n=4096,n_val=64", steps=150, threads=1, run_dir=run_dir)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        steal = HostSteal()  # the drift and the recovery are timings: they need the host's CPU
        steal_before = 0.0
        try:
            # Prepare: the job runs at the planned quotas from its first step on.
            wait_until(lambda: _lines(run_dir) or proc.poll() is not None, timeout_s=120, what="the job's first step")
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            for board, cpu in QUOTAS.items():
                lab.board(board).cgroup.set_cpu_quota(cpu, period_us=CFS_PERIOD_US)

            def split_since() -> int:
                """The first step at the current split and past the warm-up."""
                return max([WARMUP_STEPS + 1, *(r["from_step"] for r in _rebalances(_lines(run_dir)))])

            # Execute: cut once the reference at the current split is complete, then wait until the
            # split has settled: STEPS_AFTER steps (more than the rebalancer's reference, after which it
            # checks a split it chose) since the last re-balance.
            wait_until(lambda: len(_lines(run_dir)) > split_since() + REFERENCE_STEPS + WINDOW or proc.poll() is not None,
                       timeout_s=120, what="the rebalancer's reference steps")
            cut_step = len(_lines(run_dir))      # the first step that may run on the cut quota
            lab.board(CUT).cgroup.set_cpu_quota(QUOTAS[CUT] / 3, period_us=CFS_PERIOD_US)
            steal_before, steal = steal.share, HostSteal()

            def settled() -> list[dict[str, Any]] | None:
                lines = _lines(run_dir)
                after_cut = [r for r in _rebalances(lines) if r["step"] >= cut_step]
                return after_cut if after_cut and len(lines) > after_cut[-1]["from_step"] + STEPS_AFTER else None

            rebalances = wait_until(lambda: settled() or proc.poll() is not None, timeout_s=150,
                                    what="a re-balance after the cut and steps after the last one")
            proc.send_signal(signal.SIGINT)      # stop at a step boundary, as Ctrl-C does
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    # Assert
    skip_if_stolen(steal_before, steal.share)
    assert isinstance(rebalances, list), f"no re-balance after the cut at step {cut_step}:\n{out[-2000:]}\n{err[-2000:]}"
    assert proc.returncode == 130, err[-3000:]
    lines = _lines(run_dir)
    # The reaction: the cut board's drift, seen in one window of steps and confirmed in the next (a
    # noisy board's windows are longer), announced to the user.
    rebalance = rebalances[0]
    assert CUT in rebalance["drift"] and rebalance["drift"][CUT] > THRESHOLD, rebalance
    assert rebalance["step"] <= cut_step + 4 * WINDOW, f"the re-balance came at step {rebalance['step']}, the cut at {cut_step}"
    assert rebalance["from_step"] == rebalance["step"] + SPLIT_LEAD_STEPS + 1
    assert f"re-balancing from step {rebalance['from_step']}: {CUT} slowed" in out
    # At most one correction once the new split's own reference is measured; the split it ends at.
    assert len(rebalances) <= 2, rebalances
    old, new = rebalance["old_batch_sizes"], rebalances[-1]["new_batch_sizes"]
    assert new[CUT] < old[CUT] and sum(new.values()) == sum(old.values()) == sum(BATCHES.values()), rebalances
    fair = sum(BATCHES.values()) * (QUOTAS[CUT] / 3) / (sum(QUOTAS.values()) - QUOTAS[CUT] * 2 / 3)
    assert new[CUT] <= SPLIT_SLACK * fair, f"{CUT} keeps {new[CUT]} samples, its share of the CPU is {fair:.1f}: {rebalances}"
    from_step = rebalances[-1]["from_step"]
    assert all(line["batch_sizes"] == new and line["n"] == sum(BATCHES.values())
               for line in lines if from_step <= line["step"] <= from_step + STEPS_AFTER)

    first_before = max([WARMUP_STEPS + 1, *(r["from_step"] for r in _rebalances(lines) if r["step"] < cut_step)])
    cut_quotas = {**QUOTAS, CUT: QUOTAS[CUT] / 3}
    cpu_before = _cpu_per_sample(lines, first_before, cut_step - 1, QUOTAS)
    cpu_after = _cpu_per_sample(lines, from_step + 1, from_step + STEPS_AFTER, cut_quotas)
    slowed = {b: cpu_after[b] / cpu_before[b] for b in QUOTAS if cpu_after[b] > HOST_SLACK * cpu_before[b]}
    if slowed:
        pytest.skip("the host did not give the boards their quotas after the re-balance: CPU time per sample "
                    + ", ".join(f"{b} {cpu_before[b] * 1e3:.2f} -> {cpu_after[b] * 1e3:.2f} ms ({r:.2f}x)"
                                for b, r in slowed.items()) + " at the same quota; the step times cannot be compared")
    before = statistics.median(_periods(lines, first_before, cut_step - 1))
    during = statistics.median(_periods(lines, cut_step + 1, rebalance["from_step"] - 1))
    after = statistics.median(_periods(lines, from_step + 1, from_step + STEPS_AFTER))
    figures = (f"step time before the cut {before:.2f} s, cut at step {cut_step}, with the cut {during:.2f} s, "
               + "; ".join(f"re-balanced at step {r['step']} from step {r['from_step']} "
                           f"({','.join(map(str, r['old_batch_sizes'].values()))} -> "
                           f"{','.join(map(str, r['new_batch_sizes'].values()))})" for r in rebalances)
               + f", after it {after:.2f} s "
               f"= {after / before:.2f}x before (best possible with {QUOTAS[CUT] / 3:.2f} instead of {QUOTAS[CUT]:.2f} "
               f"core: {sum(QUOTAS.values()) / (sum(QUOTAS.values()) - QUOTAS[CUT] * 2 / 3):.2f}x); CPU per sample "
               + ", ".join(f"{b} {cpu_before[b] * 1e3:.2f} -> {cpu_after[b] * 1e3:.2f} ms" for b in QUOTAS))
    print("\n" + figures)
    assert during > 2 * before, f"the cut did not slow the fleet down: {figures}"
    # What the host took from every board (within HOST_SLACK) slows the steps after the re-balance
    # by as much, whatever the split: the boards that kept their quota say how much.
    host = max(1.0, min(cpu_after[b] / cpu_before[b] for b in QUOTAS if b != CUT))
    assert after <= MAX_RATIO * host * before, f"the step time did not recover (host {host:.2f}x slower): {figures}"
