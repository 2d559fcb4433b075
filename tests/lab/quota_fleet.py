"""A fleet file for tests that need boards of given CPU quotas and nothing else particular."""

from __future__ import annotations


def quota_fleet_toml(name: str, quotas: dict[str, float], *, reserved_cpus: float = 0.5) -> str:
    """A fleet of test boards with these CPU quotas (cores), 2 GiB and 100 Mbit/s each way apiece."""
    boards = "".join(f'[[board]]\nid = "{board}"\nmodel = "test board"\ncpu = {cpu}\nmemory = "2GiB"\n'
                     f'rate_up = "100mbit"\nrate_down = "100mbit"\nidle_w = 2.0\nmax_w = 6.0\n\n'
                     for board, cpu in quotas.items())
    return (f'[lab]\nname = "{name}"\nreserved_cpus = {reserved_cpus}\ntelemetry_interval_s = 1.0\nkeepalive_s = 10\n\n'
            f"{boards}")
