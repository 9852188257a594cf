"""The fleet's key book on its own (rotation through real processes: tests/engine/control/test_controller.py)."""

import asyncio

import pytest

from engine.control.keys import KeyBook, RotationError

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def test_keys_on_a_store_without_settings_have_no_grace_and_refuse_rotation(tmp_path):
    """Kubernetes' ConfigMap store keeps secrets but no settings: the keys are served, a rotation is refused
    with the way to do it there."""
    class SecretsOnly:
        def secret(self, name: str) -> str:
            return f"key-of-{name}"

    book = KeyBook(SecretsOnly(), tmp_path / "keys")
    book.publish()
    assert [k.key for k in book.accepted("admin")] == ["key-of-controller_admin"]
    assert "key-of-router_client" not in (tmp_path / "keys" / "router-clients.keys").read_text()  # digests only
    with pytest.raises(RotationError, match="Secret tideflow-keys"):
        book.rotate("client", 60)


def test_calls_refused_at_once_on_a_shared_client_all_retry_with_the_rotated_key(tmp_path, monkeypatch):
    """Two threads share one ControlClient (as a flow's tasks do). Both calls go out with the old admin key and
    are refused together after its grace; the first to look takes the new key from discovery, and the second,
    finding its client already rekeyed, must retry as well rather than fail."""
    import threading

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    from engine.api.inproc import serve_in_thread
    from engine.control import discovery
    from engine.control.client import ControlClient

    both_sent = threading.Barrier(2, timeout=10)
    app = FastAPI()

    @app.get("/v1/status")
    async def status(request: Request):
        if request.headers.get("authorization") == "Bearer old":
            await asyncio.to_thread(both_sent.wait)  # answer 401 only once both old-key calls are in flight
            return JSONResponse({"error": {"message": "incorrect API key provided"}}, status_code=401)
        return {"ok": True}

    monkeypatch.setenv("TIDEFLOW_HOME", str(tmp_path))
    monkeypatch.delenv(discovery.URL_ENV, raising=False)
    with serve_in_thread(app) as url:
        discovery.register(discovery.ControllerInfo(url=url, admin_key="new"), "client-key")  # the rotation's result
        client = ControlClient(url, "old", timeout_s=10, rediscover=True)
        outcomes: list = []

        def call() -> None:
            try:
                outcomes.append(client._call("GET", "/v1/status"))
            except Exception as exc:
                outcomes.append(repr(exc))

        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        client.close()
    assert outcomes == [{"ok": True}, {"ok": True}]
