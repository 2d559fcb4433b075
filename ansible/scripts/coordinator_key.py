"""The coordinator's command-signing key, kept on the Ansible controller: made once, then read back.

ansible/site.yml's first play runs this with the controller's own Python (``ansible_playbook_python``,
which has ``cryptography``: ansible-core depends on it), so that edgefleet need not be installed on
the controller. It makes KEY_FILE the first time (an ``ed25519-private <64 hex digits>`` key file as
``python -m edgefleet.transport.fleet_key --generate`` writes it, mode 0600 in a 0700 directory, never
overwritten) and prints, as one JSON object, whether it made it and the public key line the boards
verify commands with. The private key is never printed.

    python3 ansible/scripts/coordinator_key.py credentials/coordinator.key
    {"made": false, "public": "ed25519-public 3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4f0c3"}
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
import time
from pathlib import Path

PRIVATE = "ed25519-private"
PUBLIC = "ed25519-public"
_KEY_LINE = re.compile(rf"{PRIVATE}\s+([0-9a-fA-F]{{64}})")


class KeyFileError(Exception):
    """KEY_FILE cannot be used; the message says why and what to do."""


def make_key_file(path: Path) -> bool:
    """Create ``path`` with a new private key unless it exists; True if it was made."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    text = (f"# edgefleet coordinator's command-signing key, made by ansible/site.yml {time.strftime('%Y-%m-%d')}.\n"
            "# Keep it secret: it can command every board. The playbook installs it as /etc/edge-coordinator/fleet.key\n"
            "# and its public key on every board (/etc/edge-agent/fleet.pub).\n"
            f"{PRIVATE} {secrets.token_hex(32)}\n")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return False
    except OSError as exc:
        raise KeyFileError(f"cannot create {path}: {exc.strerror}; check edgefleet_credentials_dir") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return True


def read_seed(path: Path) -> bytes:
    """The private key's 32-byte seed: the file's one ``ed25519-private`` line (``#`` comments aside)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    match = _KEY_LINE.fullmatch(lines[0]) if len(lines) == 1 else None
    if match is None:
        raise KeyFileError(f"{path} is not the coordinator's key: it should hold one line '{PRIVATE} <64 hex digits>'. "
                           "Move it away and run the playbook again to make a new one (boards and coordinator then switch "
                           "to it together)")
    return bytes.fromhex(match[1])


def public_line(seed: bytes) -> str:
    """``ed25519-public <64 hex digits>`` for the private key ``seed``."""
    try:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
    except ImportError:
        raise KeyFileError(f"{sys.executable} has no 'cryptography' package (ansible-core needs it): "
                           "reinstall Ansible, e.g. pip install 'ansible>=12,<13'") from None
    public = Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return f"{PUBLIC} {public.hex()}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: coordinator_key.py KEY_FILE", file=sys.stderr)
        return 2
    path = Path(argv[0])
    try:
        made = make_key_file(path)
        print(json.dumps({"made": made, "public": public_line(read_seed(path))}))
    except KeyFileError as exc:
        print(f"coordinator key: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
