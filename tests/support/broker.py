"""A real mosquitto on a loopback port for the fleet tests, and a test PKI made with
`cryptography`: a CA, a server certificate for 127.0.0.1 and client certificates whose common
name is the MQTT username (`use_identity_as_username`), so that the ACL's `%u` is the device id.

    broker = Mosquitto(tmp_path)                       # plain TCP, anonymous
    broker = Mosquitto(tmp_path, pki=make_pki(tmp_path / "pki", ["dev-1", "operator"]))
    broker.restart(); broker.stop()
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
OPERATOR = "operator"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- PKI


@dataclass(frozen=True)
class Pki:
    dir: Path
    ca: Path

    def cert(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _issue(
    ca_key: ec.EllipticCurvePrivateKey | None,
    ca_name: x509.Name | None,
    name: str,
    *,
    is_ca: bool = False,
    server: bool = False,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_name or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if is_ca:
        usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
        builder = builder.add_extension(usage, critical=True)
    else:
        eku = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
    if server:
        san = x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        )
        builder = builder.add_extension(san, critical=False)
    return key, builder.sign(ca_key or key, hashes.SHA256())


def make_pki(directory: Path, clients: list[str]) -> Pki:
    """A CA, a server certificate for localhost/127.0.0.1, one client certificate per name."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _issue(None, None, "edge-agent test CA", is_ca=True)
    pki = Pki(directory, directory / "ca.crt")
    pki.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    for name, server in [("server", True), *((c, False) for c in clients)]:
        key, cert = _issue(ca_key, ca_cert.subject, name, server=server)
        _write_key(pki.key(name), key)
        pki.cert(name).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return pki


# ----------------------------------------------------------------------------- broker


class Mosquitto:
    """mosquitto on 127.0.0.1:<free port> with a generated config; persistence on, so that
    retained messages and persistent sessions survive `restart()` as on a real broker."""

    def __init__(
        self,
        tmp: Path,
        pki: Pki | None = None,
        max_packet_bytes: int = 0,
        users: dict[str, str] | None = None,
    ) -> None:
        self.dir = tmp / "mosquitto"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.pki = pki
        self.conf = self.dir / "mosquitto.conf"
        lines = [
            # run as whoever runs the tests: as root, mosquitto would switch to the user
            # "mosquitto", which cannot write this temporary directory
            f"user {pwd.getpwuid(os.getuid()).pw_name}",
            "per_listener_settings false",
            "persistence true",
            f"persistence_location {self.dir}/",
            "autosave_interval 1",
            f"log_dest file {self.dir / 'mosquitto.log'}",
            "log_type all",
            "connection_messages true",
            f"listener {self.port} 127.0.0.1",
        ]
        if max_packet_bytes:
            lines.append(f"max_packet_size {max_packet_bytes}")
        if users:  # username/password logins only (mosquitto_passwd hashes the file)
            passwd = self.dir / "passwd"
            passwd.write_text("".join(f"{u}:{p}\n" for u, p in users.items()))
            subprocess.run([MOSQUITTO_PASSWD, "-U", str(passwd)], check=True)
            lines += [f"password_file {passwd}", "allow_anonymous false"]
        elif pki is None:
            lines.append("allow_anonymous true")
        else:
            acl = self.dir / "acl"
            acl.write_text(
                # each device reads and writes only below its own id; the operator everything
                f"pattern readwrite fleet/v1/%u/#\nuser {OPERATOR}\ntopic readwrite fleet/#\n"
            )
            lines += [
                f"cafile {pki.ca}",
                f"certfile {pki.cert('server')}",
                f"keyfile {pki.key('server')}",
                "require_certificate true",
                "use_identity_as_username true",
                "allow_anonymous false",
                f"acl_file {acl}",
            ]
        self.conf.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.pki else 'mqtt'}://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            [MOSQUITTO, "-c", str(self.conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"mosquitto exited with {self.proc.returncode}: {err}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mosquitto did not listen on port {self.port}:\n{self.read_log()}")

    def stop(self) -> None:
        """Stop cleanly (SIGTERM): the broker saves its persistence file."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def read_log(self) -> str:
        path = self.dir / "mosquitto.log"
        return path.read_text(errors="replace") if path.exists() else ""
