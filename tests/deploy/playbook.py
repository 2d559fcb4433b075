"""Running ansible/site.yml the way a user does, and reading its PLAY RECAP."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.tools import ANSIBLE_DIR, tool

_RECAP = re.compile(r"^(\S+)\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.MULTILINE)


@dataclass
class PlaybookRun:
    returncode: int
    output: str
    recap: dict[str, dict[str, int]] = field(default_factory=dict)

    def changed_tasks(self) -> list[str]:
        """The names of the tasks that reported a change (for failure messages)."""
        names, task = [], ""
        for line in self.output.splitlines():
            if line.startswith(("TASK [", "RUNNING HANDLER [")):
                task = line.split("[", 1)[1].rsplit("]", 1)[0]
            elif line.startswith("changed:"):
                names.append(task)
        return names

    def summary(self) -> str:
        return f"exit {self.returncode}; recap {self.recap}\n--- last output ---\n{self.output[-6000:]}"


def run_playbook(inventory: Path, *, extra_vars: dict[str, object] | None = None, env: dict[str, str] | None = None,
                 log_path: Path | None = None, playbook: Path = ANSIBLE_DIR / "site.yml",
                 timeout_s: float = 1500) -> PlaybookRun:
    """Run a playbook with an inventory; the output also goes to ``log_path`` for a look afterwards."""
    cmd = [tool("ansible-playbook"), "-i", str(inventory), str(playbook)]
    if extra_vars:
        cmd += ["-e", json.dumps(extra_vars)]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=inventory.parent)
    output = result.stdout + result.stderr
    if log_path is not None:
        log_path.write_text(output)
    recap = {m[1]: {"ok": int(m[2]), "changed": int(m[3]), "unreachable": int(m[4]), "failed": int(m[5])}
             for m in _RECAP.finditer(output)}
    return PlaybookRun(result.returncode, output, recap)
