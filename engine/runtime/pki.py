"""The fleet's certificate authority: made once per home, it issues the controller, the routers and the members
(one certificate per role) a short-lived certificate for both ends of a TLS connection, and issues it again
before it expires.

Kept apart from `tls` (which only reads certificates) because only the controller holds the CA's key.
Keys are EC P-256 (fast handshakes, small certificates). An issued certificate and its key share one file,
0600, replaced atomically: a reader never sees half a file nor a key of another certificate."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import socket
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from engine.runtime.tls import TlsIdentity

CA_NAME = "tideflow fleet CA"
CA_LIFETIME = dt.timedelta(days=3650)
RENEW_AT_FRACTION_LEFT = 1 / 3  # a certificate is issued again once a third of its life is left
CLOCK_SKEW = dt.timedelta(minutes=5)  # valid from a little before now: hosts' clocks differ


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _write(path: Path, data: bytes, private: bool) -> None:
    """Write `data` whole or not at all; a private file is 0600 from its first byte."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def default_hosts(bind_host: str) -> list[str]:
    """The names a process bound to `bind_host` is reached by: that address, and on loopback or a wildcard
    also the loopback names and this machine's name."""
    hosts = [bind_host] if bind_host not in ("0.0.0.0", "::", "") else []
    hosts += ["127.0.0.1", "localhost", socket.gethostname()]
    return list(dict.fromkeys(hosts))


def identity_paths(folder: Path, name: str) -> TlsIdentity:
    """Where the CA in `folder` keeps the certificate it issued to `name` (readers need not hold the CA's key)."""
    both = folder / "issued" / f"{name}.pem"  # certificate and key together (0600)
    return TlsIdentity(cert=both, key=both, ca=folder / "ca.pem")


class FleetCA:
    """The CA in `folder` (ca.pem, ca.key 0600), made on first use; `issue` writes identities under issued/."""

    def __init__(self, folder: Path, lifetime: dt.timedelta) -> None:
        self.folder, self.lifetime = folder, lifetime
        self.ca_path, self.key_path = folder / "ca.pem", folder / "ca.key"
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        (folder / "issued").mkdir(exist_ok=True, mode=0o700)
        if not (self.ca_path.exists() and self.key_path.exists()):
            self._create()
        self.key = serialization.load_pem_private_key(self.key_path.read_bytes(), password=None)
        self.cert = x509.load_pem_x509_certificate(self.ca_path.read_bytes())

    def _create(self) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME),
                          x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tideflow")])
        now = _now()
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + CA_LIFETIME)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        _write(self.key_path, _key_pem(key), private=True)  # the key first: a CA file never lacks its key
        _write(self.ca_path, cert.public_bytes(serialization.Encoding.PEM), private=False)

    def identity_paths(self, name: str) -> TlsIdentity:
        return identity_paths(self.folder, name)

    def issue(self, name: str, hosts: list[str], lifetime: dt.timedelta | None = None) -> TlsIdentity:
        """A certificate for `name`, valid for `hosts` as server and as client, for `lifetime` (the CA's
        default when None). Written over any earlier one of that name: that is how it is renewed."""
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"certificate name {name!r}: a plain file name is needed")
        if not hosts:
            raise ValueError(f"certificate {name}: at least one host name or address is needed")
        identity = self.identity_paths(name)
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name),
                                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tideflow")]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + (lifetime or self.lifetime))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName([_san(h) for h in dict.fromkeys(hosts)]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                               critical=False)
                .sign(self.key, hashes.SHA256()))
        # the certificate and its key in one file, replaced in one rename: a process starting or reloading during
        # a renewal never reads a new key with an old certificate
        _write(identity.cert, cert.public_bytes(serialization.Encoding.PEM) + _key_pem(key), private=True)
        return identity

    def renew_due(self, now: dt.datetime | None = None) -> list[str]:
        """Issue again every certificate under issued/ with less than a third of its life left, for the same
        names and hosts; the names renewed. A process using one picks the new one up without restarting."""
        now = now or _now()
        renewed = []
        for pem in sorted((self.folder / "issued").glob("*.pem")):
            cert = x509.load_pem_x509_certificate(pem.read_bytes())
            life = cert.not_valid_after_utc - cert.not_valid_before_utc - CLOCK_SKEW  # as issued
            if cert.not_valid_after_utc - now > life * RENEW_AT_FRACTION_LEFT:
                continue
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            hosts = [str(v) for v in sans.get_values_for_type(x509.IPAddress)] + sans.get_values_for_type(x509.DNSName)
            self.issue(pem.stem, hosts, life)
            renewed.append(pem.stem)
        return renewed


def fleet_identities(folder: Path, lifetime: dt.timedelta, host: str, roles: tuple[str, ...],
                     own: str) -> tuple[FleetCA, dict[str, TlsIdentity]]:
    """The CA in `folder` and a fresh certificate for each of `roles`, valid for `host`; the `own` role's goes into
    this process's environment, where its servers and its clients (to members, which ask for one) take it."""
    ca = FleetCA(folder, lifetime)
    identities = {role: ca.issue(role, default_hosts(host)) for role in roles}
    os.environ.update(identities[own].env())
    return ca, identities
