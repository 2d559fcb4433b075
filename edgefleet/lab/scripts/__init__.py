"""Stand-alone workload scripts the lab runs inside a board (stdlib only, run by file path).

They are run as ``python FILE ...`` through the lab's supervisor, exactly like the agent, so they
land in the board's network namespace and cgroups; they import nothing from the project because
nothing guarantees the project is importable from the board's working directory.
"""
