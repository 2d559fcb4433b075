"""Who may open a stage link: the pipeline's neighbours prove they are the boards the signed plan names.

A stage host accepts a stream (``protocol.stage_frames``) only from the board the plan puts at the
neighbouring stage, proving it holds that board's key over the job, itself, its stage, the stream
and the receiver's TLS certificate fingerprint: a proof is good for one stream to one host of one
job, so a recorded hello opens nothing else. The key is the one the gradient exchange's hello uses
(``protocol.exchange_auth``): the board's Ed25519 key, checked against its public key, or the
legacy shared HMAC fleet key. A pipelined job needs one of them on every stage host: bearer tokens
in the command would let anyone who reads a command on the broker feed a stage.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgpack

from edgefleet.protocol.exchange_auth import ED25519_PROOF_BYTES, HMAC_PROOF_BYTES, HelloProver
from edgefleet.protocol.signing import ed25519_verify

_CONTEXT = b"edgefleet-stage-hello-v1\0"


def stage_hello_message(job_id: str, board_id: str, stage: int, stream: str, receiver_sha256: str) -> bytes:
    """What a stage hello's proof covers."""
    packed: bytes = msgpack.packb([job_id, board_id, stage, stream, receiver_sha256.lower()], use_bin_type=True)
    return _CONTEXT + packed


@dataclass(frozen=True)
class StageCredentials:
    """A stage host's keys: its own (to prove) and its neighbours' (to check).

    Args:
        prover: this board's key (``HelloProver``: ``ed25519`` seed or the legacy ``hmac`` fleet key).
        board_keys: each board's Ed25519 public key(s), as the signed plan lists them.
        hmac_key: the legacy shared fleet key, when the fleet still uses one.
    """

    prover: HelloProver
    board_keys: Mapping[str, Sequence[bytes]] = field(default_factory=dict)
    hmac_key: bytes | None = field(default=None, repr=False)

    def prove(self, job_id: str, board_id: str, stage: int, stream: str, receiver_sha256: str) -> bytes:
        message = stage_hello_message(job_id, board_id, stage, stream, receiver_sha256)
        return self.prover.prove_message(message)

    def check(self, job_id: str, board_id: str, stage: int, stream: str, receiver_sha256: str, proof: bytes) -> bool:
        """Whether ``proof`` is ``board_id``'s over this stream of this job to the receiver with ``receiver_sha256``."""
        message = stage_hello_message(job_id, board_id, stage, stream, receiver_sha256)
        keys = self.board_keys.get(board_id)
        if len(proof) == ED25519_PROOF_BYTES and keys:
            return ed25519_verify(list(keys), proof, message)
        if len(proof) == HMAC_PROOF_BYTES and self.hmac_key is not None:
            return hmac.compare_digest(proof, hmac.new(self.hmac_key, message, hashlib.sha256).digest())
        return False


__all__ = ["StageCredentials", "stage_hello_message"]
