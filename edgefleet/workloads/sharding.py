"""Which samples each board trains on at each step.

:class:`GlobalBatchPlan` is for data every board holds (built-ins, or the same file everywhere).
Step ``t`` has one global batch of ``B`` samples, drawn from a permutation that depends only on
``seed`` and the epoch; board ``i`` takes a contiguous slice of it of its own batch size ``b_i``.
The global batch therefore does not depend on how it is split, and since the reducer returns
``sum(b_i * g_i) / B`` (each ``g_i`` a mean gradient) the update equals one process training on
the whole global batch: the same seed trains the same model on 1 board or on 5.

:class:`LocalBatchPlan` is for data that lives only on each board (an ``npz`` file per board):
each board shuffles its own samples with its own seed. The step is still the DDP update over the
union of the boards' batches, but the global batch now depends on which boards take part.

Steps are numbered globally from 0, so a plan needs no state: resuming at step ``t`` (from a
checkpoint's data cursor) or re-splitting at a step boundary gives the same samples as never stopping.

Re-splitting during a run (the coordinator re-balancing batch sizes when a board slows down) goes
through the ends' one ``protocol.split_schedule.SplitSchedule``: the split of each step, the plan's
own until the first ``BatchSplit`` and each split from its ``from_step`` on.
:meth:`GlobalBatchPlan.indices_under` divides a step's global batch as the schedule says then; a
:class:`BoardBatchSampler` asks for a step's indices only when the DataLoader draws that step, so a
split announced before that moment takes effect exactly at its step; one announced later is
refused (``SplitRefused``), because the board would already hold the wrong samples.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils.data import Sampler

from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.exchange_frames import BatchSplit
from edgefleet.protocol.split_schedule import SplitSchedule


def _epoch_permutation(dataset_len: int, seed: int) -> torch.Tensor:
    # An explicit CPU generator: the permutation must not depend on the global RNG, the device or
    # the number of threads, or boards would disagree.
    return torch.randperm(dataset_len, generator=torch.Generator().manual_seed(seed))


class _PermutationCache:
    """Remembers the last epoch's permutation: consecutive steps mostly share an epoch."""

    def __init__(self, dataset_len: int) -> None:
        self._dataset_len = dataset_len
        self._seed: int | None = None
        self._permutation = torch.empty(0, dtype=torch.int64)

    def get(self, seed: int) -> torch.Tensor:
        if seed != self._seed:
            self._permutation = _epoch_permutation(self._dataset_len, seed)
            self._seed = seed
        return self._permutation


class GlobalBatchPlan:
    """The global batch of every step, and each board's slice of it.

    Step ``t`` is in epoch ``t // steps_per_epoch``; that epoch's permutation is
    ``torch.randperm(dataset_len, generator=torch.Generator().manual_seed(seed + epoch))``; the
    global batch is its ``k``-th block of ``B = sum(batch_sizes)`` indices (``k = t % steps_per_epoch``),
    and board ``i`` takes positions ``[sum(b[:i]), sum(b[:i+1]))`` of that block.

    ``B`` is fixed for the plan's life; :meth:`with_split` re-divides it among boards (re-balancing,
    or a board leaving) at a step boundary.

    Args:
        dataset_len: Number of samples in the (train) dataset.
        batch_sizes: Each board's batch size, in board-index order; all at least 1.
        seed: Training seed; the same on every board.
        drop_last: Drop the incomplete last block of each epoch (default). With False, the last
            step of an epoch has fewer than ``B`` samples and the boards' slices are cut short
            (trailing boards may get none): weight each board by ``len(indices(...))``.

    Raises:
        ConfigError: Bad batch sizes, or a dataset smaller than one global batch with ``drop_last``.
    """

    def __init__(self, dataset_len: int, batch_sizes: Sequence[int], seed: int, drop_last: bool = True) -> None:
        sizes = [int(b) for b in batch_sizes]
        if not sizes or any(b < 1 for b in sizes):
            raise ConfigError(f"batch sizes {list(batch_sizes)} must be a non-empty list of integers >= 1")
        global_batch = sum(sizes)
        if dataset_len < 1 or (drop_last and dataset_len < global_batch):
            raise ConfigError(f"the dataset has {dataset_len} samples, fewer than one global batch of {global_batch}")
        self.dataset_len = int(dataset_len)
        self.batch_sizes: tuple[int, ...] = tuple(sizes)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.global_batch_size = global_batch
        # offsets[i] is where board i's slice starts inside the global batch; offsets[-1] == B.
        self.offsets: tuple[int, ...] = tuple(itertools.accumulate(sizes, initial=0))
        self._permutations = _PermutationCache(self.dataset_len)
        self._splits: dict[tuple[int, ...], GlobalBatchPlan] = {}  # indices_under's re-divided plans

    @property
    def num_boards(self) -> int:
        """Number of boards the global batch is split across."""
        return len(self.batch_sizes)

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per pass over the data."""
        full, rest = divmod(self.dataset_len, self.global_batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def epoch_of(self, step: int) -> int:
        """The epoch that global step ``step`` belongs to."""
        return _check_step(step) // self.steps_per_epoch

    def global_indices(self, step: int) -> list[int]:
        """Dataset indices of step ``step``'s whole global batch (identical for every split)."""
        epoch, block = divmod(_check_step(step), self.steps_per_epoch)
        start = block * self.global_batch_size
        return self._permutations.get(self.seed + epoch)[start:start + self.global_batch_size].tolist()

    def indices(self, step: int, board_index: int) -> list[int]:
        """Dataset indices board ``board_index`` trains on at step ``step``.

        Concatenating these over all boards, in board order, gives :meth:`global_indices`.
        """
        if not 0 <= board_index < self.num_boards:
            raise IndexError(f"board_index {board_index} is outside 0..{self.num_boards - 1}")
        return self.global_indices(step)[self.offsets[board_index]:self.offsets[board_index + 1]]

    def indices_under(self, schedule: SplitSchedule, step: int, board_index: int) -> list[int]:
        """Board ``board_index``'s indices at ``step``, the global batch divided as ``schedule`` says then.

        From now on ``step`` can no longer be re-split (``schedule.mark_drawn``).
        """
        schedule.mark_drawn(step)
        sizes = tuple(schedule.batch_sizes_at(step))
        if sizes == self.batch_sizes:
            return self.indices(step, board_index)
        plan = self._splits.get(sizes)
        if plan is None:
            plan = self._splits[sizes] = self.with_split(sizes)
        return plan.indices(step, board_index)

    def with_split(self, batch_sizes: Sequence[int]) -> GlobalBatchPlan:
        """A plan with the same global batches, divided among boards as ``batch_sizes``.

        The number of boards may change; the total may not, or the step-to-samples mapping would.

        Raises:
            ConfigError: ``sum(batch_sizes)`` differs from the global batch size.
        """
        if sum(int(b) for b in batch_sizes) != self.global_batch_size:
            raise ConfigError(f"batch sizes {list(batch_sizes)} sum to {sum(batch_sizes)}, but this plan's global "
                              f"batch is {self.global_batch_size}; a re-split must keep the total")
        return GlobalBatchPlan(self.dataset_len, batch_sizes, self.seed, self.drop_last)

    def __repr__(self) -> str:
        return (f"GlobalBatchPlan(dataset_len={self.dataset_len}, batch_sizes={list(self.batch_sizes)}, "
                f"seed={self.seed}, drop_last={self.drop_last})")


class LocalBatchPlan:
    """One board's batches when each board holds its own data (documented, not split-invariant).

    The board shuffles its own ``dataset_len`` samples each epoch with a permutation seeded from
    ``(seed, board_seed, epoch)`` and takes consecutive blocks of ``batch_size`` (the incomplete
    last block of an epoch is dropped). Boards with different data sizes have different epoch
    lengths; steps are still numbered globally, so step ``t`` is well defined on every board.

    Unlike :class:`GlobalBatchPlan`, the global batch is the union of whatever the boards drew, so
    the trained model depends on the fleet; the DDP update itself is unchanged.

    Args:
        dataset_len: Number of samples on this board.
        batch_size: This board's batch size.
        seed: Training seed, shared by the fleet.
        board_seed: Distinguishes this board's shuffle, e.g. its board index or a hash of its id.
    """

    def __init__(self, dataset_len: int, batch_size: int, seed: int, board_seed: int) -> None:
        if batch_size < 1 or dataset_len < batch_size:
            raise ConfigError(f"the board's dataset has {dataset_len} samples, fewer than its batch size {batch_size}")
        self.dataset_len = int(dataset_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.board_seed = int(board_seed)
        self._permutations = _PermutationCache(self.dataset_len)

    @property
    def steps_per_epoch(self) -> int:
        """This board's batches per pass over its data."""
        return self.dataset_len // self.batch_size

    def epoch_of(self, step: int) -> int:
        """This board's epoch at global step ``step``."""
        return _check_step(step) // self.steps_per_epoch

    def indices(self, step: int) -> list[int]:
        """Local dataset indices this board trains on at step ``step``."""
        epoch, block = divmod(_check_step(step), self.steps_per_epoch)
        start = block * self.batch_size
        permutation = self._permutations.get(_mix_seed(self.seed, self.board_seed, epoch))
        return permutation[start:start + self.batch_size].tolist()

    def __repr__(self) -> str:
        return (f"LocalBatchPlan(dataset_len={self.dataset_len}, batch_size={self.batch_size}, seed={self.seed}, "
                f"board_seed={self.board_seed})")


def _mix_seed(*parts: int) -> int:
    # A hash rather than a sum: seed + board_seed + epoch would give board 1 in epoch 0 the same
    # shuffle as board 0 in epoch 1.
    digest = hashlib.blake2b(b",".join(str(p).encode() for p in parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1   # 63 bits: fits Generator.manual_seed


def _check_step(step: int) -> int:
    if step < 0:
        raise ValueError(f"step {step} is negative")
    return int(step)


class StepBatchSampler(Sampler[list[int]]):
    """A batch sampler over a window of global steps: yields one list of indices per step.

    One iteration covers steps ``start_step .. start_step + num_steps - 1``; iterating again repeats
    the same window (there is no ``set_epoch``: steps, not Lightning epochs, pick the data). Give it
    all the steps of a run and let the Trainer stop at ``max_steps``, or build a new one per window.

    Args:
        indices_of_step: Maps a global step to this board's dataset indices.
        start_step: First global step.
        num_steps: Number of steps.
    """

    def __init__(self, indices_of_step: Callable[[int], list[int]], start_step: int, num_steps: int) -> None:
        super().__init__()
        if start_step < 0 or num_steps < 0:
            raise ValueError(f"start_step = {start_step} and num_steps = {num_steps} must be >= 0")
        self._indices_of_step = indices_of_step
        self.start_step = int(start_step)
        self.num_steps = int(num_steps)

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.start_step + self.num_steps):
            yield self._indices_of_step(step)

    def __len__(self) -> int:
        return self.num_steps


class BoardBatchSampler(StepBatchSampler):
    """Board ``board_index``'s batches of a :class:`GlobalBatchPlan`, for ``DataLoader(batch_sampler=...)``.

    Each step's indices come from the plan divided as the sampler's ``SplitSchedule`` says when the
    DataLoader draws that step (lazily), so :meth:`resplit` changes this board's slice from a given
    step on.
    Lightning's fetcher may draw one batch ahead of the step it trains (it does for loaders without
    ``len()``): a split must be known before the board finishes the step two before it, which is
    how early the exchange announces it.

    Args:
        plan: The fleet's plan.
        board_index: This board's position in ``plan.batch_sizes``.
        start_step: First global step (the checkpoint's data cursor when resuming).
        num_steps: Number of steps; default: to the end of ``start_step``'s epoch.
        schedule: The split schedule to follow (default: a new one over ``plan``).
    """

    def __init__(self, plan: GlobalBatchPlan, board_index: int, start_step: int = 0, num_steps: int | None = None,
                 *, schedule: SplitSchedule | None = None) -> None:
        if not 0 <= board_index < plan.num_boards:
            raise IndexError(f"board_index {board_index} is outside 0..{plan.num_boards - 1}")
        if num_steps is None:
            num_steps = plan.steps_per_epoch - start_step % plan.steps_per_epoch
        self.schedule = schedule if schedule is not None else SplitSchedule(plan.batch_sizes)
        super().__init__(functools.partial(plan.indices_under, self.schedule, board_index=board_index), start_step, num_steps)
        self.plan = plan
        self.board_index = board_index

    def resplit(self, from_step: int, batch_sizes: Sequence[int]) -> BatchSplit:
        """Follow a re-split from ``from_step`` on (see ``SplitSchedule.add``)."""
        return self.schedule.add(from_step, batch_sizes)

    def batch_size_at(self, step: int) -> int:
        """This board's batch size at ``step``."""
        return self.schedule.batch_sizes_at(step)[self.board_index]


class LocalBatchSampler(StepBatchSampler):
    """This board's batches of a :class:`LocalBatchPlan`, for ``DataLoader(batch_sampler=...)``.

    Args:
        plan: This board's plan.
        start_step: First global step.
        num_steps: Number of steps; default: to the end of ``start_step``'s epoch on this board.
    """

    def __init__(self, plan: LocalBatchPlan, start_step: int = 0, num_steps: int | None = None) -> None:
        if num_steps is None:
            num_steps = plan.steps_per_epoch - start_step % plan.steps_per_epoch
        super().__init__(plan.indices, start_step, num_steps)
        self.plan = plan


__all__ = ["BoardBatchSampler", "GlobalBatchPlan", "LocalBatchPlan", "LocalBatchSampler", "StepBatchSampler"]
