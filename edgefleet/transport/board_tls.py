"""TLS between boards (pipeline stage links): a board's certificate is made from the key it already holds.

The gradient exchange's certificate is made by the coordinator for each job and pinned by its
fingerprint in the signed command (``transport.exchange_tls``). A stage host is a board, and the
coordinator cannot make its certificate without handing it a private key over the broker. So a
stage host makes its own, self-signed with its own Ed25519 key (``security.board_key_file``, the
key its exchange hellos already prove), when its job starts; its neighbours check the certificate's
public key against that board's public key, which the coordinator's signed command lists (from
``--board-keys``). Nothing new is secret, nothing is sent in the clear, and whoever does not hold
the board's key cannot stand in for its stage.
"""

from __future__ import annotations

import hmac
import logging
import socket

from edgefleet.transport.exchange_tls import BoardTlsSocket, JobCertificate, TlsRefused, client_context, self_signed

log = logging.getLogger(__name__)

CERT_NAME = "edgefleet-stage-host"


def board_certificate(seed: bytes, board_id: str, *, days: int = 30) -> JobCertificate:
    """A self-signed certificate for this board's stage host, with the board's own Ed25519 key (``seed``)."""
    # cryptography: only when a stage host starts
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return self_signed(Ed25519PrivateKey.from_private_bytes(seed), CERT_NAME, board_id[:64] or "board", days=days,
                       digest=None)


def certificate_key(der: bytes | None) -> bytes:
    """The raw Ed25519 public key of certificate ``der`` (b"": none, or not Ed25519)."""
    # cryptography: only when a stage link is checked
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if not der:
        return b""
    try:
        public = x509.load_der_x509_certificate(der).public_key()
    except ValueError:
        return b""
    if not isinstance(public, Ed25519PublicKey):
        return b""
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def connect_board_tls(sock: socket.socket, public_key: bytes, board_id: str) -> BoardTlsSocket:
    """TLS over a connected blocking socket, to the stage host of ``board_id`` whose Ed25519 key is ``public_key``.

    Raises:
        TlsRefused: the handshake failed, or the certificate is not made with that board's key (an impostor).
    """
    try:
        tls = client_context().wrap_socket(sock, server_side=False, do_handshake_on_connect=True)
    except (OSError, ValueError) as exc:
        sock.close()
        raise TlsRefused(f"the TLS handshake with board {board_id}'s stage host failed ({exc}); check that it runs "
                         "the same edgefleet version") from None
    assert isinstance(tls, BoardTlsSocket)
    seen = certificate_key(tls.getpeercert(binary_form=True))
    if not seen or not hmac.compare_digest(seen, public_key):
        tls.close()
        raise TlsRefused(f"the stage host that answered is not board {board_id}: its certificate is not made with that "
                         "board's key (something on the network is impersonating it)")
    return tls


__all__ = ["CERT_NAME", "board_certificate", "certificate_key", "connect_board_tls"]
