"""TLS for every hop, as each process sees it: its own certificate and key, and the CA it trusts.

A process's identity comes from its environment (TIDEFLOW_TLS_CERT, _KEY, _CA: the controller sets them for
every router and member it starts, from the fleet CA in `engine.runtime.pki`), so one switch reaches the
servers and the one HTTP client helper alike. Members ask for a client certificate from the fleet's CA
(mutual TLS: only the router, the controller and peer members reach them); the router and the controller
serve TLS to clients that hold API keys, not certificates. A renewed certificate is picked up without a
restart: every SSL context made here is loaded again when its certificate file changes."""

from __future__ import annotations

import ipaddress
import logging
import os
import ssl
import threading
import time
import weakref
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from engine.runtime.paths import home

log = logging.getLogger(__name__)

CERT_ENV, KEY_ENV, CA_ENV = "TIDEFLOW_TLS_CERT", "TIDEFLOW_TLS_KEY", "TIDEFLOW_TLS_CA"
RELOAD_CHECK_S = float(os.environ.get("TIDEFLOW_TLS_RELOAD_S", "5"))  # how often a certificate file is looked at


class TlsIdentity(BaseModel):
    """One process's certificate (PEM), its private key, and the CA whose certificates it trusts."""

    model_config = ConfigDict(frozen=True)  # hashable: a key of the process's cache of client contexts

    cert: Path = Field(description="the certificate chain, PEM")
    key: Path = Field(description="its private key, PEM (0600)")
    ca: Path | None = Field(None, description="the CA certificate peers must chain to; none: only serve `cert`")

    def env(self) -> dict[str, str]:
        """The environment that hands this identity to a child process."""
        return {CERT_ENV: str(self.cert), KEY_ENV: str(self.key), **({CA_ENV: str(self.ca)} if self.ca else {})}

    @classmethod
    def from_env(cls) -> "TlsIdentity | None":
        cert, key = os.environ.get(CERT_ENV), os.environ.get(KEY_ENV)
        if not cert and not key:
            return None
        if not (cert and key):
            raise ValueError(f"{CERT_ENV} and {KEY_ENV} go together: one is set without the other")
        return cls(cert=Path(cert), key=Path(key), ca=Path(os.environ[CA_ENV]) if os.environ.get(CA_ENV) else None)


def add_arguments(p, mutual: bool) -> None:
    """The TLS flags every server takes; `mutual` servers (members) also take the CA their clients chain to."""
    p.add_argument("--tls-cert", type=Path, default=None, help=f"serve TLS with this certificate (PEM; default ${CERT_ENV})")
    p.add_argument("--tls-key", type=Path, default=None, help=f"the certificate's private key (default ${KEY_ENV})")
    if mutual:
        p.add_argument("--tls-ca", type=Path, default=None,
                       help=f"clients must show a certificate from this CA (default ${CA_ENV})")
    p.add_argument("--plain-http", action="store_true",
                   help="serve plain HTTP on a non-loopback address on purpose (a mesh encrypts the hop)")


def identity_from_args(args, what: str) -> TlsIdentity | None:
    """This server's identity from its flags, else its environment. Flags are exported to the environment when
    it holds none, so the process's own clients and children use the same identity; a router given an
    operator's certificate keeps showing members the fleet's. Refuses plain HTTP off loopback."""
    cert, key, ca = args.tls_cert, args.tls_key, getattr(args, "tls_ca", None)
    if cert or key:
        if not (cert and key):
            raise ValueError("--tls-cert and --tls-key go together")
        identity = TlsIdentity(cert=cert, key=key, ca=ca or (Path(os.environ[CA_ENV]) if os.environ.get(CA_ENV) else None))
        if not os.environ.get(CERT_ENV):  # a fleet identity, when there is one, stays the one its clients show
            os.environ.update(identity.env())
    else:
        identity = TlsIdentity.from_env()
    for path in (identity.cert, identity.key, identity.ca) if identity else ():
        if path is not None and not path.is_file():
            raise ValueError(f"{what}: TLS file {path} does not exist")
    require_tls_off_loopback(args.host, identity, args.plain_http, what)
    return identity


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def scheme() -> str:
    """The URL scheme of this process's own servers and of the children that inherit its identity."""
    return "https" if os.environ.get(CERT_ENV) else "http"


def require_tls_off_loopback(host: str, identity: TlsIdentity | None, plain_ok: bool, what: str) -> None:
    """TLS is on by default off loopback: binding another address with no certificate is refused, unless the
    operator said plain HTTP is meant (`plain_ok`: a mesh or a private link encrypts the hop)."""
    if identity is None and not plain_ok and not is_loopback(host):
        raise ValueError(f"{what} binds {host} without TLS: give a certificate (--tls-cert/--tls-key, or "
                         f"${CERT_ENV}/${KEY_ENV}) or say --plain-http to serve unencrypted on purpose")


class _Reloader:
    """Loads a certificate chain into its SSL contexts again whenever the certificate file changes. Contexts are
    held weakly: one that nobody uses any more is dropped, not reloaded for ever."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: list[tuple[weakref.ref[ssl.SSLContext], TlsIdentity, list[int]]] = []
        self._thread: threading.Thread | None = None

    def watch(self, context: ssl.SSLContext, identity: TlsIdentity) -> None:
        with self._lock:
            self._watched.append((weakref.ref(context), identity, [_mtime(identity.cert)]))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tideflow-tls-reload", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(RELOAD_CHECK_S)
            self.check()

    def check(self) -> int:
        """Reload every context whose certificate changed; how many were reloaded."""
        reloaded = 0
        with self._lock:
            self._watched = [w for w in self._watched if w[0]() is not None]
            for ref, identity, seen in self._watched:
                context, now = ref(), _mtime(identity.cert)
                if context is None or now == seen[0]:
                    continue
                try:
                    context.load_cert_chain(identity.cert, identity.key)
                except (OSError, ssl.SSLError) as exc:  # a bad file: the certificate loaded before is kept
                    log.warning("TLS certificate %s could not be loaded again: %s", identity.cert, exc)
                    continue
                seen[0] = now
                reloaded += 1
                log.info("TLS certificate %s loaded again", identity.cert)
        return reloaded


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


reloader = _Reloader()


def server_kwargs(identity: TlsIdentity | None, mutual: bool) -> dict:
    """uvicorn's TLS settings for `identity` (none: plain HTTP). `mutual`: a client must show a certificate
    from the identity's CA, or the handshake is refused."""
    if identity is None:
        return {}
    kwargs = dict(ssl_certfile=str(identity.cert), ssl_keyfile=str(identity.key))
    if mutual:
        if identity.ca is None:
            raise ValueError("mutual TLS needs the CA that client certificates chain to")
        kwargs.update(ssl_ca_certs=str(identity.ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
    return kwargs


def server_context() -> ssl.SSLContext | None:
    """A mutual-TLS server context of this process's identity for a server that is not uvicorn (the KV sender).
    None without an identity (plain TCP)."""
    identity = TlsIdentity.from_env()
    return server_context_for(identity) if identity is not None else None


def server_context_for(identity: TlsIdentity) -> ssl.SSLContext:
    """Serve `identity`'s certificate; clients must show one from its CA. Followed on renewal."""
    if identity.ca is None:
        raise ValueError(f"mutual TLS needs the CA client certificates chain to (${CA_ENV})")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(identity.cert, identity.key)
    context.load_verify_locations(cafile=str(identity.ca))
    context.verify_mode = ssl.CERT_REQUIRED
    reloader.watch(context, identity)
    return context


def trusted_ca() -> Path | None:
    """The CA this process trusts: its identity's, else the fleet CA of its home when one exists (a CLI
    talking to a controller that serves TLS)."""
    identity = TlsIdentity.from_env()
    if identity is not None and identity.ca is not None:
        return identity.ca
    fleet = home() / "tls" / "ca.pem"
    return fleet if fleet.exists() else None


def client_context() -> ssl.SSLContext | None:
    """The SSL context of this process's outgoing HTTPS calls: the fleet CA and the system's CAs trusted (an
    operator's router certificate may come from either), and this process's certificate shown to servers
    that ask for one. None when this process knows no fleet CA: the system's CAs alone then."""
    identity, ca = TlsIdentity.from_env(), trusted_ca()
    if identity is None and ca is None:
        return None
    return client_context_for(identity, ca)


@lru_cache(maxsize=8)
def client_context_for(identity: TlsIdentity | None, ca: Path | None) -> ssl.SSLContext:
    """One client context per identity and CA, shared by every client of the process; followed on renewal."""
    context = ssl.create_default_context()
    if ca is not None:
        context.load_verify_locations(cafile=str(ca))
    if identity is not None:
        context.load_cert_chain(identity.cert, identity.key)
        reloader.watch(context, identity)
    return context
