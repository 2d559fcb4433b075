"""``edge-agent``: runs on every board. Imports no torch until a job starts."""

__all__: list[str] = []
