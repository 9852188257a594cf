"""The fleet's keys and their rotation: a new key works at once, the old one for its grace, then never.

Four keys, each generated once and kept in the controller's store (0600):
- `client`: clients -> the router. Routers verify it from `keys/router-clients.keys`, which holds digests only.
  Clients read `router.key` (replaced at once, after every router accepts the new key).
- `admin`: tasks and the CLI -> the control API. The controller verifies it in-process; `controller.json` gets
  the new one.
- `routes`: routers -> the controller's route set. The controller verifies it; routers send what
  `keys/routes.key` holds, read again when it changes.
- `upstream`: routers and the controller -> members. Members started here verify `keys/members.keys` (digests,
  read again when it changes); routers send what `keys/upstream.key` holds. A rotation reaches every member first
  (the new key accepted beside the old), then the senders.

An old key's grace is stored beside the key (`grace:<name>` in the store's settings) as its expiry, so a
restarted controller keeps honouring it exactly until then; the routers' key file carries the same expiry
(`until=`), so they refuse it at the same moment without being told again.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.runtime.errors import TideflowError
from engine.api.auth import ApiKey, key_state, write_key_file

Role = Literal["client", "admin", "routes", "upstream"]
SECRET_OF: dict[str, str] = {"client": "router_client", "admin": "controller_admin", "routes": "routes",
                             "upstream": "member"}
CLIENT_FILE, ROUTES_FILE, MEMBERS_FILE, UPSTREAM_FILE = "router-clients.keys", "routes.key", "members.keys", "upstream.key"


class RotationError(TideflowError):
    """A key could not be rotated (the reason says which and why)."""


class RotateKey(BaseModel):
    """`POST /v1/keys/rotate`."""

    model_config = ConfigDict(extra="forbid")

    role: Role
    grace_s: float = Field(600.0, ge=0, le=7 * 86400, description="seconds the old key keeps working (default 10 min)")


class Rotated(BaseModel):
    """What `POST /v1/keys/rotate` answers (never a key)."""

    role: str
    grace_s: float
    old_until: float = Field(description="unix time from which the old key is refused")
    routers: int = Field(description="router replicas that took the new key before it was handed to its holders")


class KeyBook:
    """The keys of one controller's store, the files its routers read, and their rotation."""

    def __init__(self, store, directory: Path) -> None:
        self.store, self.dir = store, directory
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[str, ApiKey | None]] = {}  # role -> (key, old key's digest with its expiry)

    def current(self, role: Role) -> str:
        return self._entry(role)[0]

    def accepted(self, role: Role) -> list[ApiKey]:
        """The key of `role` and, during its grace, the one it replaced (as its digest: only verified now)."""
        key, old = self._entry(role)
        return [ApiKey(key=key), *([old] if old is not None and old.until > time.time() else [])]

    def _entry(self, role: Role) -> tuple[str, ApiKey | None]:
        """Read from the store once, then from memory (every API call checks a key; this controller is the
        store's one writer, and `rotate` refreshes it)."""
        with self._lock:
            if role not in self._cache:
                # a store without settings (Kubernetes' ConfigMap store) never rotates, so it has no grace
                raw = self.store.setting(f"grace:{SECRET_OF[role]}") if hasattr(self.store, "setting") else None
                old = ApiKey.model_validate(json.loads(raw)) if raw else None
                self._cache[role] = (self.store.secret(SECRET_OF[role]), old)
            return self._cache[role]

    def publish(self) -> None:
        """The routers' and members' key files as the store says now (at start, and after each rotation)."""
        write_key_file(self.dir / CLIENT_FILE, [k.hashed() for k in self.accepted("client")])
        write_key_file(self.dir / ROUTES_FILE, [ApiKey(key=self.current("routes"))])
        write_key_file(self.dir / UPSTREAM_FILE, [ApiKey(key=self.current("upstream"))])
        self.publish_members()

    def publish_members(self, coming: str | None = None) -> None:
        """What members accept: the upstream key and, in its grace, the old one (digests; forwarding keys: their
        requests name the client); `coming`, a key about to replace the current one, accepted ahead of its use."""
        keys = [k.model_copy(update={"forwards": True}).hashed() for k in self.accepted("upstream")]
        keys += [ApiKey(key=coming, forwards=True).hashed()] if coming else []
        write_key_file(self.dir / MEMBERS_FILE, keys)

    def router_state(self) -> str:
        """The key_state a router that took the current files reports."""
        return key_state([k.hashed() for k in self.accepted("client")], self.current("routes"),
                         self.current("upstream"))

    def check_rotatable(self) -> None:
        if not hasattr(self.store, "set_secret"):
            raise RotationError("this store cannot rotate keys (on Kubernetes: update the Secret tideflow-keys and "
                                "roll the Deployments)")

    def rotate(self, role: Role, grace_s: float, new: str | None = None) -> tuple[str, float]:
        """A new key for `role` (`new`, or one made here), the old one accepted until now + grace_s; (the new key,
        the old one's expiry)."""
        self.check_rotatable()
        with self._lock:
            old, until = self.store.secret(SECRET_OF[role]), time.time() + grace_s
            new = new or secrets.token_urlsafe(24)
            graced = ApiKey(key=old, until=until, forwards=role == "upstream").hashed()  # only verified from now on
            self.store.set_setting(f"grace:{SECRET_OF[role]}", graced.model_dump_json())
            self.store.set_secret(SECRET_OF[role], new)
            self._cache[role] = (new, graced)
        return new, until
