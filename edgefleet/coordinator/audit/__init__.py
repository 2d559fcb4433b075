"""Audits by recomputation (global data mode): a board's gradient for a step, computed again on the coordinator.

``schedule`` (when each board is audited), ``recompute`` (its vector again, on the replica),
``auditor`` (taking copies from the exchange and comparing), ``audit_scope`` (which runs can be
audited) and ``rollback`` (a run that goes back past a board that failed, and on without it).
"""
