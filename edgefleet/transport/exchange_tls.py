"""TLS on the gradient exchange: a certificate made for each job, pinned in the signed train command.

The coordinator makes a fresh key pair and self-signed certificate for every job
(:func:`make_job_certificate`); the train command, signed by the coordinator, carries the
certificate's SHA-256 fingerprint, and a board accepts the exchange's TLS connection only if the
certificate it is shown has that fingerprint (:func:`check_pinned`). No certificate authority,
no install step, nothing to expire between jobs: whoever cannot forge the coordinator's command
signature cannot stand in for the exchange, and a listener on the LAN sees only ciphertext.

The exchange server drives its sockets from an asyncio event loop with its own non-blocking
reads and writes; :class:`TlsPipe` puts TLS between those calls and the socket with memory BIOs,
offering the same ``recv_into``/``sendmsg``/``fileno`` calls, so the frame readers and writers of
``transport.exchange_io`` work on it unchanged. The board's side is a blocking ``ssl.SSLSocket``
(:func:`connect_tls`) whose ``recv_into`` also takes ``MSG_WAITALL`` and whose ``sendmsg`` sends
each segment in turn, as the board's frame code expects of a socket.

TLS 1.3 only; the coordinator sends no session tickets (every job has its own certificate).

Wake-ups: a reader of a plain socket wakes once per TCP segment at worst, and each wake-up is a
system call; over TLS each is also a trip through OpenSSL and Python that decrypts nothing until
a 16 KiB record is complete. So both sides set the socket's low-water mark (``SO_RCVLOWAT``) to
ciphertext that is sure to come: the rest of the record begun (the coordinator, which sees the
record headers go by) or of the frame being read less one record that OpenSSL may hold (a board
wakes a few records earlier still, to decrypt the bulk while the last records travel). A mark
never exceeds what the peer has committed to send, so no reader waits for bytes that are not
coming; a closed connection wakes it all the same. On a 100 Mbit/s link this took the
coordinator's CPU per 4.6 MB round of 3 boards from ~150 ms to ~45 ms (bench/exchange_tls.py).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import socket
import ssl
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from edgefleet.protocol.errors import ProtocolError

log = logging.getLogger(__name__)

TLS_RECORD_BYTES = 16 * 1024           # the largest TLS record's plaintext
_RECORD_HEADER_BYTES = 5               # a TLS record's type, version and length
_MAX_RECORD_CIPHERTEXT = _RECORD_HEADER_BYTES + TLS_RECORD_BYTES + 256  # the largest TLS 1.3 record on the wire
_ENCRYPT_BYTES = 256 * 1024            # plaintext encrypted per step of a send: the ciphertext kept in memory at once
_WAKE_EARLY_BYTES = 64 * 1024          # a board's reader wakes this long before a frame's end (see BoardTlsSocket.recv_into)
_RECV_BYTES = 256 * 1024               # ciphertext read from the socket at once
_RCVLOWAT_MAX = 1 << 20                # the largest low-water mark set (as transport.frame_io's RCVLOWAT_MAX)
_SO_RCVLOWAT: int | None = getattr(socket, "SO_RCVLOWAT", None)
_TLS_HANDSHAKE_RECORD = 0x16           # the first byte of a TLS client's first message
CERT_NAME = "edgefleet-exchange"


class TlsRefused(ProtocolError):
    """The TLS connection could not be set up: the peer is not who the signed command named, or does not speak TLS."""


@dataclass(frozen=True)
class JobCertificate:
    """A job's exchange certificate: PEM texts and the fingerprint the train command pins."""

    cert_pem: bytes
    key_pem: bytes = field(repr=False)
    sha256: str  # hex of the SHA-256 of the certificate's DER form

    def server_context(self) -> ssl.SSLContext:
        """A TLS 1.3 server context presenting this certificate (no session tickets)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.num_tickets = 0
        # load_cert_chain reads files: write them to a private folder for the moment it takes.
        with tempfile.TemporaryDirectory(prefix="edgefleet-tls-") as folder:
            cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
            for path, data in ((cert_path, self.cert_pem), (key_path, self.key_pem)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
            ctx.load_cert_chain(cert_path, key_path)
        return ctx


def make_job_certificate(job_id: str, *, days: int = 30) -> JobCertificate:
    """A new P-256 key and a self-signed certificate for one job's exchange."""
    # cryptography: only when a job certificate is made
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    return self_signed(ec.generate_private_key(ec.SECP256R1()), CERT_NAME, job_id[:64] or "job", days=days,
                       digest=hashes.SHA256())


def self_signed(key: Any, common_name: str, unit: str, *, days: int, digest: Any) -> JobCertificate:
    """A self-signed certificate of ``key`` (a ``cryptography`` private key; ``digest`` None for Ed25519), valid from
    an hour ago for ``days``, named ``common_name`` / ``unit``."""
    # cryptography: only when a certificate is made
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=days))
            .sign(key, digest))
    der = cert.public_bytes(serialization.Encoding.DER)
    return JobCertificate(cert_pem=cert.public_bytes(serialization.Encoding.PEM),
                          key_pem=key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()),
                          sha256=hashlib.sha256(der).hexdigest())


# --- the board's side: a blocking socket ----------------------------------------------------------------------

class BoardTlsSocket(ssl.SSLSocket):
    """An ``SSLSocket`` that takes the calls the board's frame code makes of a plain socket."""

    def recv_into(self, buffer: Any, nbytes: int | None = 0, flags: int = 0) -> int:
        """``MSG_WAITALL`` fills the buffer (or stops at the peer's close); other flags are refused as TLS does.

        While it fills, the socket wakes this reader only once the ciphertext of all but the last
        few records still missing has arrived (see the module's docstring), not once per TCP segment.
        """
        if not flags & socket.MSG_WAITALL:
            return super().recv_into(buffer, nbytes, flags)
        view = memoryview(buffer).cast("B")
        want = nbytes or view.nbytes
        got, lowat = 0, 1
        try:
            while got < want:
                if _SO_RCVLOWAT is not None:
                    # OpenSSL holds at most one record's ciphertext (no read-ahead): the rest is still to come.
                    # Waking _WAKE_EARLY_BYTES before the end, the bulk is decrypted while the last records travel.
                    owed = want - got - self.pending() - _MAX_RECORD_CIPHERTEXT - _WAKE_EARLY_BYTES
                    mark = min(max(owed, 1), _RCVLOWAT_MAX)
                    if mark != lowat:
                        lowat = self._set_lowat(mark)
                n = super().recv_into(view[got:want], 0, flags & ~socket.MSG_WAITALL)
                if n == 0:
                    break
                got += n
        finally:
            if lowat != 1:
                self._set_lowat(1)
        return got

    def _set_lowat(self, mark: int) -> int:
        """Set SO_RCVLOWAT; returns the mark in force (1 where it cannot be set)."""
        if _SO_RCVLOWAT is None:
            return 1
        try:
            super().setsockopt(socket.SOL_SOCKET, _SO_RCVLOWAT, mark)
        except OSError:
            return 1
        return mark

    # SSLSocket declares sendmsg as refused (NotImplementedError): this one is the board's gather-send.
    def sendmsg(self, buffers: Iterable[Any], ancdata: Iterable[Any] = (), flags: int = 0,  # type: ignore[override]
                address: Any = None) -> int:
        """Each segment in turn (TLS has no gather-write); returns the bytes sent: all of them, or it raises."""
        total = 0
        for segment in buffers:
            view = memoryview(segment)
            self.sendall(view)
            total += view.nbytes
        return total

    def setsockopt(self, level: int, option: int, value: Any, *rest: Any) -> None:
        # A low-water mark counts ciphertext in the kernel, but part of a record may already sit in
        # OpenSSL's buffer: a mark of the plaintext still missing could wait for bytes never coming.
        if level == socket.SOL_SOCKET and option == getattr(socket, "SO_RCVLOWAT", None):
            return
        super().setsockopt(level, option, value, *rest)


def client_context() -> ssl.SSLContext:
    """The board's TLS 1.3 context: the certificate is checked by its pinned fingerprint, not a CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # a self-signed certificate made for the job; check_pinned does the checking
    ctx.sslsocket_class = BoardTlsSocket
    return ctx


def connect_tls(sock: socket.socket, sha256: str) -> BoardTlsSocket:
    """TLS over a connected blocking socket, to the exchange whose certificate has fingerprint ``sha256``.

    Raises:
        TlsRefused: the handshake failed or the certificate is not the pinned one (an impostor).
    """
    try:
        tls = client_context().wrap_socket(sock, server_side=False, do_handshake_on_connect=True)
    except (ssl.SSLError, ConnectionError) as exc:
        sock.close()
        raise TlsRefused(f"the TLS handshake with the coordinator's exchange failed ({exc}); check that the coordinator "
                         "runs the same edgefleet version") from None
    assert isinstance(tls, BoardTlsSocket)
    try:
        check_pinned(tls.getpeercert(binary_form=True), sha256)
    except TlsRefused:
        tls.close()
        raise
    return tls


def check_pinned(der: bytes | None, sha256: str) -> None:
    """Raise :class:`TlsRefused` unless the certificate ``der`` has the fingerprint ``sha256`` (hex)."""
    seen = hashlib.sha256(der or b"").hexdigest()
    if not der or not hmac.compare_digest(seen, sha256.lower()):
        raise TlsRefused(f"the exchange presented certificate {seen[:16]}..., not the {sha256[:16]}... this job's signed "
                         "command names: something between this board and the coordinator is impersonating the exchange")


# --- the coordinator's side: a non-blocking socket driven by an event loop ----------------------------------------

class _RecordCounter:
    """Follows a TLS byte stream's record headers: how many bytes the record begun still owes.

    Fed every byte the peer sent, from the first. A stream of implausibly many tiny records (no
    peer of ours writes them; OpenSSL refuses them soon after) is not followed further: ``owed``
    is then 0, so no mark is set, and parsing never costs more than a few steps per KiB.
    """

    __slots__ = ("_header", "_left", "lost")

    def __init__(self) -> None:
        self._header = bytearray()  # the next record's header bytes seen so far
        self._left = 0              # bytes of the current record's body not seen yet
        self.lost = False

    def feed(self, data: memoryview) -> None:
        size, at = data.nbytes, 0
        budget = size // 1024 + 8  # record headers this chunk may begin
        while at < size and not self.lost:
            if self._left:
                take = min(self._left, size - at)
                self._left -= take
                at += take
                continue
            take = min(_RECORD_HEADER_BYTES - len(self._header), size - at)
            self._header += data[at:at + take]
            at += take
            if len(self._header) == _RECORD_HEADER_BYTES:
                self._left = int.from_bytes(self._header[3:5], "big")
                self._header.clear()
                budget -= 1
                self.lost = budget < 0

    @property
    def owed(self) -> int:
        """Bytes sure to follow: the rest of the record begun (0 between records, or once lost)."""
        if self.lost:
            return 0
        return self._left or (_RECORD_HEADER_BYTES - len(self._header) if self._header else 0)


class TlsPipe:
    """TLS over a non-blocking socket through memory BIOs, with the socket calls the exchange server makes.

    ``recv_into`` decrypts what has arrived and raises ``BlockingIOError`` only when neither
    OpenSSL nor the kernel holds a byte more: waiting for the socket to be readable is then right.
    :attr:`pending` says whether decrypted or undecrypted bytes wait in memory (a reader that
    stops between frames must look there, since no readiness will announce them).

    ``sendmsg`` encrypts and sends; ciphertext the socket could not take yet is held back and
    the plaintext it stands for is reported unsent, so the caller offers it again (as it would
    to a plain socket) once the socket is writable: those bytes are then skipped, not encrypted twice.

    ``records`` follows the record headers from the connection's first byte (:func:`accept_tls`
    feeds it the handshake): the socket's low-water mark is then the rest of the record begun,
    or, after a reader set ``SO_RCVLOWAT`` to the bytes of a frame it still misses, that much
    ciphertext less what is buffered and one record. Without it only the reader's mark counts.
    """

    def __init__(self, sock: socket.socket, obj: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO,
                 records: _RecordCounter | None = None) -> None:
        self.sock, self._obj, self._in, self._out = sock, obj, incoming, outgoing
        self._held = memoryview(b"")   # ciphertext the socket did not take yet
        self._held_plain = 0           # the plaintext bytes it stands for
        self._eof = False
        self._records = records
        self._chunk = memoryview(bytearray(_RECV_BYTES))  # ciphertext is read into it: no allocation per read
        self._announced = 0            # plaintext a reader said is on its way (its SO_RCVLOWAT), less what it got since
        self._lowat = 1                # the socket's SO_RCVLOWAT in force

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def gettimeout(self) -> float | None:
        return 0.0

    def setsockopt(self, level: int, option: int, value: Any, *rest: Any) -> None:
        if level == socket.SOL_SOCKET and option == _SO_RCVLOWAT:
            # The reader's mark counts plaintext it misses; the kernel's counts ciphertext: translated.
            self._announced = value if isinstance(value, int) and value > 1 else 0
            self._set_lowat()
            return
        self.sock.setsockopt(level, option, value, *rest)

    def _set_lowat(self) -> None:
        """Set the socket's low-water mark to the ciphertext sure to arrive (1 if none is)."""
        owed = self._records.owed if self._records is not None else 0
        if self._announced:
            owed = max(owed, self._announced - self._obj.pending() - self._in.pending - _MAX_RECORD_CIPHERTEXT)
        mark = min(max(owed, 1), _RCVLOWAT_MAX)
        if mark == self._lowat or _SO_RCVLOWAT is None:
            return
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, _SO_RCVLOWAT, mark)
        except OSError:  # the socket is gone: the next read says so
            return
        self._lowat = mark

    @property
    def pending(self) -> bool:
        return self._obj.pending() > 0 or self._in.pending > 0

    # reading
    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        view = memoryview(buffer).cast("B")
        want = nbytes or view.nbytes
        got = 0
        try:
            while got < want:
                try:
                    # With a buffer, SSLObject.read returns the byte count (typeshed says bytes).
                    n: int = self._obj.read(want - got, view[got:want])  # type: ignore[assignment]
                except ssl.SSLWantReadError:
                    if not self._fill():
                        if got:
                            return got
                        self._set_lowat()  # the caller now waits for the socket: wake it when a record is complete
                        raise BlockingIOError("no TLS record is complete yet") from None
                    continue
                except ssl.SSLZeroReturnError:
                    return got
                except ssl.SSLEOFError:
                    if got:
                        return got
                    raise ConnectionResetError("the peer closed the connection in the middle of a TLS record") from None
                except ssl.SSLError as exc:
                    raise ConnectionResetError(f"TLS failed: {exc.reason or exc}") from None
                if n == 0:
                    return got
                got += n
            return got
        finally:
            if self._announced:
                self._announced = max(0, self._announced - got)

    def _fill(self) -> bool:
        """Move what the kernel holds into OpenSSL: True if anything came (or the peer closed)."""
        if self._eof:
            return False
        try:
            n = self.sock.recv_into(self._chunk)
        except (BlockingIOError, InterruptedError):
            return False
        if not n:
            self._eof = True
            self._in.write_eof()
            return True
        data = self._chunk[:n]
        self._in.write(data)
        if self._records is not None:
            self._records.feed(data)
        if self._lowat != 1:  # these bytes no longer count towards the mark: it must not exceed what is still owed
            self._set_lowat()
        return True

    # writing
    def sendmsg(self, buffers: Iterable[Any], *args: Any) -> int:
        consumed = 0
        if self._held:
            self._flush()
            if self._held:
                raise BlockingIOError("the socket has not taken the last TLS records yet")
            consumed, self._held_plain = self._held_plain, 0
        skip = consumed
        for segment in buffers:
            view = memoryview(segment).cast("B")
            if skip >= view.nbytes:
                skip -= view.nbytes
                continue
            view, skip = view[skip:], 0
            while view.nbytes:
                chunk = view[:_ENCRYPT_BYTES]
                self._obj.write(chunk)
                self._held = memoryview(self._out.read())
                self._flush()
                if self._held:  # the socket is full: this chunk counts once its ciphertext has gone
                    self._held_plain = chunk.nbytes
                    return consumed
                consumed += chunk.nbytes
                view = view[chunk.nbytes:]
        return consumed

    def send(self, data: Any, flags: int = 0) -> int:
        return self.sendmsg([data])

    def _flush(self) -> None:
        while self._held:
            try:
                sent = self.sock.send(self._held)
            except (BlockingIOError, InterruptedError):
                return
            self._held = self._held[sent:]

    @property
    def unsent(self) -> int:
        """Ciphertext bytes held back: a sender is done only when this is 0."""
        return self._held.nbytes


def plaintext_first_byte(first: bytes) -> bool:
    """Whether a connection's first byte shows a peer that does not speak TLS (a board with the exchange's TLS off)."""
    return bool(first) and first[0] != _TLS_HANDSHAKE_RECORD


async def accept_tls(loop: Any, sock: socket.socket, ctx: ssl.SSLContext) -> TlsPipe:
    """The server's TLS handshake on an accepted non-blocking socket (bound it with a timeout).

    Raises:
        TlsRefused: the peer does not speak TLS, or the handshake failed.
        ConnectionError: the peer closed the connection.
    """
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_side=True)
    records = _RecordCounter()
    first = True
    while True:
        try:
            obj.do_handshake()
            break
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLError as exc:
            raise TlsRefused(f"TLS handshake failed ({exc.reason or exc})") from None
        pending = outgoing.read()
        if pending:
            await loop.sock_sendall(sock, pending)
        data = await loop.sock_recv(sock, _RECV_BYTES)
        if not data:
            raise ConnectionResetError("the peer closed the connection during the TLS handshake")
        if first and plaintext_first_byte(data):
            raise TlsRefused("the peer does not speak TLS (a board whose edgefleet predates the exchange's TLS, or "
                             "a client that is not a board)")
        first = False
        incoming.write(data)
        records.feed(memoryview(data))
    pending = outgoing.read()
    if pending:
        await loop.sock_sendall(sock, pending)
    return TlsPipe(sock, obj, incoming, outgoing, records)


__all__ = [
    "CERT_NAME",
    "BoardTlsSocket",
    "JobCertificate",
    "TlsPipe",
    "TlsRefused",
    "accept_tls",
    "check_pinned",
    "client_context",
    "connect_tls",
    "make_job_certificate",
    "plaintext_first_byte",
    "self_signed",
]
