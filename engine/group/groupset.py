"""A group set owned by one Python process: a router process plus the GroupManager that registers groups in it.

Tests and benchmarks use it directly; fleets that flows act on live in the
controller (engine/control/), which outlives every flow run.
"""

from __future__ import annotations

import datetime as dt
import secrets
from pathlib import Path

from pydantic import BaseModel, Field

from engine.group.local import LocalProcessBackend
from engine.group.manager import GroupManager, ManagedGroup, SupervisionPolicy
from engine.group.spec import InferenceGroup
from engine.runtime.paths import home
from engine.runtime.pki import fleet_identities
from engine.runtime.process import free_port, loopback_members, start_service, tideflow_argv
from engine.router.admin import RouterAdmin
from engine.router.app import ADMIN_KEYS_ENV, UPSTREAM_KEY_ENV


class GroupSetConfig(BaseModel):
    model_dir: Path = Field(description="checkpoint for the router's tokenizer and for groups whose spec names none")
    model_name: str = Field("default", description="model id clients ask the router for")
    router_port: int = Field(0, ge=0, le=65535, description="router port (0 = any free port)")
    host: str = Field("127.0.0.1", description="bind address of the router and members")
    client_api_key: str | None = Field(None, description="key clients send; generated when unset")
    policy: SupervisionPolicy = Field(default_factory=SupervisionPolicy)
    router_args: list[str] = Field(default_factory=list, description="extra `tideflow router` flags")
    tls: bool = Field(False, description="TLS on every hop from a fleet CA in $TIDEFLOW_HOME/tls (mutual TLS to "
                                         "members); this process shows the CA's `owner` certificate to them")


class LocalGroupSet:
    """Owns the processes it starts: `close()` (or the context manager) stops every one of them."""

    def __init__(self, config: GroupSetConfig) -> None:
        self.config = config
        self.client_key = config.client_api_key or "tf-" + secrets.token_urlsafe(24)
        self._admin_key = secrets.token_urlsafe(24)
        self._member_key = secrets.token_urlsafe(24)  # between the router and the members only
        port = config.router_port or free_port(config.host)
        # the routers', the members' and this process's certificates; this process's is in its environment, where
        # its clients (the router's admin API, the members' probes) take it from
        roles = ("router", "member", "owner")
        identities = fleet_identities(home() / "tls", dt.timedelta(hours=24), config.host, roles,
                                      own="owner")[1] if config.tls else {}
        self.url = f"{'https' if config.tls else 'http'}://{config.host}:{port}"
        logs = home() / "logs"
        env = {"TIDEFLOW_API_KEYS": self.client_key, ADMIN_KEYS_ENV: self._admin_key, UPSTREAM_KEY_ENV: self._member_key,
               **(identities["router"].env() if identities else {})}
        argv = tideflow_argv("router", "--host", config.host, "--port", str(port), "--model-name", config.model_name,
                             "--model-dir", str(config.model_dir), *loopback_members(config.host), *config.router_args)
        self.router = start_service(f"router-{port}", argv, logs / f"router-{port}.log", self.url + "/health", 60, env)
        self.admin = RouterAdmin(self.url, self._admin_key)
        self.backend = LocalProcessBackend(config.model_dir, self._member_key, config.model_name, logs, config.host,
                                           identity=identities.get("member"))
        self.manager = GroupManager(self.backend, self.admin, config.policy,
                                    member_key=self._member_key)

    @property
    def member_key(self) -> str:
        """The key members accept (the router and the autoscaler's observer use it); never logged."""
        return self._member_key

    def up(self, spec: InferenceGroup, standby: bool = False, weight: float = 1.0) -> ManagedGroup:
        return self.manager.up(spec, standby=standby, weight=weight)

    def park(self, name: str, drain_s: float = 30.0) -> float | None:
        """Ready -> Standby for a group of this set (None: not one of ours, nothing to park)."""
        g = self.manager.groups.get(name)
        return g.park(drain_s) if g is not None else None

    def delete(self, name: str, drain_s: float = 10.0) -> None:
        """Drain and stop a group of this set; one that is not ours is only taken out of the router."""
        g = self.manager.groups.get(name)
        if g is not None:
            g.drain_and_stop(drain_s)
        else:
            self.admin.deregister(name)

    def close(self, drain_s: float = 5.0) -> None:
        try:
            self.manager.shutdown(drain_s)
        finally:
            self.admin.close()
            self.router.stop()

    def __enter__(self) -> "LocalGroupSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

