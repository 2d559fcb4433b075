"""The gradient exchange: one TCP (or TLS) connection per board, one round per step.

``exchange.server`` is the public face (``ExchangeServer``, ``StepResult``, ``ExchangeError``) and
composes the parts: ``exchange.admission`` (listening, TLS, hello, credential, intruders, welcome),
``exchange.board_state`` (the per-board record and the roster), ``exchange.step_round`` (a step's
time: arrivals, the deadline, sending the result), ``exchange.step_sum`` (a step's arithmetic: the
fold, the reduce, the step's record), ``exchange.modes`` (what a step exchanges: dense exact,
overlap, periodic averaging, robust aggregates, pipeline stages; the one interface every variant
implements), ``exchange.pipeline_layout`` (where a pipeline stage's gradient lands in the replica's vector),
``exchange.robust_reduce`` (the robust rules) and
``exchange.gradient_reduce`` (the arithmetic of the reduce)."""

__all__: list[str] = []
