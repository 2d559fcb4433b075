"""The board's side of layer placement: its model's tail runs on the tail host, over the global batch.

:func:`install` gives the board's copy of the module a ``forward`` (on the instance: the module's code
is not edited) that runs the head here (``workloads.layer_cut``) and the tail through a
:class:`TailLink`: the head's output goes to the tail host, the tail's output for this board's slice
comes back and ``training_step`` computes its loss from it as from its own forward; in backward the
output's gradient goes up and the activation's gradient comes back, and backward finishes through
the head. The head's gradient is then exchanged as in data-parallel training
(``agent.worker_exchange``). The frames are ``protocol.activation_frames``.

Imported only by the training worker (it needs torch).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import numpy as np
import torch

from edgefleet.protocol.activation_frames import ACT, DACT, DOUT, OUT, StepTensor, TailHello, TailWelcome, decode_tail_reply
from edgefleet.protocol.errors import EdgeTrainError
from edgefleet.transport.exchange_tls import TlsRefused, connect_tls
from edgefleet.transport.frame_io import FrameReceiver, send_frame
from edgefleet.workloads.layer_cut import ModelCut

log = logging.getLogger(__name__)

TAIL_TIMEOUT_S = 900.0  # waiting for the tail's answer: the slowest board's head comes first


class TailUnreachable(EdgeTrainError):
    """The tail host cannot be reached, or refused this board (the message says why)."""


class TailLink:
    """One board's activation connection; it counts the steps (one forward and one backward each).

    Args:
        host, port: the tail host's endpoint (the exchange's host, the command's ``tail_port``).
        tls_sha256: the exchange's certificate, pinned ("": plain TCP).
    """

    def __init__(self, host: str, port: int, *, tls_sha256: str = "", timeout_s: float = TAIL_TIMEOUT_S) -> None:
        try:
            sock = socket.create_connection((host, port), timeout=30.0)
        except OSError as exc:
            raise TailUnreachable(f"cannot reach the tail host at {host}:{port} ({exc.strerror or exc}); check the "
                                  "coordinator's --exchange-host and the firewall") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls_sha256:
            try:
                sock = connect_tls(sock, tls_sha256)
            except (TlsRefused, OSError) as exc:
                raise TailUnreachable(f"the tail host at {host}:{port} failed TLS ({exc})") from None
        sock.settimeout(timeout_s)
        self.sock = sock
        self._receiver = FrameReceiver(sock)
        self.step = 0
        self.welcome: TailWelcome | None = None
        self._rows = 0  # the slice's rows at the step's forward

    def hello(self, *, job_id: str, board_id: str, token: str, proof: bytes | None, start: int) -> TailWelcome:
        """Join the tail host's rounds from step ``start``.

        Raises:
            TailUnreachable: refused (the reason says why).
        """
        send_frame(self.sock, TailHello(job_id=job_id, board_id=board_id, token=token, start=start, proof=proof).to_wire())
        try:
            self.welcome = decode_tail_reply(self._receiver.recv())
        except EdgeTrainError as exc:
            raise TailUnreachable(f"the tail host refused this board: {exc}") from None
        self.step = start
        return self.welcome

    def forward(self, activation: np.ndarray) -> np.ndarray:
        """Send this step's activation; the tail's output for this board's slice."""
        assert self.welcome is not None, "hello first"
        self._rows = int(activation.shape[0])
        send_frame(self.sock, StepTensor(ACT, self.step, np.ascontiguousarray(activation, np.float32)).to_wire())
        frame = self._receiver.recv()
        return np.array(StepTensor.from_wire(frame, OUT, step=self.step, shape=(self._rows, *self.welcome.output)).tensor)

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        """Send the output's gradient; the activation's (and the step is done here)."""
        assert self.welcome is not None, "hello first"
        send_frame(self.sock, StepTensor(DOUT, self.step, np.ascontiguousarray(grad_output, np.float32)).to_wire())
        frame = self._receiver.recv()
        dact = np.array(StepTensor.from_wire(frame, DACT, step=self.step, shape=(self._rows, *self.welcome.boundary)).tensor)
        self.step += 1
        return dact

    def close(self) -> None:
        self.sock.close()


class _RemoteTail(torch.autograd.Function):
    """The tail as one autograd node: its forward and backward run on the tail host."""

    @staticmethod
    def forward(ctx: Any, activation: torch.Tensor, link: TailLink) -> torch.Tensor:
        ctx.link = link
        return torch.from_numpy(link.forward(activation.detach().cpu().numpy())).to(activation.device)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        link: TailLink = ctx.link
        dact = link.backward(grad_output.detach().cpu().numpy())
        return torch.from_numpy(dact).to(grad_output.device), None


def install(model: torch.nn.Module, cut: ModelCut, link: TailLink) -> None:
    """Give ``model`` (this board's copy) the placed forward: the head here, the tail on the tail host."""
    head = cut.head

    def placed_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        # torch types autograd.Function.apply as untyped (it forwards to the subclass's static forward)
        out: torch.Tensor = _RemoteTail.apply(head(*args, **kwargs), link)  # type: ignore[no-untyped-call]
        return out

    model.forward = placed_forward  # this copy only (an instance attribute): the module's code is unchanged


__all__ = ["TAIL_TIMEOUT_S", "TailLink", "TailUnreachable", "install"]
