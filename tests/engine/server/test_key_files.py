"""Keys a server reads from files: digests verify, an old key's grace ends on time, a file rewritten in place
is followed without a restart, and an emptied file locks out rather than opening up."""

from __future__ import annotations

import time

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from engine.api import auth as auth_module
from engine.api.auth import ApiKey, BearerAuth, KeySource, SecretFile, key_state, write_key_file
from engine.api.errors import install_error_handlers


def _app(source: KeySource) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/x", dependencies=[Depends(BearerAuth(source))])
    def x() -> dict:
        return {"ok": True}

    return TestClient(app)


def _get(client: TestClient, key: str) -> int:
    return client.get("/x", headers={"authorization": f"Bearer {key}"}).status_code


def test_a_digest_verifies_its_key_and_an_expired_grace_refuses_it(tmp_path, monkeypatch):
    monkeypatch.setattr(auth_module, "RECHECK_S", 0.0)
    path = tmp_path / "clients.keys"
    write_key_file(path, [ApiKey(key="new-key").hashed(), ApiKey(key="old-key", until=time.time() + 60).hashed()])
    assert "new-key" not in path.read_text() and path.stat().st_mode & 0o777 == 0o600
    client = _app(KeySource(path=path))
    assert _get(client, "new-key") == 200 and _get(client, "old-key") == 200 and _get(client, "other") == 401
    write_key_file(path, [ApiKey(key="new-key").hashed(), ApiKey(key="old-key", until=time.time() - 1).hashed()])
    assert _get(client, "old-key") == 401 and _get(client, "new-key") == 200  # followed, no restart


def test_an_emptied_key_file_locks_out_instead_of_opening_up(tmp_path, monkeypatch):
    monkeypatch.setattr(auth_module, "RECHECK_S", 0.0)
    path = tmp_path / "clients.keys"
    write_key_file(path, [ApiKey(key="k")])
    client = _app(KeySource(path=path))
    path.write_text("")
    assert _get(client, "k") == 401 and client.get("/x").status_code == 401


def test_key_entries_round_trip_and_bad_ones_are_named():
    key = ApiKey.parse("sha256:" + "a" * 64 + " priority>=-5 forwards until=1900000000")
    assert key.entry() == "sha256:" + "a" * 64 + " priority>=-5 forwards until=1900000000"
    with pytest.raises(ValueError, match="64 hex"):
        ApiKey.parse("sha256:abc")
    with pytest.raises(ValueError, match="until=T"):
        ApiKey.parse("k until=tomorrow")


def test_a_secret_file_is_followed_and_the_key_state_names_what_changed(tmp_path, monkeypatch):
    monkeypatch.setattr(auth_module, "RECHECK_S", 0.0)
    path = tmp_path / "routes.key"
    write_key_file(path, [ApiKey(key="one")])
    secret = SecretFile(path)
    assert secret.current() == "one"
    write_key_file(path, [ApiKey(key="two")])
    assert secret.current() == "two"
    accepted = [ApiKey(key="c")]
    assert key_state(accepted, "one") != key_state(accepted, "two")
    assert key_state(accepted, "one") == key_state([ApiKey(key="c").hashed()], "one")  # clear or hashed alike
    with pytest.raises(ValueError, match="holds no key"):
        (tmp_path / "empty.key").write_text("\n")
        SecretFile(tmp_path / "empty.key")
