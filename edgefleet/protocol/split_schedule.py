"""Which batch split applies from which step: the job's own batch sizes, then every re-split announced.

Re-splitting the global batch re-balances it when a board slows down. A re-split
(:class:`~edgefleet.protocol.exchange_frames.BatchSplit`: from which step, each board's batch size
by board index) keeps the global batch and the number of boards and gives every board at least one
sample. One announced in the result of step ``t`` takes effect at step ``t + SPLIT_LEAD_STEPS``:
when that result arrives, a board has trained on step ``t`` and its data loader may already have
drawn the batch of step ``t + 1``.

Both ends keep one :class:`SplitSchedule`: the coordinator's exchange announces re-splits through
it (and lists them in a joining board's welcome), a board follows them (``workloads.sharding``
draws each step's samples as the schedule divides them, and marks the step drawn). The rules are
the same on both ends, and a split that breaks them raises :class:`SplitRefused`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from edgefleet.protocol.errors import ProtocolError
from edgefleet.protocol.exchange_frames import BatchSplit

log = logging.getLogger(__name__)

# A split announced in the avg frame of step t takes effect at step t + SPLIT_LEAD_STEPS. When that
# frame arrives the board has trained on step t, and Lightning's fetcher may already have drawn
# step t + 1: it prefetches one batch to learn whether it is the last, whenever the loader has no
# len() (Lightning 2.6 skips it for sized loaders such as the worker's). Step t + 2 is drawn after
# the frame in every case. tests/workloads/test_sharding.py measures the fetcher's lead with the
# installed Lightning; a board refuses a split for a step it has already drawn (SplitRefused).
SPLIT_LEAD_STEPS = 2


class SplitRefused(ProtocolError):
    """A re-split that would change the global batch or the number of boards, leave a board empty,
    come before a later one, or come after a board drew the samples of its first step."""


def split_step(next_result_step: int) -> int:
    """The step a split announced with the result of ``next_result_step`` takes effect at."""
    return next_result_step + SPLIT_LEAD_STEPS


class SplitSchedule:
    """The job's batch sizes and its re-splits, in step order.

    Adding a split the schedule already holds is a no-op (a board may learn of one both from its
    welcome and from the next step's result); one from the same step as the last replaces it (a
    correction before the step was drawn). The schedule remembers the highest step whose samples
    were drawn (:attr:`drawn_through`, set by :meth:`mark_drawn`) and refuses a split for that step
    or an earlier one.

    Args:
        batch_sizes: each board's batch size at step 0, by board index.
        splits: re-splits already in force or announced (a resumed run's, a welcome's), in step order.
            The exchange still passes ``(from_step, batch sizes)`` pairs too; everything else passes
            :class:`BatchSplit`.

    Raises:
        SplitRefused: a split that breaks the rules of :meth:`checked`.
    """

    def __init__(self, batch_sizes: Sequence[int], splits: Iterable[BatchSplit] = ()) -> None:
        self._initial = tuple(int(b) for b in batch_sizes)
        self._global_batch = sum(self._initial)
        self._splits: list[BatchSplit] = []
        self.drawn_through = -1
        for split in splits:
            self.add(split.from_step, split.batch_sizes)

    @property
    def initial(self) -> tuple[int, ...]:
        """Each board's batch size before the first re-split."""
        return self._initial

    def checked(self, from_step: int, batch_sizes: Sequence[int]) -> BatchSplit:
        """A split from ``from_step`` on, if it keeps the global batch and the number of boards, gives
        every board a sample, comes in step order and after the last step drawn.

        Raises:
            SplitRefused: it does not.
        """
        sizes = tuple(int(b) for b in batch_sizes)
        if len(sizes) != len(self._initial) or min(sizes, default=0) < 1 or sum(sizes) != self._global_batch:
            raise SplitRefused(f"re-split {list(sizes)} (sum {sum(sizes)}) must give each of the {len(self._initial)} boards "
                               f"at least one sample and keep the global batch of {self._global_batch}")
        if from_step <= self.drawn_through:
            raise SplitRefused(f"a re-split from step {from_step} arrived after this board drew the samples of "
                               f"step {self.drawn_through}; the coordinator must announce it earlier")
        if self._splits and from_step < self._splits[-1].from_step:
            raise SplitRefused(f"a re-split from step {from_step} would come before the one from step "
                               f"{self._splits[-1].from_step}: splits must come in step order")
        return BatchSplit(int(from_step), sizes)

    def add(self, from_step: int, batch_sizes: Sequence[int]) -> BatchSplit:
        """Schedule a re-split (a known one again: nothing changes). Returns it.

        Raises:
            SplitRefused: see :meth:`checked`.
        """
        known = BatchSplit(int(from_step), tuple(int(b) for b in batch_sizes))
        if known in self._splits:
            return known
        split = self.checked(from_step, batch_sizes)
        if self._splits and self._splits[-1].from_step == split.from_step:
            self._splits.pop()  # announced twice between two steps: the later one wins
        self._splits.append(split)
        log.debug("batch sizes %s from step %d", list(split.batch_sizes), split.from_step)  # the run and the worker say it at INFO
        return split

    def mark_drawn(self, step: int) -> None:
        """The samples of ``step`` were drawn: from now on ``step`` can no longer be re-split."""
        self.drawn_through = max(self.drawn_through, int(step))

    @property
    def splits(self) -> list[BatchSplit]:
        """Every re-split announced (or restored), in step order."""
        return list(self._splits)

    def splits_from(self, step: int) -> list[BatchSplit]:
        """The splits a board starting at ``step`` needs: the one in force then, and any later ones."""
        first = 0
        for i, split in enumerate(self._splits):
            if split.from_step <= step:
                first = i
        return self._splits[first:]

    def batch_sizes_at(self, step: int) -> list[int]:
        """Every board's batch size at ``step``, by board index."""
        return list(self._sizes_at(step))

    def batch_size_at(self, step: int, index: int) -> int:
        """Board ``index``'s batch size at ``step`` (the exchange asks once per gradient: no list is made)."""
        return self._sizes_at(step)[index]

    def _sizes_at(self, step: int) -> Sequence[int]:
        sizes: Sequence[int] = self._initial
        for split in self._splits:
            if split.from_step <= step:
                sizes = split.batch_sizes
        return sizes


__all__ = ["SPLIT_LEAD_STEPS", "SplitRefused", "SplitSchedule", "split_step"]
