"""The emulated fleet ("the lab"): boards as network namespaces with CPU, memory and link limits.

Each board is a network namespace joined to the bridge ``efl-br0`` by a veth pair shaped with
tc tbf both ways, its processes in a cgroup v1 with a CPU quota and a memory limit, running a
real ``edge-agent`` against a real Mosquitto. See docs/lab.md; ``edge-lab --help``.

    from edgefleet.lab import Lab, load_fleet
    with Lab(load_fleet("lab/fleets/mixed4.toml")) as lab:
        lab.wait_online()
"""

from pathlib import Path

from edgefleet.lab.fleet_file import BoardSpec, Fleet, FleetError, load_fleet, parse_fleet
from edgefleet.lab.lab import Lab, LabBusy, LabUnavailable
from edgefleet.lab.naming import PREFIX

FLEETS_DIR = Path(__file__).parent / "fleets"

__all__ = ["FLEETS_DIR", "PREFIX", "BoardSpec", "Fleet", "FleetError", "Lab", "LabBusy", "LabUnavailable", "load_fleet",
           "parse_fleet"]
