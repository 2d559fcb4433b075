"""A plain histogram of durations, rendered as a Prometheus histogram at scrape time.

prometheus_client's ``Histogram`` keeps every label set it was given for the life of the process;
the training collector renders its own families at each scrape instead (as the fleet collector
does), so it keeps its observations here.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client.core import HistogramMetricFamily

# Step and compute times run from milliseconds (a small model on a fast board) to minutes (a large
# one on a Pi, a step with validation): a 1-2.5-5 ladder over that span.
BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)


@dataclass(slots=True)
class StepHistogram:
    """Counts per bucket (not cumulative), the sum and the count of the durations observed."""

    bounds: tuple[float, ...] = BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))  # the last: above every bound
    sum_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum_s += seconds

    def copy(self) -> StepHistogram:
        return StepHistogram(self.bounds, list(self.counts), self.sum_s)

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs, ``+Inf`` last, as Prometheus reads them."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out

    def add_to(self, family: HistogramMetricFamily, labels: Sequence[str]) -> None:
        family.add_metric(list(labels), self.buckets(), self.sum_s)

    def family(self, name: str, text: str, label_names: Sequence[str], labels: Sequence[str]) -> HistogramMetricFamily:
        """A family holding this histogram alone."""
        family = HistogramMetricFamily(name, text, labels=list(label_names))
        self.add_to(family, labels)
        return family


__all__ = ["BUCKETS_S", "StepHistogram"]
