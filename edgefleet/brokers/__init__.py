"""MQTT brokers for development, the demo, the lab and the tests: a private Mosquitto on 127.0.0.1
(``local_broker``) or, where Mosquitto is not installed, an in-process one (``embedded_broker``).
Production fleets run Mosquitto from the Ansible broker role; nothing here is on that path."""

__all__: list[str] = []
