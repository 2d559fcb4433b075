"""Command lines that start one of edgefleet's modules in a new Python process.

``python -m edgefleet.agent.worker`` puts the current directory first on ``sys.path``: started from a
folder holding a package of its own named ``edgefleet`` (or from a user's project checkout), that
folder would be imported instead of ours. The command built here imports ``edgefleet`` with the
current directory taken off ``sys.path``, then puts it back, so the module runs from the installed
package while the user's own code in the current directory stays importable, as with ``-m``.
"""

from __future__ import annotations

import sys

_BOOTSTRAP = (
    "import runpy, sys\n"
    "first = sys.path.pop(0)\n"
    "import edgefleet\n"
    "sys.path.insert(0, first)\n"
    "module = sys.argv.pop(1)\n"
    "runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
)


def module_command(module: str, *args: str, python: str | None = None) -> list[str]:
    """Argument vector running ``python -m MODULE ARGS...`` with edgefleet from the install, never the cwd."""
    if not module.startswith("edgefleet."):
        raise ValueError(f"{module!r} is not one of edgefleet's modules")
    return [python or sys.executable, "-c", _BOOTSTRAP, module, *args]
