"""The hostile exchange tests' server: ``exchange_proc.py`` (a real ExchangeServer) in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers import wait_until

SCRIPT = Path(__file__).with_name("exchange_proc.py")


class ServerProcess:
    """``exchange_proc.py`` in a subprocess; its stdout (JSON lines) and stderr (its log) in files."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.out_path, self.err_path = tmp_path / "server.out", tmp_path / "server.err"
        with self.out_path.open("wb") as out, self.err_path.open("wb") as err:
            self.proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=out, stderr=err)
        self.port = int(self.wait_for("port", timeout_s=30)["port"])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def lines(self) -> list[dict[str, Any]]:
        text = self.out_path.read_text() if self.out_path.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    def log(self) -> str:
        return self.err_path.read_text(errors="replace") if self.err_path.exists() else ""

    def wait_for(self, key: str, *, timeout_s: float, value: Any = None) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            for line in self.lines():
                if "error" in line:
                    raise AssertionError(f"the exchange failed: {line['error']}\n{self.log()[-3000:]}")
                if key in line and (value is None or line[key] == value):
                    return line
            if self.proc.poll() is not None:
                raise AssertionError(f"the exchange exited ({self.proc.returncode}) before {key}={value}\n{self.log()[-3000:]}")
            return None

        return wait_until(found, timeout_s=timeout_s, what=f"{key}={value} from the exchange process")

    def steps(self) -> dict[int, dict[str, Any]]:
        return {line["step"]: line for line in self.lines() if "step" in line}

    def finish(self, timeout_s: float = 60) -> dict[str, Any]:
        done = self.wait_for("done", timeout_s=timeout_s)
        self.proc.wait(timeout_s)
        return done

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
