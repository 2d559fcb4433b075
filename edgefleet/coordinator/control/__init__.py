"""The control side over MQTT: the fleet view (``fleet``, ``monitor``), the fleet's snapshot and the
boards that can train (``fleet_select``), commands and job events on one board's channel (``board_channel``) and the
fleet's power meter. No training and no torch here."""

__all__: list[str] = []
