"""Prometheus metrics of the fleet and of a training run: ``edge-coordinator exporter`` and ``train --metrics-listen``.

:mod:`.telemetry_metrics` maps telemetry fields to gauges, :mod:`.board_counters` folds the boards'
rates into counters as samples arrive, :mod:`.fleet_collector` renders the live fleet view at each
scrape, :mod:`.training_metrics` a run's counters, histograms and last step (:mod:`.step_histogram`),
and :mod:`.metrics_server` serves them over HTTP. The collectors import prometheus-client (the
``[coordinator]`` extra); this package's surface below does not, so a missing package is reported
by :func:`serve_fleet_metrics` with the pip command instead of an ImportError.
"""

from __future__ import annotations

from edgefleet.coordinator.exporter.metrics_server import (
    DEFAULT_LISTEN,
    DEFAULT_METRICS_PORT,
    LISTEN_HELP,
    MetricsEndpoint,
    parse_listen,
    serve_fleet_metrics,
)
from edgefleet.coordinator.exporter.telemetry_metrics import NAMED_FIELDS, FieldMetric, metric_for

__all__ = ["DEFAULT_LISTEN", "DEFAULT_METRICS_PORT", "LISTEN_HELP", "NAMED_FIELDS", "FieldMetric", "MetricsEndpoint", "metric_for",
           "parse_listen", "serve_fleet_metrics"]
