"""Checkpoints and the run directory: nothing is lost on a crash, nothing is half-written.

Every file is written by ``transport.atomic_file.write_atomically`` (a temporary name in the same
folder, ``fsync``, rename, the folder flushed): a crash or a full disk leaves either the old or the
new file, never a torn one, and no temporary file. A new checkpoint is renamed into place only
once it is on disk; the one it replaces is kept beside it as ``checkpoint.prev.pt``.

``metrics.jsonl`` is appended line by line; a line the disk had no room for is cut off again, so
the file never ends in half a line.

A full disk (or quota) raises :class:`DiskFullError`: one line naming the run directory, the space
the write needed, the space free, and what to do. Any other failure to write raises
:class:`RunDirError` naming the file and the reason.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from edgefleet.protocol.errors import ConfigError, EdgeTrainError
from edgefleet.transport.atomic_file import NO_SPACE, AtomicWriteError, remove_quietly, temp_path, write_all, write_atomically

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
KEEP_PREVIOUS = "checkpoint.prev.pt"
# What a run writes into its directory: a directory holding any of these holds a run.
RUN_FILES = ("config.json", "metrics.jsonl", CHECKPOINT, KEEP_PREVIOUS, "result.json", "model.pt", "plan.json", "logs")


class RunDirError(EdgeTrainError):
    """A file of the run directory could not be written (no permission, a read-only or failing disk).

    Args:
        path: The file being written.
        reason: Why, in the user's words (the OS's message).
    """

    def __init__(self, path: Path, reason: str, *, advice: str = "") -> None:
        self.path, self.reason, self.advice = path, reason, advice
        super().__init__(self._text())

    def _text(self) -> str:
        text = (f"cannot write {self.path}: {self.reason}; check that its folder is writable and its disk mounted "
                "read-write")
        return f"{text}; {self.advice}" if self.advice else text

    def with_advice(self, advice: str) -> RunDirError:
        """The same error with ``advice`` (what to do next, e.g. how to resume) at the end of its line,
        unless it has advice of its own already."""
        if not self.advice:
            self.advice = advice
            self.args = (self._text(),)
        return self


class DiskFullError(RunDirError):
    """The disk (or the user's quota) holding the run directory is full.

    Args:
        path: The file being written.
        needed: Bytes the write needed (None: unknown).
        free: Bytes free on that disk once the partial file was removed (None: unknown).
    """

    def __init__(self, path: Path, needed: int | None, free: int | None, *, advice: str = "") -> None:
        self.needed, self.free = needed, free
        super().__init__(path, "no space left on device", advice=advice)

    def _text(self) -> str:
        free = "an unknown amount" if self.free is None else format_size(self.free)
        if self.needed is None:
            writing, more = f"writing {self.path.name} failed", "more"
        else:
            missing = self.needed - (self.free or 0)
            writing = f"writing {self.path.name} needs {format_size(self.needed)}"
            more = f"at least {format_size(missing)} more" if missing > 0 else "more"
        text = (f"the disk holding {self.path.parent} is full: {writing} and {free} is free; free {more} space there "
                "(or move the run directory to a larger disk)")
        return f"{text}; {self.advice}" if self.advice else text


def format_size(n: int) -> str:
    """``512 B``, ``12.5 KiB``, ``3.0 MiB``, ``1.2 GiB``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def write_error(path: Path, exc: OSError, needed: int | None) -> RunDirError:
    """The run-directory error for ``exc``, raised while writing ``needed`` bytes to ``path``."""
    if exc.errno in NO_SPACE:
        try:
            free: int | None = shutil.disk_usage(path.parent).free
        except OSError:
            free = None
        return DiskFullError(path, needed, free)
    return RunDirError(path, exc.strerror or str(exc))


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Replace ``path`` with ``data``: the old file until the new one is on disk, never a torn one.

    Raises:
        RunDirError: the write failed; ``path`` is unchanged (DiskFullError: no space).
    """
    try:
        write_atomically(path, data)
    except AtomicWriteError as exc:
        raise write_error(exc.path, exc, exc.needed) from None


def atomic_write_json(path: Path, value: Any) -> None:
    """:func:`atomic_write_bytes` of ``value`` as indented JSON."""
    atomic_write_bytes(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def torch_bytes(value: Any) -> memoryview:
    """``value`` as ``torch.save`` writes it (serialised in memory, so its size is known before the disk is touched)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getbuffer()


def atomic_torch_save(path: Path, value: Any) -> None:
    """:func:`atomic_write_bytes` of ``torch.save(value)``."""
    atomic_write_bytes(path, torch_bytes(value))


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` as the run's checkpoint, keeping the previous one beside it.

    The new checkpoint goes to a temporary file, is flushed to disk, and only then takes the place
    of the old one (which becomes ``checkpoint.prev.pt``).

    Raises:
        RunDirError: it could not be written (DiskFullError: no space); the previous checkpoint
            is untouched and no temporary file is left.
    """
    path = run_dir / CHECKPOINT

    def keep_previous() -> None:
        if path.exists():
            try:
                os.replace(path, run_dir / KEEP_PREVIOUS)
            except OSError as exc:
                raise write_error(run_dir / KEEP_PREVIOUS, exc, None) from None

    try:
        write_atomically(path, torch_bytes(state), before_rename=keep_previous)
    except AtomicWriteError as exc:
        raise write_error(exc.path, exc, exc.needed) from None
    log.debug("checkpoint at step %s written to %s", state.get("replica", {}).get("step"), path)
    return path


def load_checkpoint(run_dir: Path) -> dict[str, Any]:
    """The run's newest readable checkpoint.

    Raises:
        ConfigError: no checkpoint, or none that can be read.
    """
    for name in (CHECKPOINT, KEEP_PREVIOUS):
        path = run_dir / name
        if not path.exists():
            continue
        try:
            state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)  # torch types it as Any
            return state
        except Exception as exc:  # a damaged file: fall back to the previous checkpoint
            log.warning("checkpoint %s cannot be read (%s); trying the previous one", path, exc)
    raise ConfigError(f"{run_dir} has no readable checkpoint ({CHECKPOINT}); it cannot be resumed. Start a new run instead.")


def remove_stale_temps(run_dir: Path) -> None:
    """Remove the temporary files a killed coordinator left in ``run_dir`` (their targets are intact)."""
    for name in RUN_FILES:
        tmp = temp_path(run_dir / name)
        if tmp.exists():
            log.info("removing %s, left by an interrupted write", tmp)
            remove_quietly(tmp)


def check_new_run_dir(run_dir: Path) -> None:
    """Refuse to start a new run in ``run_dir`` if it already holds one (or is not a folder).

    Raises:
        ConfigError: naming what is there, with ``--resume`` and ``--run-dir`` as the ways out.
        RunDirError: a file stands where one of its parent folders would go (it cannot be created).
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file, not a folder; choose another --run-dir")
    ancestor = next((parent for parent in run_dir.parents if parent.exists()), None)
    if not run_dir.exists() and ancestor is not None and not ancestor.is_dir():  # make_run_dir would fail: say it now
        raise RunDirError(run_dir, f"cannot create the folder ({ancestor} is a file)", advice="choose another --run-dir")
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    if found:
        raise ConfigError(f"{run_dir} already holds a run ({', '.join(found)}); pass --resume {run_dir} to continue it, "
                          "or choose another --run-dir for a new run (nothing was changed)")


def make_run_dir(run_dir: Path) -> None:
    """Create the run directory. Raises RunDirError naming the folder when that is not possible."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(run_dir, f"cannot create the folder ({exc.strerror or exc})",
                          advice="choose another --run-dir") from None


class MetricsLog:
    """``metrics.jsonl``: one line per applied step, handed to the OS as it is written.

    A line that does not fit on the disk is cut off again, so the file holds whole lines only.

    Raises:
        RunDirError: the file cannot be opened.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
            self._size = os.fstat(self._fd).st_size
        except OSError as exc:
            raise write_error(path, exc, None) from None

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line. Raises RunDirError (DiskFullError: no space), the file unchanged."""
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        data = (json.dumps(record, sort_keys=True) + "\n").encode()
        try:
            write_all(self._fd, data)
        except OSError as exc:
            with contextlib.suppress(OSError):  # shrinking needs no space
                os.ftruncate(self._fd, self._size)
            raise write_error(self.path, exc, len(data)) from None
        self._size += len(data)

    def sync(self) -> None:
        """Flush the lines written so far to disk (before a checkpoint, so that no step it covers is lost)."""
        if self._fd is None:
            return
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise write_error(self.path, exc, None) from None

    def close(self) -> None:
        """Flush and close; a failure is logged, not raised (close runs while another error may be on its way)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        except OSError as exc:
            log.warning("%s may be incomplete on disk: %s", self.path, exc)
        finally:
            os.close(fd)

    @staticmethod
    def truncate_after(path: Path, step: int) -> None:
        """Drop lines for steps >= ``step`` (written after the checkpoint a resume starts from).

        A line that is not whole JSON (the end of a write a crash cut short) is dropped too.

        Raises:
            RunDirError: the file cannot be rewritten (DiskFullError: no space); it is unchanged.
        """
        if not path.exists():
            return
        kept: list[str] = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                if line.strip():
                    log.warning("%s: dropping a line that is not whole JSON: %.80s", path, line)
                continue
            at = record.get("step", -1) if isinstance(record, dict) else None
            if isinstance(at, int) and at < step:
                kept.append(line)
        atomic_write_bytes(path, ("\n".join(kept) + "\n").encode() if kept else b"")
