"""Memory and swap, in bytes (psutil)."""

from __future__ import annotations

from typing import Any

import psutil


class MemorySource:
    name = "memory"

    def available(self) -> bool:
        return True

    def read(self) -> dict[str, Any]:
        vm = psutil.virtual_memory()
        swap = psutil.swap_memory()
        return {
            "mem_total_bytes": int(vm.total),
            # "used" as a board owner means it: what is not available to a new process.
            "mem_used_bytes": int(vm.total - vm.available),
            "mem_available_bytes": int(vm.available),
            "mem_percent": float(vm.percent),
            "swap_total_bytes": int(swap.total),
            "swap_used_bytes": int(swap.used),
        }
