"""Whether a run's boards can be audited by recomputation, and if not, why (said once, before any board starts).

The coordinator can compute a board's vector again only where it holds what the board held and can
run what the board ran without changing its own replica (``coordinator.audit.recompute``):

* global data mode: in local data mode each board's data is its own (robust aggregation is the
  defence there, not an audit);
* every step exact (``--sync-every 1``), no layer placement, one batch per step, 32-bit precision:
  a local step's vector, a placed run's activations, an accumulated window or a gradient scaler are
  not one ``training_step``'s backward;
* automatic optimization, and no module hook that runs on the boards between the batch's start and
  the exchange (``on_train_batch_start``, ``on_before_backward``, ``on_after_backward``,
  ``on_before_zero_grad``): running it again on the replica could change its state, and leaving it
  out could change the gradient;
* a ``training_step`` that stores nothing on the module (``coordinator.run.replica_replay``): it
  runs again on the replica's own instance.
"""

from __future__ import annotations

from typing import Any

from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.coordinator.run.replica_replay import replay_reason, stores_on_module, user_function

BOARD_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_zero_grad")


def why_not_audited(spec: JobSpec, model: Any) -> str:
    """Why this run's boards cannot be audited ("": they can), as the run's note says it."""
    if spec.audit_share <= 0:
        return "audits are off (--audit-share 0)"
    reasons = [why for why, applies in (
        ("in --data-mode local each board's data is its own", spec.data_mode != "global"),
        (f"--sync-every {spec.sync_every} averages parameters, not gradients", spec.sync_every > 1),
        (f"--placement {spec.placement} sends activations", bool(spec.placement)),
        ("--pipeline: each board sends its own stage's gradient", bool(spec.pipeline)),
        (f"--accumulate-grad-batches {spec.accumulate_grad_batches} sums several batches", spec.accumulate_grad_batches != 1),
        (f"--precision {spec.precision}", spec.precision not in ("32", "32-true")),
    ) if applies]
    if reasons:
        return f"the boards' gradients are not audited: {'; '.join(reasons)}"
    name = type(model).__name__
    if not getattr(model, "automatic_optimization", True):
        return f"the boards' gradients are not audited: {name} optimizes manually"
    hooks = [hook for hook in BOARD_HOOKS if user_function(model, hook) is not None]
    if hooks:
        return (f"the boards' gradients are not audited: {name}.{hooks[0]} runs on the boards between the batch and the "
                "exchange, and the coordinator would have to run it again on its own copy")
    step = user_function(model, "training_step")
    if step is None or stores_on_module(model, step) or replay_reason(model):
        return (f"the boards' gradients are not audited: {name}.training_step keeps values on the module, and the "
                "coordinator would run it again on its own copy")
    return ""


__all__ = ["BOARD_HOOKS", "why_not_audited"]
