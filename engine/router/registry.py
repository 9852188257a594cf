"""The groups a router serves: their endpoints, health, weights and in-flight counts."""

from __future__ import annotations

import asyncio
import threading
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, Field

Role = Literal["encoder", "prefill", "decode", "colocated"]
GROUP_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"  # a DNS-1123 label, as Kubernetes names objects
GroupName = Annotated[str, Field(pattern=GROUP_NAME_PATTERN, description="a DNS-1123 label")]
Weight = Annotated[float, Field(ge=0.0, allow_inf_nan=False, description="relative traffic share; 0 = drain")]


def _member_url(url: str) -> str:
    """scheme://host:port and nothing else: the router sends the members' key there, so no userinfo,
    path, query, fragment or control character can smuggle it elsewhere."""
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise ValueError("the URL contains whitespace or control characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError("the URL must be http:// or https://")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ValueError("the URL must not carry user info")
    if parts.path or parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ValueError("the URL must be scheme://host:port with no path, query or fragment")
    try:
        port = parts.port
    except ValueError:
        raise ValueError("the URL's port is not a number in 1-65535") from None
    if not parts.hostname or port is None or port == 0:
        raise ValueError("the URL must name a host and a port")
    return url


class Endpoint(BaseModel):
    url: Annotated[str, AfterValidator(_member_url)] = Field(description="http://host:port of one instance's leader")
    role: Role
    instance: int = Field(0, ge=0)


class GroupRegistration(BaseModel):
    """What a GroupManager registers once every member of a group is ready."""

    name: GroupName
    version: str = Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    endpoints: list[Endpoint] = Field(min_length=1, max_length=1024)
    weight: Weight = 1.0


class EndpointState:
    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.healthy = True
        self.fails = 0
        self.passes = 0
        self.inflight = 0
        self.queued_prefill_tokens = 0
        self.stats: dict = {}
        self._ejected = asyncio.Event()  # set while ejected: requests waiting on its answer stop waiting

    def eject(self) -> None:
        self.healthy = False
        self._ejected.set()

    def readmit(self) -> None:
        self.healthy = True
        self._ejected = asyncio.Event()

    async def ejection(self) -> None:
        """Returns once this endpoint is ejected (at once if it is now)."""
        await self._ejected.wait()


class GroupState:
    def __init__(self, reg: GroupRegistration) -> None:
        self.reg = reg
        self.endpoints = [EndpointState(e) for e in reg.endpoints]
        self.current_weight = 0.0  # smooth weighted round robin state
        self.inflight = 0

    def by_role(self, role: Role) -> list[EndpointState]:
        return [e for e in self.endpoints if e.endpoint.role == role and e.healthy]

    @property
    def routable(self) -> bool:
        """Atomic: one unhealthy member takes the whole group out."""
        return self.reg.weight > 0 and all(e.healthy for e in self.endpoints)

    @property
    def disaggregated(self) -> bool:
        return not any(e.endpoint.role == "colocated" for e in self.endpoints)

    def summary(self) -> dict:
        return {"name": self.reg.name, "version": self.reg.version, "weight": self.reg.weight,
                "routable": self.routable, "inflight": self.inflight,
                "endpoints": [{"url": e.endpoint.url, "role": e.endpoint.role, "healthy": e.healthy,
                               "inflight": e.inflight} for e in self.endpoints]}


class Registry:
    def __init__(self) -> None:
        self._groups: dict[str, GroupState] = {}
        self._lock = threading.Lock()

    def register(self, reg: GroupRegistration) -> None:
        """Add or replace a group; the same version and endpoints again only update the weight, keeping
        health and in-flight counts (a restarted controller re-registers what it adopted)."""
        with self._lock:
            have = self._groups.get(reg.name)
            if have is not None and have.reg.version == reg.version and have.reg.endpoints == reg.endpoints:
                have.reg.weight = reg.weight
                return
            self._groups[reg.name] = GroupState(reg)

    def replace(self, regs: list[GroupRegistration]) -> None:
        """Serve exactly `regs` (a route set from the controller): groups left out go, and a group whose
        version and endpoints are unchanged keeps its health and in-flight counts."""
        with self._lock:
            out: dict[str, GroupState] = {}
            for reg in regs:
                have = self._groups.get(reg.name)
                if have is not None and have.reg.version == reg.version and have.reg.endpoints == reg.endpoints:
                    have.reg.weight = reg.weight
                    out[reg.name] = have
                else:
                    out[reg.name] = GroupState(reg)
            self._groups = out

    def deregister(self, name: str) -> bool:
        with self._lock:
            return self._groups.pop(name, None) is not None

    def set_weights(self, weights: dict[str, float]) -> None:
        with self._lock:
            unknown = sorted(set(weights) - set(self._groups))
            if unknown:
                raise KeyError(f"unknown groups: {', '.join(unknown)}")
            for name, w in weights.items():
                if w < 0:
                    raise ValueError(f"weight of {name} must be >= 0")
                self._groups[name].reg.weight = w

    def groups(self) -> list[GroupState]:
        with self._lock:
            return list(self._groups.values())

    def get(self, name: str) -> GroupState | None:
        with self._lock:
            return self._groups.get(name)

    def choose(self, exclude: set[str] = frozenset()) -> GroupState | None:
        """Smooth weighted round robin over routable groups: exact shares, evenly interleaved."""
        with self._lock:
            live = [g for g in self._groups.values() if g.routable and g.reg.name not in exclude]
            if not live:
                return None
            total = sum(g.reg.weight for g in live)
            for g in live:
                g.current_weight += g.reg.weight
            best = max(live, key=lambda g: g.current_weight)
            best.current_weight -= total
            return best
