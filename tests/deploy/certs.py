"""A throw-away CA and a broker certificate for 127.0.0.1, made with the openssl command."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.deploy.tools import run, tool


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def make_broker_certificate(directory: Path, *, address: str = "127.0.0.1") -> TlsFiles:
    """A CA, and a certificate signed by it whose subjectAltName is ``address`` (valid two days)."""
    openssl = tool("openssl")
    d = directory
    d.mkdir(parents=True, exist_ok=True)
    run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"), "-days", "2", "-subj", "/CN=edgefleet test CA",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"], timeout_s=60)
    run([openssl, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(d / "broker.key"), "-out", str(d / "broker.csr"), "-subj", f"/CN={address}"], timeout_s=60)
    (d / "broker.ext").write_text(f"subjectAltName=IP:{address}\nbasicConstraints=CA:FALSE\n"
                                  "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n")
    run([openssl, "x509", "-req", "-in", str(d / "broker.csr"), "-CA", str(d / "ca.crt"), "-CAkey", str(d / "ca.key"),
         "-CAcreateserial", "-out", str(d / "broker.crt"), "-days", "2", "-extfile", str(d / "broker.ext")], timeout_s=60)
    return TlsFiles(ca=d / "ca.crt", cert=d / "broker.crt", key=d / "broker.key")
