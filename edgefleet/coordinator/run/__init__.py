"""A training run: the driver (``training``), the job it sends (``train_job``, ``job_spec``), the
coordinator's replica of the model, checkpoints, the batch split and re-balancing, the run's logger,
``train --auto`` and the demo's fleet. It uses the exchange (``coordinator.exchange``), the control
side (``coordinator.control``) and, for ``--auto``, planning."""

__all__: list[str] = []
