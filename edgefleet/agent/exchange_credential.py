"""What this board shows the exchange when it joins a job: its proof, or the token its command carried.

See ``protocol.exchange_auth``: a legacy HMAC fleet key proves the board with an HMAC, else its own
Ed25519 key (``security.board_key_file``) with a signature, over the job, the board and the
exchange certificate the signed command pins. The keys are read here, in the worker, when a job
starts: a missing or unreadable key fails the job at once with what to install.
"""

from __future__ import annotations

import logging

from edgefleet.protocol.errors import ConfigError, EdgeTrainError
from edgefleet.protocol.exchange_auth import HelloProver
from edgefleet.protocol.jobs import TrainCommand
from edgefleet.transport.fleet_key import load_board_key, load_command_keys

log = logging.getLogger(__name__)


def hello_credential(job: TrainCommand, *, board_key_file: str, fleet_key_file: str) -> tuple[str, bytes | None]:
    """(token, proof) for ``job``'s hello: the command's token when it carries one, else a proof of this board's key.

    Raises:
        EdgeTrainError: the coordinator expects a proof and this board has no key to make it with.
    """
    if job.token:
        return job.token, None
    try:
        if fleet_key_file:
            keys = load_command_keys(fleet_key_file)
            if keys.hmac_key is not None:
                return "", HelloProver("hmac", keys.hmac_key).prove(job.job_id, job.board_id, job.exchange_tls_sha256)
        if board_key_file:
            signer = load_board_key(board_key_file)
            return "", HelloProver("ed25519", signer.seed).prove(job.job_id, job.board_id, job.exchange_tls_sha256)
    except ConfigError as exc:
        raise EdgeTrainError(f"cannot prove this board to the exchange: {exc}") from None
    raise EdgeTrainError(f"the coordinator expects board {job.board_id} to prove itself with its own key, but "
                         "security.board_key_file is not set: make one (python -m edgefleet.transport.fleet_key --generate "
                         "--output board.key --public board.pub), set it in the agent's config and give board.pub to "
                         f"the coordinator as {job.board_id}.pub in its --board-keys directory")


__all__ = ["hello_credential"]
