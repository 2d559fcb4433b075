"""A coordinator that cannot connect to a TLS broker says why, in the error itself: ``mqtts://`` with a CA
that did not sign the broker's certificate names the CA file and the failed verification (not "the MQTT
handshake failed"), and ``mqtt://`` to a TLS port says the port speaks TLS (not "see the warning above"
with no warning above). A real Mosquitto TLS listener and the real ``edge-coordinator status``."""

from __future__ import annotations

from pathlib import Path

from edgefleet.brokers.local_broker import start_mosquitto
from tests.deploy.certs import make_broker_certificate
from tests.helpers import coordinator


def test_a_wrong_ca_and_a_plain_url_to_a_tls_port_each_say_what_is_wrong(tmp_path: Path) -> None:
    files = make_broker_certificate(tmp_path / "tls")
    other = make_broker_certificate(tmp_path / "other")  # a CA that did not sign the broker's certificate
    tls = f"cafile {files.ca}\ncertfile {files.cert}\nkeyfile {files.key}\n"
    with start_mosquitto(extra_config=tls) as broker:
        conf = tmp_path / "coordinator.toml"
        conf.write_text(f'[broker]\ntls_ca_file = "{other.ca}"\n')
        wrong_ca = coordinator("--config", str(conf), "--broker", f"mqtts://127.0.0.1:{broker.port}", "status",
                               "--json", "--wait", "1")
        plain = coordinator("--broker", f"mqtt://127.0.0.1:{broker.port}", "status", "--json", "--wait", "1")
    assert wrong_ca.returncode != 0 and "Traceback" not in wrong_ca.stderr
    error = wrong_ca.stderr.strip().splitlines()[-1]
    assert f"does not verify against {other.ca}" in error and "certificate verify failed" in error, wrong_ca.stderr
    assert "broker.tls_ca_file" in error
    assert plain.returncode != 0 and "Traceback" not in plain.stderr
    error = plain.stderr.strip().splitlines()[-1]
    assert f"127.0.0.1:{broker.port} speaks TLS: use mqtts://127.0.0.1:{broker.port}" in error, plain.stderr
    assert "see the warning above" not in plain.stderr
