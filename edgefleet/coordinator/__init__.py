"""``edge-coordinator``: the control side (fleet view, and later profiler, planner, exchange, training)."""

__all__: list[str] = []
