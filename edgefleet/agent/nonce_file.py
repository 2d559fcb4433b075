"""The agent's command nonce record on disk: the ``protocol.signing.NonceStore`` its verifier keeps.

JSON: ``{"version": 1, "horizon": <unix s> | null, "nonces": [[<ts>, "<32 hex>"], …]}``, readable by
its owner only (0600), replaced whole by ``transport.atomic_file.write_atomically`` so a crash
leaves the old record or the new one, never half of one. ``version`` is the record's layout
(:data:`NONCE_FILE_VERSION`): a record of another version is not used (the verifier then refuses
commands issued before the start for one max-age window, and writes the record anew).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Sequence
from pathlib import Path

from edgefleet.protocol.signing import is_finite_number, is_nonce
from edgefleet.transport.atomic_file import write_atomically

NONCE_FILE_VERSION = 1
MAX_NONCE_FILE_BYTES = 4 * 1024 * 1024


class NonceFile:
    """Where a verifier keeps the nonces it accepted, so that a restart does not forget them."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)

    @property
    def path(self) -> Path:
        return self._path

    def load(self) -> tuple[float | None, list[tuple[float, str]]]:
        """``(horizon, [(ts, nonce), …])``.

        Raises:
            FileNotFoundError: no record yet.
            OSError: it cannot be read.
            ValueError: it is not a record (the message says what is wrong).
        """
        with self._path.open("rb") as f:
            data = f.read(MAX_NONCE_FILE_BYTES + 1)
        if len(data) > MAX_NONCE_FILE_BYTES:
            raise ValueError(f"over {MAX_NONCE_FILE_BYTES} bytes")
        try:
            record = json.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ValueError(f"not JSON ({str(exc)[:80]})") from None
        if not isinstance(record, dict) or record.get("version") != NONCE_FILE_VERSION:
            raise ValueError(f"not a version-{NONCE_FILE_VERSION} nonce record")
        horizon, nonces = record.get("horizon"), record.get("nonces")
        if horizon is not None and not is_finite_number(horizon):
            raise ValueError(f"horizon {horizon!r} is not a finite number")
        if not isinstance(nonces, list):
            raise ValueError("'nonces' is not a list")
        entries = []
        for item in nonces:
            if not isinstance(item, list) or len(item) != 2 or not is_finite_number(item[0]) or not is_nonce(item[1]):
                raise ValueError(f"entry {str(item)[:80]} is not [ts, 32-hex-digit nonce]")
            entries.append((float(item[0]), item[1]))
        return (None if horizon is None else float(horizon)), entries

    def save(self, horizon: float | None, entries: Sequence[tuple[float, str]]) -> None:
        """Replace the record, durably. Raises OSError (a full disk, a read-only directory)."""
        data = json.dumps({"version": NONCE_FILE_VERSION, "horizon": horizon,
                           "nonces": [[ts, nonce] for ts, nonce in entries]}, separators=(",", ":")).encode()
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # a file where the directory should be
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(self._path.parent)) from None
        write_atomically(self._path, data, mode=0o600)


__all__ = ["MAX_NONCE_FILE_BYTES", "NONCE_FILE_VERSION", "NonceFile"]
