"""TLS in one process: the fleet CA's certificates, a member's mutual TLS with each kind of refusal named, a
renewed certificate served without a restart, and the KV transfer over mutual TLS."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import ssl

import httpx
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from fastapi import FastAPI

from engine.api.inproc import serve_in_thread
from engine.runtime import tls
from engine.runtime.http import explain
from engine.runtime.pki import FleetCA
from engine.transfer import KVTransferError
from engine.transfer.tcp import TcpReceiver, TcpSender

HOSTS = ["127.0.0.1", "localhost"]


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    return app


@pytest.fixture
def fleet(tmp_path):
    return FleetCA(tmp_path / "fleet", dt.timedelta(hours=1))


@pytest.fixture
def stranger(tmp_path):
    """Another CA, with a certificate for the same names: what a wrong or rogue peer holds."""
    return FleetCA(tmp_path / "stranger", dt.timedelta(hours=1))


def _served(url: str) -> x509.Certificate:
    host, port = url.split("//")[1].split(":")
    pem = ssl.get_server_certificate((host, int(port)))
    return x509.load_pem_x509_certificate(pem.encode())


def _refusal(url: str, verify) -> str:
    with pytest.raises(httpx.HTTPError) as caught:
        httpx.get(url + "/health", verify=verify, trust_env=False, timeout=5)
    return explain(caught.value, url)


def test_the_fleet_ca_issues_both_ends_certificates_and_renews_them_with_a_third_of_their_life_left(fleet):
    member = fleet.issue("member", HOSTS)
    assert oct(member.key.stat().st_mode & 0o777) == "0o600" and oct(fleet.key_path.stat().st_mode & 0o777) == "0o600"
    cert = x509.load_pem_x509_certificate(member.cert.read_bytes())
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    cert.verify_directly_issued_by(fleet.cert)

    now = dt.datetime.now(dt.timezone.utc)
    assert fleet.renew_due(now + dt.timedelta(minutes=30)) == []  # half its life left
    assert fleet.renew_due(now + dt.timedelta(minutes=45)) == ["member"]  # under a third left
    again = x509.load_pem_x509_certificate(member.cert.read_bytes())
    assert again.serial_number != cert.serial_number and again.subject == cert.subject
    assert again.extensions.get_extension_for_class(x509.SubjectAlternativeName).value == sans
    assert abs((again.not_valid_after_utc - again.not_valid_before_utc) - (cert.not_valid_after_utc -
                                                                              cert.not_valid_before_utc)).seconds < 5
    assert FleetCA(fleet.folder, fleet.lifetime).cert == fleet.cert  # made once: a second start keeps it


@pytest.mark.fleet  # serves on a loopback socket
def test_a_member_lets_in_only_a_client_with_the_fleet_s_certificate_and_names_every_refusal(fleet, stranger):
    member, router = fleet.issue("member", HOSTS), fleet.issue("router", HOSTS)
    rogue = stranger.issue("router", HOSTS)
    with serve_in_thread(_app(), identity=member, mutual=True) as url:
        assert url.startswith("https://")
        ok = httpx.get(url + "/health", verify=tls.client_context_for(router, fleet.ca_path), trust_env=False)
        assert ok.status_code == 200
        for shown in (None, rogue):  # no certificate, or another CA's
            refused = _refusal(url, tls.client_context_for(shown, fleet.ca_path))
            assert "client certificate from its CA" in refused, refused
        untrusted = _refusal(url, tls.client_context_for(router, stranger.ca_path))
        assert "does not chain to a CA this process trusts" in untrusted, untrusted
        plain = _refusal(url.replace("https://", "http://"), True)
        assert "try https://" in plain, plain


@pytest.mark.fleet  # serves on a loopback socket
def test_an_expired_certificate_is_refused_as_expired(fleet):
    expired = fleet.issue("member", HOSTS, lifetime=dt.timedelta(minutes=-1))  # ended before it was served
    with serve_in_thread(_app(), identity=expired) as url:
        refused = _refusal(url, tls.client_context_for(None, fleet.ca_path))
    assert "has expired" in refused, refused


@pytest.mark.fleet  # serves on a loopback socket
def test_a_renewed_certificate_is_served_to_the_next_handshake_without_a_restart(fleet):
    member = fleet.issue("member", HOSTS)
    with serve_in_thread(_app(), identity=member, mutual=False) as url:
        first = _served(url)
        fleet.issue("member", HOSTS)  # what renew_due does once a third of the life is left
        assert tls.reloader.check() >= 1
        second = _served(url)
        assert second.serial_number != first.serial_number
        assert x509.load_pem_x509_certificate(member.cert.read_bytes()).serial_number == second.serial_number


@pytest.mark.fleet  # serves on a loopback socket
def test_kv_moves_over_mutual_tls_and_a_foreign_or_plain_puller_gets_nothing(fleet, stranger):
    prefill, decode = fleet.issue("prefill", HOSTS), fleet.issue("decode", HOSTS)
    sender = TcpSender(context=tls.server_context_for(prefill))
    try:
        for i, (puller, refused) in enumerate([(TcpReceiver(tls.client_context_for(stranger.issue("decode", HOSTS),
                                                                                    fleet.ca_path)), True),
                                               (TcpReceiver(), True),
                                               (TcpReceiver(tls.client_context_for(decode, fleet.ca_path)), False)]):
            view = sender.stage(f"t{i}", 4096)
            view[:] = os.urandom(4096)
            desc = sender.commit(f"t{i}")
            if refused:
                with pytest.raises(KVTransferError):
                    puller.fetch(desc, timeout_s=5)
            else:
                assert bytes(puller.fetch(desc, timeout_s=5)) == bytes(view)
    finally:
        sender.close()


def _args(host: str, plain: bool = False, **flags) -> argparse.Namespace:
    return argparse.Namespace(host=host, plain_http=plain, tls_cert=flags.get("cert"), tls_key=flags.get("key"),
                              tls_ca=flags.get("ca"))


def test_serving_off_loopback_without_tls_is_refused_unless_plain_http_is_said(fleet, monkeypatch):
    for env in (tls.CERT_ENV, tls.KEY_ENV, tls.CA_ENV):
        # set empty (read as unset), not deleted: monkeypatch restores only what it set, and identity_from_args
        # exports the identity into this process's environment, where every later test's children would find it
        monkeypatch.setenv(env, "")
    with pytest.raises(ValueError, match="--plain-http"):
        tls.identity_from_args(_args("0.0.0.0"), "tideflow serve")
    assert tls.identity_from_args(_args("0.0.0.0", plain=True), "tideflow serve") is None
    assert tls.identity_from_args(_args("127.0.0.1"), "tideflow serve") is None
    member = fleet.issue("member", HOSTS)
    with pytest.raises(ValueError, match="go together"):
        tls.identity_from_args(_args("0.0.0.0", cert=member.cert), "tideflow serve")
    got = tls.identity_from_args(_args("0.0.0.0", cert=member.cert, key=member.key, ca=member.ca), "tideflow serve")
    assert got == member and os.environ[tls.CERT_ENV] == str(member.cert)  # its clients show the same certificate
