"""Key files: read them (with the checks a secret deserves) and make new ones.

A key file says what it holds, one key a line (``#`` starts a comment)::

    ed25519-private <64 hex digits>   a private key: the coordinator's (it signs commands: --fleet-key),
                                      or a board's own (it signs the board's job events: security.board_key_file)
    ed25519-public <64 hex digits>    a public key: what a board verifies commands with (its
                                      security.fleet_key_file; one line per key, several while rotating),
                                      and <board_id>.pub in the coordinator's --board-keys directory

A file of hex digits alone (64 or more), or of 32+ raw bytes, is a legacy shared HMAC fleet key: it
still works on both sides, with a warning, since any board holding it can command the whole fleet.

    python -m edgefleet.transport.fleet_key --generate --output fleet.key                  # the coordinator's
    python -m edgefleet.transport.fleet_key --public fleet.key > fleet.pub                 # for every board
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.signing import (
    ED25519_ALGORITHM,
    GENERATE_HINT,
    MAX_PUBLIC_KEYS,
    MIN_KEY_BYTES,
    PUBLIC_HINT,
    CommandKeys,
    CoordinatorKeys,
    EventSigner,
    ed25519_public_key,
    generate_ed25519_seed,
    key_id,
)
from edgefleet.protocol.topics import valid_board_id

log = logging.getLogger(__name__)

HMAC = "hmac"
PRIVATE = "ed25519-private"
PUBLIC = "ed25519-public"
BOARD_KEY_SUFFIX = ".pub"
_HEX = re.compile(rb"[0-9a-fA-F]+")
_KEY_HEX = re.compile(r"[0-9a-fA-F]{64}")
_LEGACY_SWITCH = ("switch to Ed25519: python -m edgefleet.transport.fleet_key --generate > fleet.key on the coordinator "
                  f"(its --fleet-key), then {PUBLIC_HINT} and install fleet.pub on every board as security.fleet_key_file")
_warned: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class KeyFile:
    """What a key file holds: ``kind`` is :data:`HMAC`, :data:`PRIVATE` or :data:`PUBLIC`."""

    path: Path
    kind: str
    secret: bytes = b""                   # the legacy HMAC key, or the Ed25519 private key's seed
    public_keys: tuple[bytes, ...] = ()   # the ed25519-public lines


def _warn_once(what: str, path: Path, message: str) -> None:
    if (what, str(path)) not in _warned:
        _warned.add((what, str(path)))
        log.warning("%s", message)


def _parse_lines(path: Path, text: str) -> KeyFile | None:
    """The Ed25519 format, or None if the file is not in it (a legacy key)."""
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if words:
            entries.append((number, words))
    if not any(words[0].lower().startswith("ed25519-") for _, words in entries):
        return None
    keys: dict[str, list[bytes]] = {PRIVATE: [], PUBLIC: []}
    for number, words in entries:
        if len(words) != 2 or words[0] not in keys or not _KEY_HEX.fullmatch(words[1]):
            raise ConfigError(f"key file {path}, line {number}: expected '{PRIVATE} <64 hex digits>' or "
                              f"'{PUBLIC} <64 hex digits>', got {' '.join(words)[:40]!r}...; {GENERATE_HINT}")
        keys[words[0]].append(bytes.fromhex(words[1]))
    private, public = keys[PRIVATE], keys[PUBLIC]
    if private and public:
        raise ConfigError(f"key file {path}: holds both {PRIVATE} and {PUBLIC} lines; a file holds one private key "
                          f"(the coordinator's, or a board's own) or public keys only ({PUBLIC_HINT})")
    if len(private) > 1:
        raise ConfigError(f"key file {path}: {len(private)} {PRIVATE} lines; a private key file holds exactly one")
    if len(public) > MAX_PUBLIC_KEYS:
        raise ConfigError(f"key file {path}: {len(public)} {PUBLIC} lines; at most {MAX_PUBLIC_KEYS} (remove retired keys)")
    if private:
        return KeyFile(path, PRIVATE, secret=private[0])
    return KeyFile(path, PUBLIC, public_keys=tuple(dict.fromkeys(public)))


def read_key_file(path: str | os.PathLike[str]) -> KeyFile:
    """Read any key file: Ed25519 lines, or a legacy key (64+ hex digits, whitespace around them
    ignored, or 32+ raw bytes, used byte for byte: stripping would change it for implementations
    that do not). A secret readable by every user is loaded with a warning.

    Raises:
        ConfigError: the file is missing or unreadable, or malformed (naming the line), or the
            legacy key is too short or odd hex.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
        world_readable = path.stat().st_mode & 0o004
    except OSError as exc:
        raise ConfigError(f"fleet key {path}: {exc.strerror}; {GENERATE_HINT}") from None
    text = data.strip()
    parsed = None
    if not _HEX.fullmatch(text):
        try:
            parsed = _parse_lines(path, data.decode("utf-8"))
        except UnicodeDecodeError:
            parsed = None
    if parsed is None:  # legacy: a shared HMAC key
        if _HEX.fullmatch(text):
            if len(text) % 2:
                raise ConfigError(f"fleet key {path}: {len(text)} hex digits, an odd number; {GENERATE_HINT}")
            key = bytes.fromhex(text.decode("ascii"))
        else:
            key = data
        if len(key) < MIN_KEY_BYTES:
            raise ConfigError(f"fleet key {path}: {len(key)} bytes, need at least {MIN_KEY_BYTES}; {GENERATE_HINT}")
        parsed = KeyFile(path, HMAC, secret=key)
    if world_readable and parsed.kind != PUBLIC:
        _warn_once("readable", path, f"fleet key {path} is readable by every user; run: chmod 600 {path}")
    return parsed


def load_fleet_key(path: str | os.PathLike[str]) -> bytes:
    """The coordinator's key that signs commands, as ``fleet_key`` bytes for ``sign_command``.

    An ``ed25519-private`` file gives :meth:`CoordinatorKeys.to_bytes`; a legacy file its HMAC key
    as it is (with one warning per process: any board holding it can command the fleet).

    Raises:
        ConfigError: as :func:`read_key_file`, or the file holds public keys only.
    """
    key = read_key_file(path)
    if key.kind == PUBLIC:
        raise ConfigError(f"fleet key {key.path}: holds public keys only ({PUBLIC}), which is what boards verify "
                          f"commands with; the coordinator signs with the private key file ({PRIVATE}) they were made "
                          "from: give that to --fleet-key or [security] fleet_key_file")
    if key.kind == HMAC:
        _warn_once("coordinator", key.path,
                   f"fleet key {key.path} is a shared HMAC secret (legacy): every board holds it, so any one stolen "
                   f"board can command the whole fleet; {_LEGACY_SWITCH}")
        return key.secret
    return CoordinatorKeys(ED25519_ALGORITHM, key.secret).to_bytes()


def load_command_keys(path: str | os.PathLike[str]) -> CommandKeys:
    """What a board verifies commands with (its ``security.fleet_key_file``).

    ``ed25519-public`` lines are what a board should hold. A legacy HMAC key still works, with a
    warning. A private key works too (its public key is derived), with a warning that a board
    should hold only the public key.

    Raises:
        ConfigError: as :func:`read_key_file`.
    """
    key = read_key_file(path)
    if key.kind == HMAC:
        _warn_once("board", key.path,
                   f"security.fleet_key_file {key.path} is a shared HMAC fleet key (legacy): anyone who takes this "
                   f"board, or any other, can command every board of the fleet with it; {_LEGACY_SWITCH}")
        return CommandKeys(hmac_key=key.secret, source=str(key.path))
    if key.kind == PRIVATE:
        public = ed25519_public_key(key.secret)
        _warn_once("board-private", key.path,
                   f"security.fleet_key_file {key.path} holds a private key ({PRIVATE}): this board verifies commands "
                   f"with its public key (id {key_id(public)}), but anyone who takes it can sign commands for the whole "
                   f"fleet. A board should hold only the public key: python -m edgefleet.transport.fleet_key --public "
                   f"{key.path} > fleet.pub, install fleet.pub instead and delete the private key from the board")
        return CommandKeys(public_keys=(public,), source=str(key.path))
    return CommandKeys(public_keys=key.public_keys, source=str(key.path))


def load_board_key(path: str | os.PathLike[str]) -> EventSigner:
    """The board's own key that signs its job events (``security.board_key_file``).

    Raises:
        ConfigError: as :func:`read_key_file`, or the file is not an ``ed25519-private`` key.
    """
    key = read_key_file(path)
    if key.kind != PRIVATE:
        held = "public keys only" if key.kind == PUBLIC else "a shared HMAC fleet key"
        raise ConfigError(f"security.board_key_file {key.path}: holds {held}; it must hold this board's own private key "
                          f"({PRIVATE}): make one with python -m edgefleet.transport.fleet_key --generate --output "
                          f"{key.path} (the Ansible role does at install)")
    return EventSigner(key.secret)


def load_board_keys(directory: str | os.PathLike[str]) -> dict[str, tuple[bytes, ...]]:
    """The boards' public keys from a directory of ``<board_id>.pub`` files (``--board-keys``).

    Raises:
        ConfigError: the directory is missing or holds no key, a file name is not a board id, or a
            file does not hold ``ed25519-public`` lines.
    """
    directory = Path(directory)
    try:
        files = sorted(p for p in directory.iterdir() if p.name.endswith(BOARD_KEY_SUFFIX))
    except OSError as exc:
        raise ConfigError(f"--board-keys {directory}: {exc.strerror}; give the directory of <board_id>.pub files "
                          "(the Ansible role fetches them into credentials/board-keys/)") from None
    keys: dict[str, tuple[bytes, ...]] = {}
    for file in files:
        board = file.name[:-len(BOARD_KEY_SUFFIX)]
        if not valid_board_id(board):
            raise ConfigError(f"--board-keys {directory}: {file.name} is not named <board_id>.pub with a valid board id")
        key = read_key_file(file)
        if key.kind != PUBLIC:
            raise ConfigError(f"--board-keys {directory}: {file.name} must hold the board's public key ({PUBLIC} line); "
                              f"it holds {'a private key: delete it here' if key.kind == PRIVATE else 'a legacy HMAC key'} "
                              f"and write python -m edgefleet.transport.fleet_key --public BOARD_KEY > {file.name}")
        keys[board] = key.public_keys
    if not keys:
        raise ConfigError(f"--board-keys {directory}: no <board_id>.pub file in it; the Ansible role fetches each board's "
                          "public key into credentials/board-keys/")
    return keys


def add_board_keys(fleet_key: bytes, directory: str | os.PathLike[str]) -> bytes:
    """``fleet_key`` (as :func:`load_fleet_key` returns it) with the boards' public keys from ``directory``,
    so that the coordinator checks every job event against its board's key. Raises ConfigError."""
    keys = load_board_keys(directory)
    return CoordinatorKeys.from_bytes(fleet_key).with_board_keys(keys, str(directory)).to_bytes()


def generate_key_hex() -> str:
    """A new legacy fleet key (a shared HMAC secret): 32 random bytes as 64 hex digits."""
    return secrets.token_hex(MIN_KEY_BYTES)


def private_key_text(seed: bytes | None = None) -> str:
    """A new Ed25519 private key file (or the one of ``seed``)."""
    seed = generate_ed25519_seed() if seed is None else seed
    return (f"# edgefleet Ed25519 private key, made {time.strftime('%Y-%m-%d')}: keep it secret (chmod 600).\n"
            "# Its public key, for the boards: python -m edgefleet.transport.fleet_key --public THIS_FILE\n"
            f"{PRIVATE} {seed.hex()}\n")


def public_key_text(path: str | os.PathLike[str]) -> str:
    """The ``ed25519-public`` line(s) of a key file, private or public. Raises ConfigError for a legacy key."""
    key = read_key_file(path)
    if key.kind == HMAC:
        raise ConfigError(f"{key.path} is a shared HMAC fleet key (legacy): it has no public key. Make an Ed25519 key "
                          "with: python -m edgefleet.transport.fleet_key --generate > fleet.key")
    publics = key.public_keys if key.kind == PUBLIC else (ed25519_public_key(key.secret),)
    return "".join(f"{PUBLIC} {public.hex()}\n" for public in publics)


def write_new_key(path: Path, text: str) -> None:
    """Create ``path`` holding ``text``, readable by its owner only. Raises ConfigError if it exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} exists; keep it, or delete it first to make a new key (whoever holds its public "
                          "key must then get the new one)") from None
    except OSError as exc:
        raise ConfigError(f"cannot create {path}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def main(argv: list[str] | None = None) -> int:
    """``python -m edgefleet.transport.fleet_key``: make key files and print public keys."""
    parser = argparse.ArgumentParser(
        prog="python -m edgefleet.transport.fleet_key", description="Key files for signed commands and signed job events.",
        epilog="examples:\n"
               "  python -m edgefleet.transport.fleet_key --generate --output fleet.key                  # the coordinator's\n"
               "  python -m edgefleet.transport.fleet_key --public fleet.key > fleet.pub                 # for every board\n"
               "  python -m edgefleet.transport.fleet_key --generate --output /etc/edge-agent/board.key  # a board's own\n"
               "  python -m edgefleet.transport.fleet_key --public /etc/edge-agent/board.key > pi-1.pub  # for --board-keys",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generate", action="store_true", help="make a new Ed25519 private key file (on stdout, or --output)")
    parser.add_argument("--legacy-hmac", action="store_true",
                        help="with --generate: a shared HMAC fleet key (64 hex digits) instead, for boards that predate "
                             "Ed25519; any board holding it can command the fleet")
    parser.add_argument("--output", type=Path, metavar="FILE", help="with --generate: create FILE (mode 600; never overwritten)")
    parser.add_argument("--public", type=Path, metavar="FILE", help="print the public key(s) of a key file, as ed25519-public lines")
    args = parser.parse_args(argv)
    if args.generate == (args.public is not None):
        parser.error("pass --generate or --public FILE (e.g. python -m edgefleet.transport.fleet_key --generate > fleet.key)")
    if (args.legacy_hmac or args.output) and not args.generate:
        parser.error("--legacy-hmac and --output go with --generate")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s", stream=sys.stderr)
    try:
        if args.public is not None:
            sys.stdout.write(public_key_text(args.public))
            return 0
        text = generate_key_hex() + "\n" if args.legacy_hmac else private_key_text()
        if args.output is None:
            sys.stdout.write(text)
        else:
            write_new_key(args.output, text)
        return 0
    except ConfigError as exc:
        print(f"fleet_key: {exc}", file=sys.stderr)
        return 1


__all__ = ["BOARD_KEY_SUFFIX", "HMAC", "PRIVATE", "PUBLIC", "KeyFile", "add_board_keys", "generate_key_hex",
           "load_board_key", "load_board_keys", "load_command_keys", "load_fleet_key", "main", "private_key_text",
           "public_key_text", "read_key_file", "write_new_key"]

if __name__ == "__main__":
    raise SystemExit(main())

