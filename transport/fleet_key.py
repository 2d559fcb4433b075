"""The fleet key file: read it (with the checks a secret deserves) and make a new one.

    python -m edgefleet.transport.fleet_key --generate > fleet.key && chmod 600 fleet.key
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import secrets
from pathlib import Path

from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.signing import GENERATE_HINT, MIN_KEY_BYTES

log = logging.getLogger(__name__)

_HEX = re.compile(rb"[0-9a-fA-F]+")


def load_fleet_key(path: str | os.PathLike[str]) -> bytes:
    """Read the fleet key: 64+ hex digits (whitespace around them ignored) or 32+ raw bytes.

    A raw key is used byte for byte: stripping would change it for implementations that do not.

    Raises:
        ConfigError: the file is missing or unreadable, or the key is too short or odd hex.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
        world_readable = path.stat().st_mode & 0o004
    except OSError as exc:
        raise ConfigError(f"fleet key {path}: {exc.strerror}; {GENERATE_HINT}") from None
    if world_readable:
        log.warning("fleet key %s is readable by every user; run: chmod 600 %s", path, path)
    text = data.strip()
    if _HEX.fullmatch(text):
        if len(text) % 2:
            raise ConfigError(f"fleet key {path}: {len(text)} hex digits, an odd number; {GENERATE_HINT}")
        key = bytes.fromhex(text.decode("ascii"))
    else:
        key = data
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"fleet key {path}: {len(key)} bytes, need at least {MIN_KEY_BYTES}; {GENERATE_HINT}")
    return key


def generate_key_hex() -> str:
    """A new fleet key: 32 random bytes as 64 hex digits."""
    return secrets.token_hex(MIN_KEY_BYTES)


def main(argv: list[str] | None = None) -> int:
    """``python -m edgefleet.transport.fleet_key --generate``: print a new 64-hex-digit fleet key."""
    parser = argparse.ArgumentParser(prog="python -m edgefleet.transport.fleet_key",
                                     description="Fleet keys for signed control commands.")
    parser.add_argument("--generate", action="store_true", help="print a new fleet key (hex) on stdout")
    args = parser.parse_args(argv)
    if not args.generate:
        parser.error("nothing to do; pass --generate (e.g. python -m edgefleet.transport.fleet_key --generate > fleet.key)")
    print(generate_key_hex())
    return 0


__all__ = ["generate_key_hex", "load_fleet_key", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
