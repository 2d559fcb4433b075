"""A board's per-step round trip in the fixed layouts, with nothing made per step.

Every training step a board sends the same gradient array (changed in place) and receives a
result of the same size. :class:`StepChannel` prepares both ends once: the gradient frame is one
``struct.pack`` of its numbers followed by the array's own memory in one ``sendmsg``; the
result is read into one buffer kept for the job and checked against the ``avg`` layout, and its
tensor is the same read-only array over that buffer at every step. Anything else (a stop, a
result carrying a re-split or learning rates, bytes split oddly by TCP) is handed back to the
general receiver, so the channel is only ever a shortcut for the frames of
``protocol.hot_frames``, byte for byte.
"""

from __future__ import annotations

import logging
import socket
import struct
from typing import Any

import numpy as np

from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.framing import FRAME_HEADER, MAX_FRAME_BYTES
from edgefleet.protocol.hot_frames import HotFrame
from edgefleet.protocol.wire_dtype import numpy_dtype
from edgefleet.transport.frame_io import ConnectionClosed, FrameReceiver, send_segments

log = logging.getLogger(__name__)


class StepChannel:
    """Sends one array as grad frames and receives avg frames of its size into one kept buffer.

    Args:
        sock: the exchange connection (blocking, OS timeouts set).
        receiver: the connection's general receiver: bytes that are not a fixed-layout result go back to it.
        grad: the array sent every step (its memory is read at each send, never copied).
        grad_layout, avg_layout: the fixed layouts of the job's wire dtype.
        elements: the result's length (the gradient's).
    """

    def __init__(self, sock: socket.socket, receiver: FrameReceiver, grad: np.ndarray, *, grad_layout: HotFrame,
                 avg_layout: HotFrame, elements: int) -> None:
        self._sock, self._receiver, self.grad = sock, receiver, grad
        self._writer = grad_layout.header_writer(grad.size)
        self._data = grad.reshape(-1).view(np.uint8).data  # the array's own memory, as protocol.codec describes it
        self.avg_layout = avg_layout
        self._payload_bytes = avg_layout.prefix_bytes + elements * avg_layout.itemsize
        if self._payload_bytes > MAX_FRAME_BYTES:
            raise ValueError(f"a result of {elements} values is larger than a frame may be")
        self._frame_bytes = FRAME_HEADER.size + self._payload_bytes
        self._buffer = bytearray(self._frame_bytes)
        self._view = memoryview(self._buffer)
        offset = FRAME_HEADER.size + avg_layout.prefix_bytes  # the layout aligns it to FRAME_ALIGN in the payload
        self.array: np.ndarray = np.frombuffer(self._view[offset:].toreadonly(), dtype=numpy_dtype(avg_layout.dtype))

    def send(self, step: int, n: int, loss: float | None, compute_s: float) -> bool:
        """Send the gradient for ``step``; False (nothing sent) if these numbers do not fit the layout.

        Raises:
            OSError: the socket failed (``TimeoutError``/``BlockingIOError`` when its send timeout ran out).
        """
        try:
            header = self._writer.pack(step, n, loss, compute_s)
        except (struct.error, TypeError):  # a loss of None, a step beyond 32 bits: the general encoder
            return False
        send_segments(self._sock, (header, self._data))
        return True

    def receive(self) -> tuple[int, int, int] | dict[str, Any] | None:
        """Receive the answer to a gradient.

        Returns:
            (step, n, boards) of a fixed-layout result, whose tensor is now :attr:`array`; a decoded
            frame (a general one, its bins views into this channel's buffer); or None when the
            answer is not the usual size or began in bytes the general receiver holds: read it with
            the general receiver, which holds the bytes read so far.

        Raises:
            ConnectionClosed: the coordinator closed the connection.
            DecodeError: the frame is truncated.
            OSError: the socket failed (``TimeoutError``/``BlockingIOError`` when its receive timeout ran out).
        """
        if self._receiver.holds_bytes:  # the next frame began in what the general receiver read
            return None
        view = self._view
        got = self._sock.recv_into(view)
        if got == 0:
            raise ConnectionClosed("the peer closed the connection")
        if got < FRAME_HEADER.size or FRAME_HEADER.unpack_from(view)[0] != self._payload_bytes:
            self._receiver.unread(view[:got].tobytes())  # a stop, a result with a split, or a header cut short
            return None
        while got < self._frame_bytes:
            more = self._sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
            if more == 0:
                raise DecodeError(f"truncated frame: {got - FRAME_HEADER.size} of {self._payload_bytes} bytes "
                                  "before the peer closed")
            got += more
        numbers = self.avg_layout.numbers_in(self._buffer, FRAME_HEADER.size, self._payload_bytes)
        if numbers is None:  # the usual size, another layout: decode it in general
            return self.avg_layout.decode_any_array(view[FRAME_HEADER.size:])
        step, n, boards = numbers
        return step, n, boards


__all__ = ["StepChannel"]
