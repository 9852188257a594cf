"""The typed client of the control API: every task talks to the fleet through it, so no flow run keeps
fleet state in its own process."""

from __future__ import annotations

import time

import httpx

from engine.control import discovery
from engine.control.keys import RotateKey, Rotated
from engine.control.models import (ApplyGroup, AutoscalerBody, AutoscalerView, CanaryRecord, FleetStatus, GroupView,
                                   Killed, KillMember, Lease, LeaseRequest, ParkBody, ScalePool, Seconds, WeightsSet)
from engine.control.store import Event
from engine.runtime.errors import TideflowError
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup
from engine.runtime.http import bearer_client, explain
from engine.scaling.policy import ScalingPolicy
from engine.scaling.pool import ScaleResult


class ControlAPIError(TideflowError):
    """The controller refused a call (status >= 400) or did not answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ControlClient:
    def __init__(self, url: str, admin_key: str, timeout_s: float = 120.0, rediscover: bool = False) -> None:
        """`rediscover`: found through discovery, so a refused key is looked up there again (it was rotated)."""
        self.url = url.rstrip("/")
        self._http = bearer_client(admin_key, self.url, timeout_s)
        self._rediscover = rediscover

    @classmethod
    def connect(cls) -> "ControlClient":
        """The controller of $TIDEFLOW_CONTROLLER_URL or of this $TIDEFLOW_HOME; NoController when none."""
        info = discovery.find()
        return cls(info.url, info.admin_key, rediscover=True)

    def _call(self, method: str, path: str, **kw):
        try:
            sent = self._http.headers.get("authorization")
            r = self._http.request(method, path, **kw)
            if r.status_code == 401 and self._rekeyed(sent):  # a long run outliving its key's grace: the new key
                r = self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            why = explain(exc, self.url)
            raise ControlAPIError(f"controller {self.url} did not answer {method} {path}: {why}") from None
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:300]
            raise ControlAPIError(f"controller refused {method} {path} ({r.status_code}): {message}", r.status_code)
        return r.json()

    def _rekeyed(self, sent: str | None) -> bool:
        """Whether a call refused with the header `sent` is worth one more try: another thread sharing this client
        already took the new key (two calls refused at once both retry, not only the first), or discovery holds
        another key for the same controller now, which this client takes."""
        if not self._rediscover:
            return False
        if self._http.headers.get("authorization") != sent:
            return True
        try:
            info = discovery.find()
        except TideflowError:
            return False
        value = f"Bearer {info.admin_key}"
        if info.url.rstrip("/") != self.url or value == sent:  # against what was sent: another thread may have
            return False                                        # taken the same new key since the check above
        self._http.headers["authorization"] = value
        return True

    # -- fleet ----------------------------------------------------------------------------------------
    def health(self) -> bool:
        try:
            return self._http.get("/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def status(self) -> FleetStatus:
        return FleetStatus.model_validate(self._call("GET", "/v1/status"))

    def group(self, name: str) -> GroupView:
        return GroupView.model_validate(self._call("GET", f"/v1/groups/{name}"))

    def apply(self, spec: InferenceGroup, weight: float = 1.0, standby: bool = False) -> GroupView:
        body = ApplyGroup(spec=spec, weight=weight, standby=standby)
        return GroupView.model_validate(self._call("PUT", "/v1/groups", content=body.model_dump_json(),
                                                   headers={"content-type": "application/json"}))

    def delete(self, name: str, drain_s: float = 10.0) -> None:
        self._call("DELETE", f"/v1/groups/{name}", params={"drain_s": drain_s})

    def activate(self, name: str) -> float:
        return Seconds.model_validate(self._call("POST", f"/v1/groups/{name}/activate")).seconds

    def park(self, name: str, drain_s: float = 30.0) -> float:
        body = ParkBody(drain_s=drain_s).model_dump()
        return Seconds.model_validate(self._call("POST", f"/v1/groups/{name}/park", json=body)).seconds

    def kill(self, name: str, target: str) -> Killed:
        body = KillMember(target=target).model_dump()
        return Killed.model_validate(self._call("POST", f"/v1/groups/{name}/kill", json=body))

    def kill_router(self) -> Killed:
        return Killed.model_validate(self._call("POST", "/v1/router/kill"))

    def scale_pool(self, body: ScalePool) -> ScaleResult:
        return ScaleResult.model_validate(self._call("POST", "/v1/pools/scale", content=body.model_dump_json(),
                                                     headers={"content-type": "application/json"}))

    def start_autoscaler(self, template: InferenceGroup, policy: ScalingPolicy) -> AutoscalerView:
        body = AutoscalerBody(template=template, policy=policy)
        return AutoscalerView.model_validate(self._call("PUT", "/v1/autoscalers", content=body.model_dump_json(),
                                                        headers={"content-type": "application/json"}))

    def autoscaler(self, name: str) -> AutoscalerView:
        return AutoscalerView.model_validate(self._call("GET", f"/v1/autoscalers/{name}"))

    def stop_autoscaler(self, name: str) -> None:
        self._call("DELETE", f"/v1/autoscalers/{name}")

    def rotate_key(self, role: str, grace_s: float) -> Rotated:
        body = RotateKey(role=role, grace_s=grace_s)
        return Rotated.model_validate(self._call("POST", "/v1/keys/rotate", json=body.model_dump()))

    def record_canary(self, record: CanaryRecord) -> CanaryRecord:
        return CanaryRecord.model_validate(self._call("PUT", "/v1/canary", json=record.model_dump()))

    def acquire_lease(self, holder: str, purpose: str, ttl_s: float = 120.0) -> Lease:
        body = LeaseRequest(holder=holder, purpose=purpose, ttl_s=ttl_s)
        return Lease.model_validate(self._call("PUT", "/v1/lease", json=body.model_dump()))

    def release_lease(self, holder: str) -> bool:
        return self._call("DELETE", "/v1/lease", params={"holder": holder})["released"]

    def events(self, limit: int = 200) -> list[Event]:
        return [Event.model_validate(e) for e in self._call("GET", "/v1/events", params={"limit": limit})]

    def down(self) -> None:
        self._call("POST", "/v1/down")

    def wait_for(self, name: str, states: set[GroupState], timeout_s: float, poll_s: float = 0.2) -> GroupView:
        """Poll until the group is in one of `states` (or `timeout_s` passes); its last view either way."""
        deadline = time.monotonic() + timeout_s
        while True:
            view = self.group(name)
            if view.state in states or time.monotonic() >= deadline:
                return view
            time.sleep(poll_s)

    # -- the router, as the canary and drains see it (same verbs as RouterAdmin) --------------------------
    def set_weights(self, weights: dict[str, float], wait_s: float = 30.0) -> dict[str, float]:
        """All of them or none; returns once every router replica routes by them (at most `wait_s`; 0: at once),
        so a canary step's clock starts when its traffic share is real."""
        answer = WeightsSet.model_validate(self._call("PUT", "/v1/weights", json={"weights": weights}))
        deadline = time.monotonic() + wait_s
        while wait_s > 0:
            state = self._call("GET", "/v1/routes/applied", params={"revision": answer.revision})
            if state["applied"]:
                break
            if time.monotonic() > deadline:
                raise ControlAPIError(f"weights {weights} are stored and published (revision {answer.revision}), but "
                                      f"{'no router replica is live' if not state['replicas'] else 'the router replicas'}"
                                      f" did not take them within {wait_s:g}s")
            time.sleep(0.05)
        return answer.weights

    def groups(self) -> list[dict]:
        return self._call("GET", "/v1/router/groups")["groups"]

    def inflight(self, name: str) -> int:
        return next((g["inflight"] for g in self.groups() if g["name"] == name), 0)

    def member_metrics(self) -> list[str]:
        return self._call("GET", "/v1/metrics/members")["texts"]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
