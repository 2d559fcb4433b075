"""Who may join a job's exchange: a credential per board, made for the job, never readable on the broker.

A board proves it is itself with a key it already holds, over the job, its own id and the
fingerprint of the exchange's TLS certificate (the same certificate the signed train command
pins), sent inside that TLS connection:

- the legacy shared HMAC fleet key, when the fleet still uses one: an HMAC-SHA256 (the coordinator
  always holds that key);
- else its own Ed25519 key (``security.board_key_file``), whose public key the coordinator holds
  (``--board-keys``): an Ed25519 signature.

So nothing in the train command lets anyone else join, and the proof is good for this job and
this exchange only. A board the coordinator can check neither way (Ed25519 commands, but no
public key of the board on the coordinator) gets a token of its own in its command, as before:
anyone who reads that board's command on the broker could use it, which the coordinator says
once per job (``docs/security.md``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgpack

from edgefleet.protocol.signing import ed25519_sign, ed25519_verify

_CONTEXT = b"edgefleet-exchange-hello-v1\0"
HMAC_PROOF_BYTES, ED25519_PROOF_BYTES = 32, 64  # an HMAC-SHA256, an Ed25519 signature


def hello_message(job_id: str, board_id: str, tls_sha256: str) -> bytes:
    """What a board's proof covers: the job, the board and the exchange's certificate ("" without TLS)."""
    packed: bytes = msgpack.packb([job_id, board_id, tls_sha256.lower()], use_bin_type=True)
    return _CONTEXT + packed


@dataclass(frozen=True)
class HelloProver:
    """A board's side: makes the proof from the key it holds (``ed25519`` seed or legacy ``hmac`` key)."""

    algorithm: str          # "ed25519" or "hmac"
    secret: bytes = field(repr=False)

    def prove(self, job_id: str, board_id: str, tls_sha256: str) -> bytes:
        return self.prove_message(hello_message(job_id, board_id, tls_sha256))

    def prove_message(self, message: bytes) -> bytes:
        """The proof over ``message`` (a hello's, from this module or ``protocol.stage_auth``)."""
        if self.algorithm == "ed25519":
            return ed25519_sign(self.secret, message)
        return hmac.new(self.secret, message, hashlib.sha256).digest()


@dataclass
class HelloChecker:
    """The coordinator's side: which boards prove with a key and which were given a token, and the check.

    Args:
        board_keys: Each board's Ed25519 public key(s) (the ``--board-keys`` directory), or None.
        hmac_key: The legacy shared fleet key, when commands are signed with one.
        tls_sha256: The exchange certificate's fingerprint ("" when the exchange runs without TLS).
    """

    board_keys: Mapping[str, Sequence[bytes]] | None
    hmac_key: bytes | None = field(default=None, repr=False)
    tls_sha256: str = ""
    _tokens: dict[str, str] = field(default_factory=dict, repr=False)

    def proves_with_key(self, board_id: str) -> bool:
        """Whether ``board_id`` shows a proof (no token in its command)."""
        return bool(self.board_keys and self.board_keys.get(board_id)) or self.hmac_key is not None

    def token_for(self, board_id: str) -> str:
        """The token to put in ``board_id``'s command: "" for a board that proves with a key, else its own token."""
        if self.proves_with_key(board_id):
            return ""
        token = self._tokens.get(board_id)
        if token is None:
            token = self._tokens[board_id] = secrets.token_hex(16)
        return token

    @property
    def token_boards(self) -> list[str]:
        """Boards given a bearer token (readable by whoever reads their command on the broker)."""
        return sorted(self._tokens)

    def check(self, job_id: str, board_id: str, *, token: str, proof: bytes | None) -> bool:
        """Whether a hello naming ``job_id`` and ``board_id`` shows this board's credential for this job."""
        if self.proves_with_key(board_id):
            if proof is None:
                return False
            message = hello_message(job_id, board_id, self.tls_sha256)
            keys = self.board_keys.get(board_id) if self.board_keys else None
            if len(proof) == ED25519_PROOF_BYTES and keys:
                return ed25519_verify(list(keys), proof, message)
            if len(proof) == HMAC_PROOF_BYTES and self.hmac_key is not None:
                return hmac.compare_digest(proof, hmac.new(self.hmac_key, message, hashlib.sha256).digest())
            return False
        expected = self._tokens.get(board_id)
        return expected is not None and bool(token) and hmac.compare_digest(token.encode(), expected.encode())


__all__ = ["ED25519_PROOF_BYTES", "HMAC_PROOF_BYTES", "HelloChecker", "HelloProver", "hello_message"]
