"""``edge-coordinator``, by concern: ``control`` (the fleet over MQTT), ``exchange`` (the gradient
exchange), ``run`` (a training run), ``planning`` (profiles, the cost model, plans), ``cli``,
``report`` and ``exporter``. docs/architecture.md maps them and the directions of their imports."""

__all__: list[str] = []
