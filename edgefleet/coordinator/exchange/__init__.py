"""The gradient exchange: one TCP (or TLS) connection per board, one round per step
(``exchange.server``), and the arithmetic of the reduce (``exchange.gradient_reduce``)."""

__all__: list[str] = []
