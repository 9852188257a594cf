"""The fleet's key book on its own (rotation through real processes: tests/engine/control/test_controller.py)."""

import pytest

from engine.control.keys import KeyBook, RotationError


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
