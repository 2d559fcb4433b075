"""Jinja filters for the mqtt_broker role: a Mosquitto password-file hash, computed on the controller, and a
board's Home Assistant discovery node_id."""

from __future__ import annotations

import base64
import binascii
import hashlib
import re

from ansible.errors import AnsibleFilterError

# mosquitto_passwd's defaults (Mosquitto 2.0): PBKDF2-HMAC-SHA512, 101 rounds, 12-byte salt. The
# passwords are 32 random characters, so more rounds would add nothing but connect latency.
ITERATIONS = 101
SALT_BYTES = 12


def mosquitto_passwd_hash(password: str, salt: str, iterations: int = ITERATIONS) -> str:
    """Return ``$7$<rounds>$<salt>$<hash>``, the form ``mosquitto_passwd`` writes after ``user:``.

    ``salt`` is 16 base64 characters (12 bytes, the length Mosquitto requires). It is kept on the
    controller beside the password, so the same password always gives the same line and a second
    run of the playbook changes nothing.
    """
    try:
        raw_salt = base64.b64decode(salt, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AnsibleFilterError(f"mosquitto_passwd_hash: the salt is not base64 ({exc})") from None
    if len(raw_salt) != SALT_BYTES:
        raise AnsibleFilterError(f"mosquitto_passwd_hash: the salt must be {SALT_BYTES} bytes (16 base64 characters), got {len(raw_salt)}")
    digest = hashlib.pbkdf2_hmac("sha512", str(password).encode(), raw_salt, int(iterations), 64)
    return f"$7${int(iterations)}${salt}${base64.b64encode(digest).decode()}"


def edgefleet_ha_node_id(board_id: str) -> str:
    """The Home Assistant discovery node_id the agent announces ``board_id`` under, as
    ``edgefleet.agent.home_assistant.node_id_for`` makes it (kept equal by a test): the id itself, or
    for an id holding a character a node_id may not (a '.'), the id made valid plus a short hash."""
    board_id = str(board_id)
    if re.fullmatch(r"[a-zA-Z0-9_-]+", board_id):
        return board_id
    digest = hashlib.sha256(board_id.encode()).hexdigest()[:6]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', board_id)}_{digest}"


class FilterModule:
    """Registers the filter with Ansible."""

    def filters(self) -> dict[str, object]:
        return {"mosquitto_passwd_hash": mosquitto_passwd_hash, "edgefleet_ha_node_id": edgefleet_ha_node_id}
