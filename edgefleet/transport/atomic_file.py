"""The one atomic file write: a file is replaced whole or not at all, and the change survives a crash.

:func:`write_atomically` writes the bytes to a temporary name in the same folder
(``.NAME.tmp``: same file system, so the rename is atomic), flushes it to disk (``fsync``),
renames it over the old file and flushes the folder, so that a crash, a full disk or an
interrupt leaves either the old file or the new one, never a torn one. The temporary file is
removed on every failure path (``KeyboardInterrupt`` included).

Every failure to write raises :class:`AtomicWriteError`, an ``OSError`` with the original
``errno`` and ``strerror``, the path that failed (the file, or its folder when the folder's
``fsync`` failed) and how many bytes the write needed (None for the rename or the folder):
callers turn it into their own clear message (the run directory's full-disk line, the report's
``--output`` hint, the agent's nonce-record warning).

Users: the run directory's checkpoints and JSON files (``coordinator.run.checkpoints``), the
profile file (``coordinator.planning.profiles``), the report page (``coordinator.report.report_file``),
the agent's command nonce record (``agent.nonce_file``) and the lab's state file (``lab.leftovers``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

_CHUNK = 1 << 20  # bytes per write(2)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk, or a full quota


class AtomicWriteError(OSError):
    """An atomic write failed; ``errno``/``strerror`` are the OS's, the file it was replacing is unchanged.

    Args:
        path: What failed: the file being written, or its folder (its ``fsync``).
        cause: The OS's error.
        needed: Bytes the write needed (None: a rename or the folder's ``fsync`` failed).
    """

    def __init__(self, path: Path, cause: OSError, needed: int | None) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause), str(path))
        self.path, self.needed = path, needed

    @property
    def no_space(self) -> bool:
        """The disk (or the user's quota) is full."""
        return self.errno in NO_SPACE


def temp_path(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place."""
    return path.with_name(f".{path.name}.tmp")


def remove_quietly(path: Path) -> None:
    """Remove ``path`` if it is there; a failure is logged (the next write of that name replaces it)."""
    with contextlib.suppress(FileNotFoundError):
        try:
            path.unlink()
        except OSError as exc:
            log.warning("could not remove the temporary file %s: %s", path, exc)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until every byte of ``data`` is written (in 1 MiB calls)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view[:_CHUNK])
        view = view[written:]


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOTSUP):  # a file system without directory fsync
            log.debug("%s: directory fsync not supported (%s)", folder, exc)
            return
        raise AtomicWriteError(folder, exc, None) from None


def write_atomically(path: Path, data: bytes | memoryview, *, mode: int = 0o666,
                     before_rename: Callable[[], None] | None = None) -> None:
    """Replace ``path`` with ``data``: the old file until the new one is on disk, never a torn one.

    Args:
        path: The file; its folder must exist.
        data: Its new contents.
        mode: The new file's permissions (less the umask), e.g. ``0o600`` for a file only its
            owner may read.
        before_rename: Called once the new contents are on disk, just before the rename (e.g.
            to keep the old file under another name); if it raises, the temporary file is removed
            and its exception goes to the caller unchanged.

    Raises:
        AtomicWriteError: the write failed; ``path`` is unchanged (``no_space``: the disk is full)
            and no temporary file is left.
    """
    path = Path(path)
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as exc:  # KeyboardInterrupt too: never leave the temporary file behind
        remove_quietly(tmp)
        if isinstance(exc, OSError):
            raise AtomicWriteError(path, exc, memoryview(data).nbytes) from None
        raise
    if before_rename is not None:
        try:
            before_rename()
        except BaseException:
            remove_quietly(tmp)
            raise
    try:
        os.replace(tmp, path)
    except OSError as exc:
        remove_quietly(tmp)
        raise AtomicWriteError(path, exc, None) from None
    _fsync_dir(path.parent)


__all__ = ["NO_SPACE", "AtomicWriteError", "remove_quietly", "temp_path", "write_all", "write_atomically"]
