"""The board's side of the gradient exchange: a TCP client and the Lightning callback that uses it.

Imported only by the training worker (it needs torch and Lightning).
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from edgefleet.agent.grad_stream import GradientStream
from edgefleet.agent.local_sgd import ParameterAnchor
from edgefleet.agent.step_channel import StepChannel
from edgefleet.protocol.codec import encode_array
from edgefleet.protocol.errors import DecodeError, EdgeTrainError, NeighbourFault
from edgefleet.protocol.exchange_frames import (
    Avg,
    BatchSplit,
    Grad,
    Hello,
    Refusal,
    Stop,
    Welcome,
    decode_hello_reply,
    decode_step_reply,
)
from edgefleet.protocol.half_cast import cast_into
from edgefleet.protocol.hot_frames import HotFrame
from edgefleet.protocol.stage_sync import GRAD, NOTHING, STATE, StageSync
from edgefleet.protocol.sync_schedule import EXACT, SYNC, SyncSchedule
from edgefleet.protocol.wire_dtype import numpy_dtype, wire_dtype_of
from edgefleet.transport.exchange_tls import TlsRefused, connect_tls
from edgefleet.transport.frame_io import FrameReceiver, send_frame, send_segments, set_os_timeouts
from edgefleet.workloads.loss_scaling import mark_overflow, overflowed, unscaled
from edgefleet.workloads.outer_step import OuterStep
from edgefleet.workloads.params import (
    BufferSet,
    FlatGradients,
    gradient_order,
    restore_optimizer_state,
    restore_scheduler_states,
    trainable_params,
)
from edgefleet.workloads.stage_state import pack_stage_state, state_elements

log = logging.getLogger(__name__)

RESULT_TIMEOUT_S = 900.0  # waiting for a step's result: slow boards and first steps take long


class ExchangeRefused(EdgeTrainError):
    """The coordinator refused this board (wrong token, wrong model, not part of the job, another protocol version)."""


def _closed(exc: OSError) -> NeighbourFault:
    """The coordinator closed the exchange under this board (a run that stops at a whole step to go on with a new plan
    ends its boards' next step so): the job ends there, and this process is sound, so a kept worker takes the next
    job."""
    return NeighbourFault(f"the coordinator closed the gradient exchange ({type(exc).__name__}: {exc}); the job ends "
                          "here")


class StopTraining(Exception):
    """The coordinator ended the job (finished, Ctrl-C, or this board was removed)."""


def _why_not_streamed(trainer: Any, pl_module: Any, sync: SyncSchedule | None) -> str:
    """Why the gradient a hook sees during backward may not be the one the optimizer takes ("": it is)."""
    if trainer.accumulate_grad_batches > 1:
        return f"--accumulate-grad-batches {trainer.accumulate_grad_batches} sums several backward passes"
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        return "a gradient scaler (16-mixed precision) unscales the gradients after backward"
    if sync is not None:
        return "periodic averaging (--sync-every)"
    hook = getattr(type(pl_module), "on_after_backward", None)
    if any(getattr(base, "on_after_backward", None) is hook for base in type(pl_module).__mro__[1:]
           if base.__module__.split(".")[0] in ("lightning", "pytorch_lightning")):
        return ""
    return f"{type(pl_module).__name__}.on_after_backward may change the gradients after backward"


class ExchangeClient:
    """One connection to the coordinator's exchange endpoint."""

    def __init__(self, host: str, port: int, *, connect_timeout_s: float = 30.0,
                 result_timeout_s: float = RESULT_TIMEOUT_S, tls_sha256: str = "") -> None:
        """``tls_sha256``: the fingerprint of the exchange's certificate the signed command pinned ("": plain TCP)."""
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        except OSError as exc:
            raise ExchangeRefused(f"cannot reach the coordinator's exchange at {host}:{port} ({exc.strerror or exc}); "
                                  "check the coordinator's --exchange-host and the firewall") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.result_timeout_s = result_timeout_s
        self.tls_sha256 = tls_sha256
        if tls_sha256:
            try:
                sock = connect_tls(sock, tls_sha256)
            except TlsRefused as exc:
                raise ExchangeRefused(str(exc)) from None
            except OSError as exc:
                raise ExchangeRefused(f"the coordinator's exchange at {host}:{port} closed the connection during TLS "
                                      f"({exc.strerror or exc})") from None
            sock.settimeout(result_timeout_s)  # TLS reads need Python's timeout (a kernel one would surface as an SSL error)
        else:
            set_os_timeouts(sock, result_timeout_s)  # blocking: no poll before every read and write
        self.sock: socket.socket = sock
        self._receiver = FrameReceiver(self.sock)  # its buffer is reused for every result
        self.param_count = 0
        self.split: BatchSplit | None = None  # the re-split in the last result, if any
        self.lrs: tuple[float, ...] | None = None  # learning rates in the last result (a ReduceLROnPlateau's), if any
        self._hot: dict[str, tuple[HotFrame, HotFrame]] = {}  # wire dtype -> (grad, avg) fixed layouts
        self._sent_array: np.ndarray | None = None    # the gradient array last sent, and its wire tensor map
        self._sent_tensor: dict[str, Any] | None = None
        self._channel: StepChannel | None = None  # the usual step's round trip, once the gradient array is known
        self._empty: dict[str, dict[str, Any]] = {}  # wire dtype -> an empty vector's tensor map (local steps)
        self.overlap = False  # the welcome's: the job's vector is in reversed parameter order, streamed (--overlap)

    def hello(self, *, job_id: str, board_id: str, token: str, param_count: int, proof: bytes | None = None) -> Welcome:
        """Join the job; the welcome (the step to start at, the state to start from).

        The credential is ``proof`` (``protocol.exchange_auth``: this board's key over the job, its
        id and the exchange's certificate) or the ``token`` the command carried.

        Raises:
            ExchangeRefused: the coordinator refused this board (its message says why and what to do).
            ExchangeVersionError: the coordinator speaks another exchange protocol version (the message says
                which side to upgrade).
            DecodeError: the coordinator's answer is malformed.
        """
        send_frame(self.sock, Hello(job_id=job_id, board_id=board_id, token=token, param_count=param_count,
                                    proof=proof).to_wire())
        reply = decode_hello_reply(self._recv(self._receiver.recv))
        if isinstance(reply, Refusal):
            raise ExchangeRefused(f"the coordinator refused this board: {reply.message}")
        self._receiver.buffer = bytearray()  # the welcome's tensors are views into the old buffer: keep them valid
        self.param_count = param_count
        self.overlap = reply.overlap
        return reply

    def exchange(self, *, step: int, grad: np.ndarray, n: int, loss: float | None, compute_s: float,
                 logs: dict[str, list[Any]] | None = None, result_elements: int | None = None) -> np.ndarray:
        """Send this board's gradient for ``step``; return the fleet's average (a view, valid until the next call).

        A re-split announced with the result is left in :attr:`split` (None when there was none),
        learning rates in :attr:`lrs`. ``logs`` (what training_step logged) go with the gradient.

        ``grad`` may be the same array at every step (it is described for the wire once); change
        its values in place, not its shape or dtype.

        ``result_elements``: the result's length when it is not the gradient's (a later pipeline stage's board
        sends its own stage's gradient and is answered stage 0's: ``coordinator.exchange.modes.PipelineStages``);
        the general frames both ways.

        Raises:
            StopTraining: the coordinator sent ``stop`` instead of a result.
            TimeoutError: the coordinator did not answer within ``result_timeout_s``.
            DecodeError: the coordinator's answer is not this step's result of the gradient's shape and dtype.
        """
        if result_elements is not None:
            return self._exchange_general(step=step, grad=grad, n=n, loss=loss, compute_s=compute_s, logs=logs,
                                          result_elements=result_elements)
        channel = self._channel
        if channel is not None and channel.grad is grad:  # the usual step: the result in its fixed layout, nothing made
            if logs or not self._send(channel.send, step, n, loss, compute_s):  # logs, a loss of None: general frame
                described = self._sent_tensor if grad is self._sent_array and self._sent_tensor else encode_array(grad)
                self._send(send_frame, self.sock, Grad(step=step, n=n, loss=loss, compute_s=compute_s, g=described,
                                                       logs=logs or None).to_wire())
            return self._answer(channel, step)
        tensor = self._sent_tensor if grad is self._sent_array else None  # the worker sends from one buffer every step
        if tensor is None:
            tensor = encode_array(grad)
            in_place = np.may_share_memory(np.frombuffer(tensor["data"], np.uint8), grad)  # not a converted copy
            self._sent_array, self._sent_tensor = (grad, tensor) if in_place else (None, None)
        hot = self._hot.get(tensor["dtype"])
        if hot is None:
            hot = self._hot[tensor["dtype"]] = (HotFrame("grad", tensor["dtype"]), HotFrame("avg", tensor["dtype"]))
            self._receiver.expected_bytes = hot[1].prefix_bytes + self.param_count * hot[1].itemsize  # a step's result
        if self._sent_array is grad and grad.size == self.param_count and (channel is None or channel.grad is not grad):
            self._channel = StepChannel(self.sock, self._receiver, grad, grad_layout=hot[0], avg_layout=hot[1],
                                        elements=self.param_count)  # from the next step on
        segments = None if logs else Grad.encode_hot(hot[0], step=step, n=n, loss=loss, compute_s=compute_s, tensor=tensor)
        if segments is None:  # logs, or a loss of None: the general encoder
            frame = Grad(step=step, n=n, loss=loss, compute_s=compute_s, g=tensor, logs=logs or None).to_wire()
            self._send(send_frame, self.sock, frame)
        else:  # fixed layout: one struct.pack
            self._send(send_segments, self.sock, segments)
        answer = self._recv(self._receiver.recv, hot[1].decode_any_array)
        return self._result_of(step, self._step_reply(answer, hot[1].dtype))

    def _exchange_general(self, *, step: int, grad: np.ndarray, n: int, loss: float | None, compute_s: float,
                          logs: dict[str, list[Any]] | None, result_elements: int) -> np.ndarray:
        """A round whose result has ``result_elements`` values of the gradient's wire dtype, in the general frames."""
        tensor = self._sent_tensor if grad is self._sent_array and self._sent_tensor else encode_array(grad)
        hot = self._hot.get(tensor["dtype"])
        if hot is None:
            hot = self._hot[tensor["dtype"]] = (HotFrame("grad", tensor["dtype"]), HotFrame("avg", tensor["dtype"]))
            self._receiver.expected_bytes = hot[1].prefix_bytes + result_elements * hot[1].itemsize
        # the fixed layout where it applies: its segments go out as they are, no copy of a large vector (a later
        # stage's state step carries its parameters and optimizer state)
        segments = None if logs else Grad.encode_hot(hot[0], step=step, n=n, loss=loss, compute_s=compute_s, tensor=tensor)
        if segments is None:
            self._send(send_frame, self.sock, Grad(step=step, n=n, loss=loss, compute_s=compute_s, g=tensor,
                                                   logs=logs or None).to_wire())
        else:
            self._send(send_segments, self.sock, segments)
        answer = self._recv(self._receiver.recv, hot[1].decode_any_array)
        return self._result_of(step, decode_step_reply(answer, elements=result_elements, dtype=hot[1].dtype))

    def _answer(self, channel: StepChannel, step: int) -> np.ndarray:
        """The result of ``step`` read through ``channel`` (the general receiver for anything unusual)."""
        answer = self._recv(channel.receive)
        if type(answer) is tuple:
            if answer[0] != step:
                raise DecodeError(f"expected the result of step {step}, got the result of step {answer[0]}")
            self.split = self.lrs = None
            return channel.array
        if answer is None:  # not the usual size: the general receiver has the bytes read so far
            answer = self._recv(self._receiver.recv, channel.avg_layout.decode_any_array)
        return self._result_of(step, self._step_reply(answer, channel.avg_layout.dtype))

    def send_bytes(self, data: Any) -> None:
        """Write part of a frame (overlap: ``agent.grad_stream``), TLS or not.

        Raises:
            TimeoutError: the coordinator took nothing for ``result_timeout_s``.
            OSError: the connection failed.
        """
        self._send(self.sock.sendall, data)

    def receive_result(self, *, step: int, grad: np.ndarray) -> np.ndarray:
        """The fleet's average for ``step`` after this board sent its gradient ``grad`` itself (a streamed frame).

        Returns and raises as :meth:`exchange` does; ``grad`` is the array sent at every step (its dtype is the wire's).
        """
        dtype = wire_dtype_of(grad.dtype).name
        channel = self._channel
        if channel is None or channel.grad is not grad:
            hot = self._hot.get(dtype)
            if hot is None:
                hot = self._hot[dtype] = (HotFrame("grad", dtype), HotFrame("avg", dtype))
                self._receiver.expected_bytes = hot[1].prefix_bytes + self.param_count * hot[1].itemsize
            channel = self._channel = StepChannel(self.sock, self._receiver, grad, grad_layout=hot[0], avg_layout=hot[1],
                                                  elements=self.param_count)
        return self._answer(channel, step)

    def exchange_empty(self, *, step: int, n: int, loss: float | None, compute_s: float, dtype: str,
                       logs: dict[str, list[Any]] | None = None) -> None:
        """A local step's round (periodic averaging): an empty vector of wire ``dtype`` each way.

        The round keeps the coordinator's per-step bookkeeping (loss, timing, re-splits, drop-outs,
        learning rates, stop): a re-split or learning rates in the result are left in :attr:`split`
        and :attr:`lrs` as with :meth:`exchange`.

        Raises:
            StopTraining, TimeoutError, DecodeError: as :meth:`exchange`.
        """
        hot = self._hot.get(dtype)
        if hot is None:
            hot = self._hot[dtype] = (HotFrame("grad", dtype), HotFrame("avg", dtype))
            self._receiver.expected_bytes = hot[1].prefix_bytes + self.param_count * hot[1].itemsize  # a full result
        tensor = self._empty.get(dtype)
        if tensor is None:
            tensor = self._empty[dtype] = encode_array(np.zeros(0, dtype=numpy_dtype(dtype)))
        segments = None if logs else Grad.encode_hot(hot[0], step=step, n=n, loss=loss, compute_s=compute_s, tensor=tensor)
        if segments is None:  # logs, or a loss of None: the general encoder
            self._send(send_frame, self.sock, Grad(step=step, n=n, loss=loss, compute_s=compute_s, g=tensor,
                                                   logs=logs or None).to_wire())
        else:
            self._send(send_segments, self.sock, segments)
        answer = self._recv(self._receiver.recv, hot[1].decode_any_array)
        self._result_of(step, decode_step_reply(answer, elements=0, dtype=dtype))

    @property
    def result_buffer(self) -> np.ndarray | None:
        """The array usual results are returned in: the same at every step, overwritten by the next (None until known)."""
        return self._channel.array if self._channel is not None else None

    def _step_reply(self, frame: dict[str, Any], dtype: str) -> Avg | Stop:
        return decode_step_reply(frame, elements=self.param_count, dtype=dtype)

    def _result_of(self, step: int, reply: Avg | Stop) -> np.ndarray:
        if isinstance(reply, Stop):
            raise StopTraining(reply.reason)
        if reply.step != step:
            raise DecodeError(f"expected the result of step {step}, got the result of step {reply.step}")
        self.split, self.lrs = reply.split, reply.lrs
        return reply.array

    def _send(self, send: Callable[..., Any], *args: Any) -> Any:
        try:
            return send(*args)
        except (BlockingIOError, TimeoutError):  # the kernel's send timeout, or Python's where it had to stand in
            raise TimeoutError(f"the coordinator took no gradient for {self.result_timeout_s:g} s") from None
        except (ConnectionError, ssl.SSLError) as exc:
            raise _closed(exc) from None

    def _recv(self, receive: Callable[..., Any], *args: Any) -> Any:
        try:
            return receive(*args)
        except (BlockingIOError, TimeoutError):  # SO_RCVTIMEO ran out (or the Python timeout standing in for it)
            raise TimeoutError(f"no answer from the coordinator within {self.result_timeout_s:g} s") from None
        except (ConnectionError, ssl.SSLError) as exc:
            raise _closed(exc) from None

    def close(self) -> None:
        self.sock.close()


class GradientExchange:
    """Sits between backward and the optimizer step: swaps this board's gradient for the fleet's.

    ``on_before_optimizer_step`` is the exchange point: gradients are accumulated and unscaled
    there, not yet clipped, and the step that follows is the same on every replica. The hooks
    are a Callback of the module's own Lightning package (``workloads.lightning_api.callback_class``).

    Args:
        client: The joined exchange connection.
        batch_size: This board's batch size, or a function of the step when re-splits can change it.
        start_step: The global step of the first batch.
        wire_dtype: float32, float16 or bfloat16.
        optimizer_state: The welcome's optimizer state, restored at train start.
        scheduler_states: The welcome's LR scheduler states, in Lightning's order, restored at train start.
        step_logs: An ``agent.step_logs.StepLogs`` whose values go with each gradient, or None.
        on_step: Called with (step, loss, compute_s) after every step.
        on_split: Called with (from_step, batch sizes) when the coordinator re-splits the global
            batch (the sampler's ``resplit``); None: this job's batches cannot be re-split.
        sync: The job's averaging schedule (``protocol.sync_schedule``); None: exact at every step.
        overlap: The vector holds the gradient in reversed parameter order and goes out while backward
            runs (``agent.grad_stream``); None: as the coordinator's welcome says (``client.overlap``).
        only: Layer placement: the vector holds these parameters' gradients (the head's; ``workloads.layer_cut``),
            the others (the tail's, trained on the tail host) keep no gradient and the optimizer leaves them;
            None: every trainable parameter.
        buffers: Layer placement: the module whose buffers travel after the gradient (the head's layers); None:
            the whole module's.
        keep_own: Pipeline stages: this board's vector is its own stage's gradient (a later stage's, which only it
            trains); the optimizer steps on the board's own gradient (``only``: the stage's parameters), and the
            coordinator's answer (``result_elements`` values: stage 0's average, for stage 0's boards) is not used.
        stage_sync: A later pipeline stage's schedule (``protocol.stage_sync``): at each step its gradient, nothing,
            or its gradient then its parameters and optimizer state before the step (``workloads.stage_state``).
        waited_s: A pipeline stage's time waiting on its neighbours so far (``StageEndpoint.waited_s``): the compute
            time a step reports leaves it out, so that it is the board's own busy time (``coordinator.pipeline``'s
            revision judges each board by it) and a slow neighbour does not make this board look slow.

    Periodic averaging (``sync.every`` > 1): from the warm-up's end on, the optimizer steps on this
    board's own gradient (Lightning's step, clipping and all) and the exchange comes after it, in
    ``on_train_batch_end``: an empty vector at a local step, at a sync step the distance moved since
    the last average (``agent.local_sgd``), whose fleet average sets the model (with DiLoCo through the
    outer optimizer, whose momentum a joining board takes from ``outer_state``, the welcome's).

    Overlap (``--overlap``): ``on_before_backward`` sends the frame's head and arms the hooks of
    ``agent.grad_stream``, which send the gradient in buckets as backward produces it;
    ``on_before_optimizer_step`` sends the rest and ``compute_s``, then waits for the average as
    usual. Where the gradient at a hook is not yet the one the optimizer takes (accumulation over
    several batches, a gradient scaler, a module's ``on_after_backward``), the vector keeps the
    reversed order but goes out after backward, and the log says why once.
    """

    def __init__(self, client: ExchangeClient, *, batch_size: int | Callable[[int], int], start_step: int,
                 wire_dtype: str, optimizer_state: Any, on_step: Callable[[int, float | None, float], None],
                 on_split: Callable[[int, list[int]], object] | None = None,
                 scheduler_states: list[Any] | None = None, step_logs: Any = None,
                 sync: SyncSchedule | None = None, overlap: bool | None = None,
                 only: list[torch.nn.Parameter] | None = None, buffers: torch.nn.Module | None = None,
                 outer_state: Any = None, keep_own: bool = False, result_elements: int | None = None,
                 stage_sync: StageSync | None = None, waited_s: Callable[[], float] | None = None) -> None:
        self.client, self.step, self.wire_dtype = client, start_step, wire_dtype
        self._waited_s = waited_s
        self._waited_at_start = 0.0
        self._outer_state = outer_state
        self._buffers_of = buffers
        self._only = {id(p) for p in only} if only is not None else None
        self._keep_own = keep_own
        self._result_elements = result_elements
        self._stage_sync = stage_sync if keep_own and stage_sync is not None and stage_sync.sparse else None
        self.overlap = client.overlap if overlap is None else overlap
        self.stream: GradientStream | None = None  # overlap's hooks and sender, once training starts
        self._sync = sync if sync is not None and sync.periodic else None
        self._anchor: ParameterAnchor | None = None
        self._local_compute_s: float | None = None  # a local step's compute time, until its exchange after the optimizer step
        self._batch_size = batch_size if callable(batch_size) else (lambda step, b=batch_size: b)
        self._optimizer_state = optimizer_state
        self._scheduler_states = scheduler_states or []
        self._step_logs = step_logs
        self._on_step = on_step
        self._on_split = on_split
        self._loss: float | None = None
        self._window_loss: float | None = None
        self._started: float | None = None  # the step's first batch (of several with gradient accumulation)
        self._params: list[torch.nn.Parameter] = []
        self._grads: FlatGradients | None = None  # the gradients to and from self._flat, one call each way
        self._buffers = BufferSet()  # float buffers, then integer buffers' bytes: they travel after the gradient
        self._grad_elements = 0
        self._optimizer: Any = None
        self._flat = np.zeros(0, dtype=np.float32)
        self._wire: np.ndarray | None = None
        self._avg32: np.ndarray | None = None
        self._scaler: Any = None  # 16-mixed's GradScaler: the step is skipped where the fleet's gradient overflowed

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizer = trainer.optimizers[0]
        if self._optimizer_state:
            restore_optimizer_state(optimizer, self._optimizer_state)
        self._optimizer_state = None  # views into the welcome's frame: let its buffer go (a big model's bytes)
        restore_scheduler_states(trainer.lr_scheduler_configs, self._scheduler_states)
        # A ReduceLROnPlateau decides on the coordinator, which has the monitored metric (its validation, the
        # fleet's logged values): its learning rates come with the results (``lrs``), the board steps none itself.
        trainer.strategy.lr_scheduler_configs = [c for c in trainer.lr_scheduler_configs if not c.reduce_on_plateau]
        self._optimizer = optimizer
        self._scaler = getattr(trainer.precision_plugin, "scaler", None)
        trainable = trainable_params(optimizer)
        if self._only is not None:
            trainable = [p for p in trainable if id(p) in self._only]
        self._params = gradient_order(trainable, overlap=self.overlap)
        self._buffers = BufferSet(self._buffers_of if self._buffers_of is not None else pl_module)
        self._grad_elements = sum(p.numel() for p in self._params)
        self._flat = np.zeros(self._grad_elements + self._buffers.elements, dtype=np.float32)
        self._grads = FlatGradients(self._params, self._flat[:self._grad_elements])
        if self.wire_dtype != "float32":
            self._wire = np.zeros(self._flat.size, dtype=numpy_dtype(self.wire_dtype))
            self._avg32 = np.zeros(self._flat.size, dtype=np.float32)
        if self.overlap:
            why_not = _why_not_streamed(trainer, pl_module, self._sync)
            if why_not:
                log.info("overlap: the gradient goes out after backward, not during it: %s", why_not)
            elif self.stream is None:
                self.stream = GradientStream(self._params, self._flat, self._wire, self.client.send_bytes)
                log.info("overlap: the gradient goes out in buckets of %d KiB during backward", self.stream.bucket_bytes // 1024)
        if self._sync is not None:
            outer = None
            if self._sync.outer.stepped:  # DiLoCo: the fleet's momentum so far (zeros at the run's start)
                outer = OuterStep(self._sync.outer, self._grad_elements)
                if self._outer_state is not None:
                    outer.load_state(self._outer_state)
                elif self.step > 0:
                    raise DecodeError("the welcome carries no outer optimizer state for this DiLoCo job, joined at step "
                                      f"{self.step}: upgrade edge-coordinator to this board's edgefleet version")
            self._anchor = ParameterAnchor([*self._params, *self._buffers.floats], self._buffers.ints, outer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._started is None:
            self._started = time.perf_counter()
            self._waited_at_start = self._waited_s() if self._waited_s is not None else 0.0
        anchor = self._anchor
        if anchor is not None and not anchor.taken and self._is_local(self.step):
            anchor.take()  # before the forward pass moves the float buffers: the model every board holds now

    def _is_local(self, step: int) -> bool:
        """Whether ``step`` steps on this board's own gradient (periodic averaging, after the warm-up)."""
        return self._sync is not None and self._sync.kind(step) != EXACT

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        # Lightning divides each batch's loss by accumulate_grad_batches: the window's sum is the step's loss.
        # Under 16-mixed the loss here is scaled: the fleet's loss is the unscaled one.
        self._window_loss = (self._window_loss or 0.0) + unscaled(loss, self._scaler)
        if self.stream is not None and not self._is_local(self.step):  # one batch per step: its backward comes next
            logs = self._step_logs.take() if self._step_logs is not None else None
            n = self._batch_size(self.step) * trainer.accumulate_grad_batches
            self.stream.begin(Grad.stream_head(step=self.step, n=n, loss=self._window_loss, logs=logs,
                                               dtype=self.wire_dtype, elements=self._flat.size))

    @torch.no_grad()
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        compute_s = time.perf_counter() - (self._started or time.perf_counter())
        if self._waited_s is not None and self._started is not None:  # a pipeline stage: its own work only
            compute_s = max(compute_s - (self._waited_s() - self._waited_at_start), 0.0)
        self._started = None
        self._loss, self._window_loss = self._window_loss, None  # None: training_step skipped every batch
        if self._anchor is not None and self._is_local(self.step):
            self._local_compute_s = compute_s  # the optimizer steps on this board's gradient; the exchange follows it
            return
        grads = self._grads or FlatGradients(self._params, self._flat[:self._grad_elements])
        stream = self.stream
        if stream is not None and stream.armed:  # overlap: the gradient went out during backward; the rest now
            if self._buffers:
                self._buffers.flatten_into(self._flat[self._grad_elements:])
            stream.finish(Grad.stream_tail(round(compute_s, 6)))
            avg = self.client.receive_result(step=self.step, grad=self._wire if self._wire is not None else self._flat)
        else:
            avg = self._exchange_after_backward(grads, compute_s, trainer.accumulate_grad_batches)
        if self._keep_own:  # a later pipeline stage: the gradient stays this board's own (the answer is stage 0's)
            if self.client.lrs is not None:
                self._set_lrs(self.client.lrs)
            self._on_step(self.step, self._loss, compute_s)
            self.step += 1
            return
        if self.client.lrs is not None:
            self._set_lrs(self.client.lrs)
        if self.client.split is not None:
            self._follow_split(self.client.split.from_step, list(self.client.split.batch_sizes))
        if self._avg32 is not None:
            cast_into(self._avg32, avg)
            avg = self._avg32
        grads.scatter(avg, keep=avg is self._avg32 or avg is self.client.result_buffer)
        if self._scaler is not None:  # DDP's rule: skipped on every board where any board's gradient overflowed
            mark_overflow(self._scaler, optimizer, overflowed(avg[:self._grad_elements]))
        if self._buffers:  # the first contributing board's buffers (DDP's rule), or the float ones' average
            self._buffers.assign_from(avg[self._grad_elements:])
        self._on_step(self.step, self._loss, compute_s)
        self.step += 1

    def _exchange_after_backward(self, grads: FlatGradients, compute_s: float, accumulate: int) -> np.ndarray:
        """Send the whole gradient now that backward has ended; the fleet's average."""
        kind = self._stage_sync.kind(self.step) if self._stage_sync is not None else GRAD
        if kind == NOTHING:  # a later stage between its state steps: the round's bookkeeping, no vector
            return self._exchange_stage(np.zeros(0, dtype=np.float32), compute_s, accumulate)
        grads.gather()
        if kind == STATE:  # the gradient, then the stage's parameters and optimizer state as they are before the step
            vector = np.empty(self._grad_elements + state_elements(self._params, self._optimizer), dtype=np.float32)
            vector[:self._grad_elements] = self._flat[:self._grad_elements]
            pack_stage_state(self._params, self._optimizer, out=vector[self._grad_elements:])
            return self._exchange_stage(vector, compute_s, accumulate)
        if self._buffers:
            self._buffers.flatten_into(self._flat[self._grad_elements:])
        wire = self._flat
        if self._wire is not None:
            cast_into(self._wire, self._flat)
            wire = self._wire
        n = self._batch_size(self.step) * accumulate
        logs = self._step_logs.take() if self._step_logs is not None else None
        return self.client.exchange(step=self.step, grad=wire, n=n, loss=self._loss, compute_s=round(compute_s, 6),
                                    logs=logs, result_elements=self._result_elements if self._keep_own else None)

    def _exchange_stage(self, vector: np.ndarray, compute_s: float, accumulate: int) -> np.ndarray:
        """A later stage's round with another vector than its gradient (float32: the job's wire dtype)."""
        n = self._batch_size(self.step) * accumulate
        logs = self._step_logs.take() if self._step_logs is not None else None
        return self.client.exchange(step=self.step, grad=vector, n=n, loss=self._loss, compute_s=round(compute_s, 6),
                                    logs=logs, result_elements=self._result_elements)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    @torch.no_grad()
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """A local step's exchange, after the optimizer stepped on this board's gradient (periodic averaging only)."""
        compute_s, self._local_compute_s = self._local_compute_s, None
        anchor = self._anchor
        if compute_s is None or anchor is None:
            return  # an exact step (exchanged before the optimizer step), or no local step ran
        n = self._batch_size(self.step)
        anchor.samples += n
        logs = self._step_logs.take() if self._step_logs is not None else None
        if self._sync is not None and self._sync.kind(self.step) == SYNC:
            delta = anchor.delta_into(self._flat)
            wire = delta
            if self._wire is not None:
                cast_into(self._wire, delta)
                wire = self._wire
            # n: the samples since the last average, this board's weight in it
            avg = self.client.exchange(step=self.step, grad=wire, n=anchor.samples, loss=self._loss,
                                       compute_s=round(compute_s, 6), logs=logs)
            if self._avg32 is not None:
                cast_into(self._avg32, avg)
                avg = self._avg32
            anchor.apply(avg)
        else:
            self.client.exchange_empty(step=self.step, n=n, loss=self._loss, compute_s=round(compute_s, 6),
                                       dtype=self.wire_dtype, logs=logs)
        if self.client.lrs is not None:
            self._set_lrs(self.client.lrs)
        if self.client.split is not None:
            self._follow_split(self.client.split.from_step, list(self.client.split.batch_sizes))
        self._on_step(self.step, self._loss, compute_s)
        self.step += 1

    def _set_lrs(self, lrs: tuple[float, ...]) -> None:
        groups = self._optimizer.param_groups
        if len(lrs) != len(groups):
            raise DecodeError(f"the result sets {len(lrs)} learning rates; the optimizer has {len(groups)} param groups")
        for group, lr in zip(groups, lrs):
            group["lr"] = lr

    def _follow_split(self, from_step: int, batch_sizes: list[int]) -> None:
        if self._on_split is None:
            raise DecodeError(f"the coordinator re-split the batches from step {from_step}, but this job's "
                              "batches cannot be re-split (each board samples its own data)")
        self._on_split(from_step, batch_sizes)
        log.info("batch sizes %s from step %d", batch_sizes, from_step)

    @property
    def batch_size(self) -> int:
        """This board's batch size at the next step."""
        return self._batch_size(self.step)
