"""The exchange's pipeline mode (issue 35) over real TCP sockets, with real board clients on threads.

Three stages, one board each: stage 0 holds the global batch, every stage sends its own stage's
gradient over that batch, the boards get stage 0's (averaged) gradient and the replica the full vector.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from edgefleet.agent.worker_exchange import ExchangeClient, ExchangeRefused, StopTraining
from edgefleet.coordinator.exchange.board_state import BoardState
from edgefleet.coordinator.exchange.gradient_reduce import GradientReducer
from edgefleet.coordinator.exchange.modes import PipelineStages, select_mode
from edgefleet.coordinator.exchange.pipeline_layout import PipelineLayout
from edgefleet.coordinator.exchange.server import ExchangeError, ExchangeServer
from edgefleet.coordinator.exchange.step_sum import StepResult
from edgefleet.protocol.codec import encode_value, from_bf16_bits, to_bf16_bits
from edgefleet.protocol.exchange_frames import Hello, Refusal, Welcome, decode_hello_reply
from edgefleet.protocol.split_schedule import SplitSchedule
from edgefleet.protocol.stage_sync import GRAD, NOTHING, STATE, StageSync
from edgefleet.protocol.sync_schedule import SyncSchedule
from edgefleet.transport.frame_io import recv_frame, send_frame

GLOBAL_BATCH = 32
BOARDS = [("s0", GLOBAL_BATCH), ("s1", 0), ("s2", 0)]
ELEMENTS = [4, 6, 3]
FULL = 15  # values 8 and 14 belong to no stage (an unused parameter): they stay 0
SLOTS = [[(0, 0, 2), (2, 11, 2)], [(0, 2, 6)], [(0, 9, 2), (2, 13, 1)]]


def _layout(**changes: Any) -> PipelineLayout:
    fields: dict[str, Any] = {"elements": ELEMENTS, "slots": SLOTS, "full_elements": FULL, "global_batch": GLOBAL_BATCH}
    return PipelineLayout(**{**fields, **changes})


def _server(wire_dtype: str = "float32", **kwargs: Any) -> ExchangeServer:
    return ExchangeServer(job_id="job", token="secret", boards=BOARDS, param_count=FULL, wire_dtype=wire_dtype,
                          welcome_state=lambda: (0, encode_value({"w": np.zeros(3, np.float32)}), encode_value({})),
                          pipeline=_layout(), **kwargs)


def _grad(step: int, index: int, wire_dtype: str = "float32") -> np.ndarray:
    """Stage ``index``'s vector at ``step`` as it travels (bfloat16: its bits in a uint16 array)."""
    values = np.random.default_rng(100 * step + index).standard_normal(ELEMENTS[index]).astype(np.float32)
    return to_bf16_bits(values) if wire_dtype == "bfloat16" else values.astype(wire_dtype)


def _scattered(step: int, wire_dtype: str) -> np.ndarray:
    """What the replica must get at ``step``: each stage's vector in its slots (as it travelled), zeros elsewhere."""
    full = np.zeros(FULL, dtype=np.float32)
    for index, runs in enumerate(SLOTS):
        vector = _grad(step, index, wire_dtype)
        vector = from_bf16_bits(vector) if wire_dtype == "bfloat16" else vector.astype(np.float32)
        for src, dst, count in runs:
            full[dst:dst + count] = vector[src:src + count]
    return full


class StageBoard(threading.Thread):
    """A stage's board: joins with its stage's size and sends ``make(step, index)`` with ``n(step, index)`` for
    ``steps`` steps (None: it leaves instead)."""

    def __init__(self, index: int, port: int, steps: int, make: Callable[[int, int], np.ndarray | None],
                 n: Callable[[int, int], int] = lambda step, index: GLOBAL_BATCH) -> None:
        super().__init__(daemon=True)
        self.index, self.port, self.steps, self.make, self.n = index, port, steps, make, n
        self.results: list[np.ndarray] = []
        self.error: BaseException | None = None
        self.result_elements = None if index == 0 else ELEMENTS[0]  # every board is answered stage 0's average

    def run(self) -> None:
        try:
            client = ExchangeClient("127.0.0.1", self.port)
            client.hello(job_id="job", board_id=BOARDS[self.index][0], token="secret", param_count=ELEMENTS[self.index])
            for step in range(self.steps):
                grad = self.make(step, self.index)
                if grad is None:
                    client.close()
                    return
                self.results.append(np.array(client.exchange(step=step, grad=grad, n=self.n(step, self.index), loss=1.0,
                                                             compute_s=0.01, result_elements=self.result_elements)))
        except (ExchangeRefused, StopTraining, OSError) as exc:
            self.error = exc


async def _steps(boards: list[StageBoard], server: ExchangeServer, steps: int,
                 applied: list[np.ndarray]) -> list[StepResult | ExchangeError]:
    """Run ``steps`` steps (a step that fails is its error, and ends the run); then close the server."""
    for board in boards:
        board.start()
    await server.wait_for_boards(10, need={b for b, _ in BOARDS})
    results: list[StepResult | ExchangeError] = []
    try:
        for step in range(steps):
            results.append(await server.run_step(step, apply=lambda g, r: applied.append(g.copy())))
    except ExchangeError as exc:
        results.append(exc)
    finally:
        await server.close()
    for board in boards:
        board.join(10)
    return results


@pytest.mark.parametrize("wire_dtype", ["float32", "float16", "bfloat16"])
def test_each_stage_lands_in_its_slots_and_the_boards_get_stage_0s_gradient(wire_dtype: str) -> None:
    async def main() -> tuple[list[StepResult | ExchangeError], list[StageBoard], list[np.ndarray]]:
        server = _server(wire_dtype)
        port = await server.start("127.0.0.1", 0)
        boards = [StageBoard(i, port, 2, functools.partial(_grad, wire_dtype=wire_dtype)) for i in range(len(BOARDS))]
        applied: list[np.ndarray] = []
        return await _steps(boards, server, 2, applied), boards, applied

    results, boards, applied = asyncio.run(main())
    assert len(applied) == 2
    for step, result in enumerate(results):
        assert isinstance(result, StepResult)
        np.testing.assert_array_equal(applied[step], _scattered(step, wire_dtype))  # no averaging; 8 and 14 stay 0
        assert applied[step].dtype == np.float32 and applied[step][[8, 14]].tolist() == [0.0, 0.0]
        assert result.contributors == ["s0", "s1", "s2"] and not result.refused
        assert result.n_total == GLOBAL_BATCH  # the batch counted once, not once per stage
        assert result.batch_sizes == {"s0": GLOBAL_BATCH, "s1": 0, "s2": 0}
    for board in boards:
        assert board.error is None and len(board.results) == 2
        for step, got in enumerate(board.results):  # stage 0's board's own (a group of one), as it sent it
            np.testing.assert_array_equal(got, _grad(step, 0, wire_dtype))


def _wrong_length(step: int, index: int) -> np.ndarray:
    return _grad(step, index)[:-1]


def _nan(step: int, index: int) -> np.ndarray:
    grad = _grad(step, index)
    grad[1] = np.nan
    return grad


@pytest.mark.parametrize("bad, n, why", [
    (_wrong_length, GLOBAL_BATCH, "pipeline stage 1 takes 6 values"),
    (_grad, GLOBAL_BATCH // 2, f"sent n={GLOBAL_BATCH // 2} for step 1; the split assigned it n={GLOBAL_BATCH}"),
    (_nan, GLOBAL_BATCH, "NaN or Inf in the gradient"),
])
def test_a_bad_stage_vector_is_refused_naming_the_board_and_the_step_cannot_complete(
        bad: Callable[[int, int], np.ndarray], n: int, why: str) -> None:
    """Board s1 sends a bad vector at step 1: refused naming it; the step refuses every stage's (none can be applied)."""
    async def main() -> tuple[list[StepResult | ExchangeError], list[np.ndarray], dict[str, list[str]]]:
        server = _server()
        port = await server.start("127.0.0.1", 0)
        def make(step: int, index: int) -> np.ndarray:
            return (bad if index == 1 and step == 1 else _grad)(step, index)

        def count(step: int, index: int) -> int:
            return n if index == 1 and step == 1 else GLOBAL_BATCH

        boards = [StageBoard(i, port, 2, make, count) for i in range(len(BOARDS))]
        applied: list[np.ndarray] = []
        results = await _steps(boards, server, 2, applied)
        return results, applied, server.flags()

    results, applied, flags = asyncio.run(main())
    assert isinstance(results[0], StepResult) and len(applied) == 1  # step 0 went through; step 1 was never applied
    failure = results[1]
    assert isinstance(failure, ExchangeError)
    assert "s1" in str(failure) and why in str(failure)
    assert any(f.startswith("step 1: refused") and why in f for f in flags["s1"])
    for other in ("s0", "s2"):  # refused because stage 1 is missing, which the refusal names
        assert any("lacks the gradient of stage 1 (board s1)" in f for f in flags[other])


def test_a_stage_that_leaves_fails_the_step_naming_it() -> None:
    async def main() -> list[StepResult | ExchangeError]:
        server = _server()
        port = await server.start("127.0.0.1", 0)
        def make(step: int, index: int) -> np.ndarray | None:
            return None if index == 2 and step == 1 else _grad(step, index)

        boards = [StageBoard(i, port, 2, make) for i in range(len(BOARDS))]
        return await _steps(boards, server, 2, [])

    results = asyncio.run(main())
    assert isinstance(results[0], StepResult) and isinstance(results[1], ExchangeError)
    assert "lacks the gradient of stage 2 (board s2)" in str(results[1])


def _hello(port: int, hello: Hello) -> Welcome | Refusal:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        send_frame(sock, hello.to_wire())
        return decode_hello_reply(recv_frame(sock))


def test_a_hello_must_give_its_own_stage_s_parameter_count() -> None:
    async def main() -> list[Welcome | Refusal]:
        server = _server()
        port = await server.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        try:
            return [await loop.run_in_executor(None, _hello, port, Hello(job_id="job", board_id="s1", token="secret",
                                                                         param_count=count))
                    for count in (FULL, ELEMENTS[0], ELEMENTS[1])]
        finally:
            await server.close()

    whole_model, other_stage, own = asyncio.run(main())
    for refusal, count in ((whole_model, FULL), (other_stage, ELEMENTS[0])):
        assert isinstance(refusal, Refusal)
        assert f"has {count} trainable parameters, the coordinator's {ELEMENTS[1]}" in refusal.message
    assert isinstance(own, Welcome) and own.step == 0


@pytest.mark.parametrize("changes, why", [
    ({"slots": [[(0, 0, 2), (2, 11, 2)], [(0, 1, 6)], SLOTS[2]]}, "board 0's and board 1's values both at offset 1"),
    ({"slots": [[(0, 0, 2), (2, 14, 2)], SLOTS[1], SLOTS[2]]}, "lies outside"),
    ({"slots": [[(0, 0, 2)], SLOTS[1], SLOTS[2]]}, "cover 2 of its 4 values"),
    ({"slots": [[(0, 0, 3), (2, 11, 2)], SLOTS[1], SLOTS[2]]}, "overlap at offset 2"),
    ({"elements": [4, 6]}, "3 boards' slots"),
    ({"global_batch": 0}, "must be positive"),
])
def test_a_layout_that_does_not_hold_together_is_refused(changes: dict[str, Any], why: str) -> None:
    with pytest.raises(ExchangeError, match=why):
        _layout(**changes)


def test_a_layout_that_does_not_match_the_job_is_refused() -> None:
    def welcome() -> tuple[int, Any, Any]:
        return 0, encode_value({}), encode_value({})

    with pytest.raises(ExchangeError, match=r"global batch of 32 between them .* not \[16, 16, 0\]"):
        ExchangeServer(job_id="job", token="t", boards=[("s0", 16), ("s1", 16), ("s2", 0)], param_count=FULL,
                       wire_dtype="float32", welcome_state=welcome, pipeline=_layout())
    with pytest.raises(ExchangeError, match="replica's 15 trainable parameters"):
        ExchangeServer(job_id="job", token="t", boards=BOARDS, param_count=FULL + 1, wire_dtype="float32",
                       welcome_state=welcome, pipeline=_layout())


def test_select_mode_takes_a_pipeline_alone() -> None:
    reducer, schedule = GradientReducer(FULL), SplitSchedule([b for _, b in BOARDS])
    boards = [BoardState(board_id=b, index=i, batch_size=n) for i, (b, n) in enumerate(BOARDS)]
    assert isinstance(select_mode(reducer, schedule, pipeline=_layout(), boards=boards), PipelineStages)
    for settings, named in (({"overlap": True}, "--overlap"), ({"aggregate": "median"}, "--aggregate median"),
                            ({"sync": SyncSchedule(every=4)}, "--sync-every"),
                            ({"accumulate": 2}, "--accumulate-grad-batches 2")):
        with pytest.raises(ExchangeError, match=named):
            select_mode(reducer, schedule, pipeline=_layout(), boards=boards, **settings)


def test_stage_0s_group_is_averaged_sample_weighted_and_each_of_its_boards_gets_the_average() -> None:
    boards = [("g0", 8), ("g1", 24), ("s1", 0), ("s2", 0)]  # stage 0 is two boards, 8 and 24 samples of 32
    layout = PipelineLayout(elements=[ELEMENTS[0], *ELEMENTS], slots=[SLOTS[0], *SLOTS], full_elements=FULL,
                            global_batch=GLOBAL_BATCH, group=2)
    vectors = {0: _grad(0, 0), 1: _grad(1, 0), 2: _grad(0, 1), 3: _grad(0, 2)}
    sizes = [8, 24, GLOBAL_BATCH, GLOBAL_BATCH]
    got: dict[int, np.ndarray] = {}

    def board(index: int, port: int) -> None:
        client = ExchangeClient("127.0.0.1", port)
        client.hello(job_id="job", board_id=boards[index][0], token="secret", param_count=layout.elements[index])
        got[index] = np.array(client.exchange(step=0, grad=vectors[index], n=sizes[index], loss=1.0, compute_s=0.01,
                                              result_elements=None if index < 2 else ELEMENTS[0]))
        client.close()

    async def main() -> list[np.ndarray]:
        server = ExchangeServer(job_id="job", token="secret", boards=boards, param_count=FULL, wire_dtype="float32",
                                welcome_state=lambda: (0, encode_value({}), encode_value({})), pipeline=layout)
        port = await server.start("127.0.0.1", 0)
        threads = [threading.Thread(target=board, args=(i, port), daemon=True) for i in range(4)]
        for thread in threads:
            thread.start()
        await server.wait_for_boards(10, need={b for b, _ in boards})
        applied: list[np.ndarray] = []
        result = await server.run_step(0, apply=lambda g, r: applied.append(g.copy()))
        await server.close()
        for thread in threads:
            thread.join(10)
        assert result.n_total == GLOBAL_BATCH and result.batch_sizes == {"g0": 8, "g1": 24, "s1": 0, "s2": 0}
        return applied

    (full,) = asyncio.run(main())
    average = vectors[0] * np.float32(8 / 32) + vectors[1] * np.float32(24 / 32)
    np.testing.assert_allclose(full[[0, 1, 11, 12]], average, rtol=1e-6)  # stage 0's slots: the weighted average
    np.testing.assert_array_equal(full[2:8], vectors[2])  # a later stage's: as it came
    for index in range(4):
        np.testing.assert_allclose(got[index], average, rtol=1e-6)  # every board is answered stage 0's average


def test_a_later_stage_group_is_averaged_by_its_boards_samples_and_each_of_its_boards_gets_its_stage_s_average() -> None:
    """Stage 1 is two boards (12 and 20 of the step's 32 samples): their vectors' sample-weighted average lands in stage
    1's slots and goes back to them, stage 0's (a group of two) to stage 0's boards, and stage 2's board is answered
    stage 0's as before."""
    boards = [("g0", 8), ("g1", 24), ("h0", 0), ("h1", 0), ("s2", 0)]
    layout = PipelineLayout(elements=[ELEMENTS[0], ELEMENTS[0], ELEMENTS[1], ELEMENTS[1], ELEMENTS[2]],
                            slots=[SLOTS[0], SLOTS[0], SLOTS[1], SLOTS[1], SLOTS[2]], full_elements=FULL,
                            global_batch=GLOBAL_BATCH, group=2, sizes=(2, 2, 1), rows=(8, 24, 12, 20, GLOBAL_BATCH))
    vectors = {0: _grad(0, 0), 1: _grad(1, 0), 2: _grad(0, 1), 3: _grad(1, 1), 4: _grad(0, 2)}
    answers = [ELEMENTS[0], ELEMENTS[0], ELEMENTS[1], ELEMENTS[1], ELEMENTS[0]]
    got: dict[int, np.ndarray] = {}
    lrs: dict[int, Any] = {}

    def board(index: int, port: int) -> None:
        client = ExchangeClient("127.0.0.1", port)
        client.hello(job_id="job", board_id=boards[index][0], token="secret", param_count=layout.elements[index])
        got[index] = np.array(client.exchange(step=0, grad=vectors[index], n=layout.rows[index], loss=1.0,
                                              compute_s=0.01, result_elements=answers[index]))
        lrs[index] = client.lrs
        client.close()

    async def main() -> list[np.ndarray]:
        server = ExchangeServer(job_id="job", token="secret", boards=boards, param_count=FULL, wire_dtype="float32",
                                welcome_state=lambda: (0, encode_value({}), encode_value({})), pipeline=layout)
        port = await server.start("127.0.0.1", 0)
        threads = [threading.Thread(target=board, args=(i, port), daemon=True) for i in range(len(boards))]
        for thread in threads:
            thread.start()
        await server.wait_for_boards(10, need={b for b, _ in boards})
        server.announce_lrs([0.25])  # a ReduceLROnPlateau's on the coordinator: every board's result carries it
        applied: list[np.ndarray] = []
        result = await server.run_step(0, apply=lambda g, r: applied.append(g.copy()))
        await server.close()
        for thread in threads:
            thread.join(10)
        assert not result.refused and result.n_total == GLOBAL_BATCH
        return applied

    (full,) = asyncio.run(main())
    stage0 = vectors[0] * np.float32(8 / 32) + vectors[1] * np.float32(24 / 32)
    stage1 = vectors[2] * np.float32(12 / 32) + vectors[3] * np.float32(20 / 32)
    np.testing.assert_allclose(full[[0, 1, 11, 12]], stage0, rtol=1e-6)
    np.testing.assert_allclose(full[2:8], stage1, rtol=1e-6)  # stage 1's slots: its group's weighted average
    np.testing.assert_array_equal(full[[9, 10, 13]], vectors[4])
    for index, want in ((0, stage0), (1, stage0), (2, stage1), (3, stage1), (4, stage0)):
        np.testing.assert_allclose(got[index], want, rtol=1e-6)
    assert all(lrs[index] == (0.25,) for index in range(len(boards))), lrs


def test_a_later_group_s_board_that_claims_other_samples_than_its_units_is_refused() -> None:
    boards = [("g0", GLOBAL_BATCH), ("h0", 0), ("h1", 0)]
    layout = PipelineLayout(elements=[ELEMENTS[0], ELEMENTS[1], ELEMENTS[1]], slots=[SLOTS[0], SLOTS[1], SLOTS[1]],
                            full_elements=FULL, global_batch=GLOBAL_BATCH, sizes=(1, 2), rows=(GLOBAL_BATCH, 16, 16))
    errors: dict[int, BaseException] = {}

    def board(index: int, port: int) -> None:
        client = ExchangeClient("127.0.0.1", port)
        client.hello(job_id="job", board_id=boards[index][0], token="secret", param_count=layout.elements[index])
        try:  # h1 claims 30 samples, to weigh its gradient as nearly the whole stage's
            client.exchange(step=0, grad=np.ones(layout.elements[index], np.float32), n=(16, 16, 30)[index] if index
                            else GLOBAL_BATCH, loss=1.0, compute_s=0.01, result_elements=(ELEMENTS[0], ELEMENTS[1],
                                                                                           ELEMENTS[1])[index])
        except (ExchangeRefused, StopTraining, OSError) as exc:
            errors[index] = exc
        client.close()

    async def main() -> StepResult | ExchangeError:
        server = ExchangeServer(job_id="job", token="secret", boards=boards, param_count=FULL, wire_dtype="float32",
                                welcome_state=lambda: (0, encode_value({}), encode_value({})), pipeline=layout)
        port = await server.start("127.0.0.1", 0)
        threads = [threading.Thread(target=board, args=(i, port), daemon=True) for i in range(len(boards))]
        for thread in threads:
            thread.start()
        await server.wait_for_boards(10, need={b for b, _ in boards})
        try:
            return await server.run_step(0, apply=lambda g, r: None)
        except ExchangeError as exc:
            return exc
        finally:
            await server.close()
            for thread in threads:
                thread.join(10)

    outcome = asyncio.run(main())
    refused = outcome.refused if isinstance(outcome, StepResult) else []
    assert isinstance(outcome, ExchangeError) or any(b == "h1" for b, _ in refused), outcome


SPARSE = StageSync(every=3, steps_per_epoch=100, total_steps=100)  # step 0: gradients; 2 and 5: state; else nothing
STATE_EXTRA = {1: 14, 2: 9}  # a stage's parameters and optimizer state after its gradient (the board's layout)


def _sparse(step: int, index: int) -> np.ndarray:
    """What stage ``index``'s board sends at ``step`` under :data:`SPARSE`."""
    grad = _grad(step, index)
    if index == 0 or SPARSE.kind(step) == GRAD:
        return grad
    if SPARSE.kind(step) == NOTHING:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate([grad, np.arange(STATE_EXTRA[index], dtype=np.float32) + 1000 * step + 100 * index])


def test_later_stages_that_send_their_state_at_checkpoints_send_nothing_between_and_their_state_is_kept() -> None:
    async def main() -> tuple[list[StepResult | ExchangeError], list[StageBoard], list[np.ndarray], list[dict[int, Any]]]:
        server = ExchangeServer(job_id="job", token="secret", boards=BOARDS, param_count=FULL, wire_dtype="float32",
                                welcome_state=lambda: (0, encode_value({"w": np.zeros(3, np.float32)}), encode_value({})),
                                pipeline=_layout(sync=SPARSE))
        mode = server.mode
        assert isinstance(mode, PipelineStages)
        port = await server.start("127.0.0.1", 0)
        boards = [StageBoard(i, port, 6, _sparse) for i in range(len(BOARDS))]
        applied: list[np.ndarray] = []
        states: list[dict[int, Any]] = []

        def apply(g: np.ndarray, r: StepResult) -> None:
            applied.append(g.copy())
            states.append(mode.take_states(r.step))

        for board in boards:
            board.start()
        await server.wait_for_boards(10, need={b for b, _ in BOARDS})
        results: list[StepResult | ExchangeError] = []
        try:
            for step in range(6):
                results.append(await server.run_step(step, apply=apply))
        finally:
            await server.close()
        for board in boards:
            board.join(10)
        return results, boards, applied, states

    results, boards, applied, states = asyncio.run(main())
    assert [SPARSE.kind(s) for s in range(6)] == [GRAD, NOTHING, STATE, NOTHING, NOTHING, STATE]
    assert all(isinstance(r, StepResult) and r.contributors == ["s0", "s1", "s2"] for r in results), results
    for step in range(6):
        expected = _scattered(step, "float32")
        if SPARSE.kind(step) == NOTHING:  # the later stages' slots stay 0: the replica leaves them out of the step
            expected[2:8] = 0.0
            expected[9:11] = 0.0
            expected[13] = 0.0
        np.testing.assert_array_equal(applied[step], expected)
        if SPARSE.kind(step) == STATE:
            assert sorted(states[step]) == [1, 2]
            for stage in (1, 2):
                np.testing.assert_array_equal(states[step][stage], _sparse(step, stage)[ELEMENTS[stage]:])
        else:
            assert states[step] == {}
    assert all(board.error is None and len(board.results) == 6 for board in boards)


def test_a_later_stage_that_sends_its_gradient_where_it_owes_nothing_is_refused() -> None:
    async def main() -> list[StepResult | ExchangeError]:
        server = ExchangeServer(job_id="job", token="secret", boards=BOARDS, param_count=FULL, wire_dtype="float32",
                                welcome_state=lambda: (0, encode_value({"w": np.zeros(3, np.float32)}), encode_value({})),
                                pipeline=_layout(sync=SPARSE))
        port = await server.start("127.0.0.1", 0)
        boards = [StageBoard(i, port, 2, _grad) for i in range(len(BOARDS))]  # a gradient at step 1 too
        return await _steps(boards, server, 2, [])

    results = asyncio.run(main())
    assert isinstance(results[0], StepResult)
    assert isinstance(results[1], ExchangeError) and "takes no values at this step" in str(results[1]), results
