"""Overlap (``--overlap``): a board's gradient frame sent in buckets while backward still runs.

Backward produces gradients from the last layers to the first, and in overlap mode the job's
vector holds them in that order (``workloads.params.gradient_order``). A post-accumulate-grad hook
on each parameter marks it ready; whenever the ready parameters form a prefix of the vector at
least one bucket longer than what was sent, their gradients are copied (and cast for a half
wire) into the send buffer and that byte range goes to a sender thread, which writes it to the
socket while backward goes on. At the optimizer step the rest (the parameters left, the float
buffers) and the frame's last entry (``compute_s``) follow: the coordinator reads one ordinary
grad frame (``protocol.exchange_frames.Grad.stream_head``) whose bytes came over a longer time.

The thread only writes bytes the hooks hand it, in order; the step's owner waits for it to finish
before it reads the result, so the socket is never used by two threads at once.

Imported only by the training worker (it needs torch); never on the agent's idle path.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from edgefleet.protocol.half_cast import cast_into

log = logging.getLogger(__name__)

MIN_BUCKET_BYTES = 4 * 1024   # smaller pieces cost a hand-over and a thread's wake-up each for little gain
BUCKETS_PER_VECTOR = 8        # ... else an eighth of the vector (bench/overlap.py: earlier and more even than a quarter)


def bucket_bytes_for(vector_bytes: int) -> int:
    """The bucket size for a vector of ``vector_bytes`` on the wire."""
    return max(MIN_BUCKET_BYTES, vector_bytes // BUCKETS_PER_VECTOR)


class _Sender:
    """A thread that writes each step's pieces to the socket in the order given.

    One item is a list of byte segments written one after the other (a piece with the frame's head
    before it, or the last pieces with the tail after them): a thread's wake-up costs about as
    much CPU as a hook's copy, so a step hands over few items. The first failure is kept for
    :meth:`finish`, which waits for the step's last item.
    """

    def __init__(self, send: Callable[[Any], Any]) -> None:
        self._send = send
        self._items: queue.SimpleQueue[tuple[list[Any], threading.Event | None] | None] = queue.SimpleQueue()
        self.error: Exception | None = None
        self.sent_bytes = 0  # written so far this step, the head and tail left out (tests, bench/overlap.py)
        self.written_at: list[float] = []  # perf_counter() when each item was written, this step (bench/overlap.py)
        self._thread = threading.Thread(target=self._run, name="edgefleet-grad-sender", daemon=True)
        self._thread.start()

    def put(self, segments: list[Any], done: threading.Event | None = None) -> None:
        self._items.put((segments, done))

    def _run(self) -> None:
        while True:
            item = self._items.get()
            if item is None:
                return
            segments, done = item
            if self.error is None:
                try:
                    for segment in segments:
                        self._send(segment)
                        self.sent_bytes += len(segment)
                    self.written_at.append(time.perf_counter())
                except Exception as exc:  # handed to the step's thread by finish(), which raises it
                    self.error = exc
            if done is not None:
                done.set()

    def finish(self, segments: list[Any]) -> None:
        """Write ``segments`` after everything put so far and wait until all is written. Raises what writing raised."""
        done = threading.Event()
        self._items.put((segments, done))
        done.wait()
        error, self.error = self.error, None
        if error is not None:
            raise error

    def close(self) -> None:
        self._items.put(None)
        self._thread.join(timeout=5)


class GradientStream:
    """Hooks on the parameters and the progressive send of one step's gradient frame.

    Args:
        params: the trainable parameters in the vector's order (reversed: ``gradient_order``).
        flat: the float32 vector (gradient, then float buffers) the gradients are copied into.
        wire: the half-precision vector sent instead of ``flat`` (float16, or uint16 bfloat16 bits), or None.
        send: writes bytes to the exchange connection (``sock.sendall``, TLS or not).
        bucket_bytes: the least the ready prefix must grow by before it is sent.
    """

    def __init__(self, params: list[torch.nn.Parameter], flat: np.ndarray, wire: np.ndarray | None,
                 send: Callable[[Any], Any], *, bucket_bytes: int | None = None) -> None:
        self.params = params
        self._flat, self._wire = flat, wire
        self._sent_array = wire if wire is not None else flat
        self._bytes: memoryview = self._sent_array.reshape(-1).view(np.uint8).data
        self._itemsize = self._sent_array.itemsize
        self._ends = np.cumsum([p.numel() for p in params]).tolist()  # each parameter's end in the vector
        flat_t = torch.from_numpy(flat)
        self._views = [flat_t[end - p.numel():end].view(p.shape) for p, end in zip(params, self._ends)]
        self._one_call = all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params)
        self._head: bytes | None = None  # the frame's head, written before the first piece
        self.bucket_bytes = bucket_bytes or bucket_bytes_for(self._bytes.nbytes)
        self._bucket = self.bucket_bytes // self._itemsize  # in elements
        self._ready = [False] * len(params)
        self._prefix = 0   # parameters [0, _prefix) are ready
        self._copied = 0   # parameters [0, _copied) are copied and handed to the sender
        self._armed = False
        self.pieces: list[int] = []  # the data pieces' sizes in bytes this step (tests, the benchmark)
        self.handed_at: list[float] = []  # perf_counter() when each piece went to the sender
        self.sent_at_backward_end = -1  # bytes of data written when the last parameter's hook ran (-1: not yet)
        self._sender = _Sender(send)
        # torch declares register_post_accumulate_grad_hook without annotations (2.1-2.13): mypy's strict mode flags the call
        self._handles = [p.register_post_accumulate_grad_hook(functools.partial(self._on_ready, i))  # type: ignore[no-untyped-call]
                         for i, p in enumerate(params)]

    @property
    def armed(self) -> bool:
        return self._armed

    @property
    def written_at(self) -> list[float]:
        """When each item of this step was written (the head first, then the pieces, then the tail)."""
        return self._sender.written_at

    def begin(self, head: bytes) -> None:
        """Arm the hooks for this step's backward and send the frame's ``head`` (``Grad.stream_head``)."""
        self._ready = [False] * len(self.params)
        self._prefix = self._copied = 0
        self.pieces, self.handed_at, self.sent_at_backward_end = [], [], -1
        self._sender.sent_bytes = -len(head)  # count the data only
        self._sender.written_at = []
        self._armed = True
        self._head = head

    def _on_ready(self, index: int, param: torch.Tensor) -> None:
        if not self._armed:
            return
        ready = self._ready
        ready[index] = True
        prefix = self._prefix
        while prefix < len(ready) and ready[prefix]:
            prefix += 1
        self._prefix = prefix
        start = self._ends[self._copied - 1] if self._copied else 0
        if prefix > self._copied and self._ends[prefix - 1] - start >= self._bucket:
            self._hand_over(prefix)
        if prefix == len(ready):
            self.sent_at_backward_end = max(self._sender.sent_bytes, 0)

    @torch.no_grad()
    def _copy(self, upto: int) -> tuple[int, int]:
        """Copy the gradients of parameters [_copied, upto) into the vector (cast for a half wire); their element range."""
        first = self._copied
        start = self._ends[first - 1] if first else 0
        grads = [p.grad for p in self.params[first:upto]]
        present = [g for g in grads if g is not None]
        if self._one_call and len(present) == len(grads):
            torch._foreach_copy_(self._views[first:upto], present)
        else:
            for view, grad in zip(self._views[first:upto], grads):
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad.detach().view_as(view))  # from a GPU or another dtype
        end = self._ends[upto - 1] if upto else 0
        self._copied = upto
        return start, end

    def _piece(self, start: int, end: int) -> memoryview:
        """Elements [start, end) as wire bytes (cast first for a half wire)."""
        if self._wire is not None:
            cast_into(self._wire[start:end], self._flat[start:end])
        piece = self._bytes[start * self._itemsize:end * self._itemsize]
        self.pieces.append(piece.nbytes)
        self.handed_at.append(time.perf_counter())
        return piece

    def _hand_over(self, upto: int) -> None:
        """Copy the gradients of parameters [_copied, upto) and give their bytes to the sender."""
        start, end = self._copy(upto)
        segments: list[Any] = [self._piece(start, end)]
        if self._head is not None:
            segments.insert(0, self._head)
            self._head = None
        self._sender.put(segments)

    def finish(self, tail: bytes) -> None:
        """Send the rest of the vector (the float buffers already in ``flat``) and ``tail``; wait until all is written.

        Raises:
            OSError: the connection failed (``TimeoutError`` when its send timeout ran out).
        """
        self._armed = False
        segments: list[Any] = [] if self._head is None else [self._head]
        self._head = None
        start = self._ends[self._copied - 1] if self._copied else 0
        if self._copied < len(self.params):
            self._copy(len(self.params))
        if start < self._flat.size:
            segments.append(self._piece(start, self._flat.size))
        segments.append(tail)
        self._sender.finish(segments)

    def close(self) -> None:
        """Remove the hooks and stop the sender thread."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._sender.close()


__all__ = ["GradientStream", "bucket_bytes_for"]
