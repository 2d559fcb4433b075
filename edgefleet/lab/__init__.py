"""The emulated fleet ("the lab"): boards as network namespaces with CPU, memory and link limits.

Each board is a network namespace joined to the bridge ``efl-br0`` by a veth pair shaped with
tc tbf both ways, its processes in a cgroup v1 with a CPU quota and a memory limit, running a
real ``edge-agent`` against a real Mosquitto. See docs/lab.md; ``edge-lab --help``.

    from edgefleet.lab import Lab, load_fleet
    with Lab(load_fleet("mixed4")) as lab:    # a shipped fleet's name, or a fleet file
        lab.wait_online()
"""

from edgefleet.lab.fleet_file import FLEETS_DIR, BoardSpec, Fleet, FleetError, load_fleet, parse_fleet, shipped_fleets
from edgefleet.lab.lab import Lab, LabBusy, LabUnavailable
from edgefleet.lab.naming import PREFIX

__all__ = ["FLEETS_DIR", "PREFIX", "BoardSpec", "Fleet", "FleetError", "Lab", "LabBusy", "LabUnavailable", "load_fleet",
           "parse_fleet", "shipped_fleets"]
