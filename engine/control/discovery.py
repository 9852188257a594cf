"""How a flow run finds the controller: $TIDEFLOW_CONTROLLER_URL (+ _KEY), else the controller that
registered itself in $TIDEFLOW_HOME/controller.json (URL, admin key, pid; mode 0600).

The router's client key is kept apart, in $TIDEFLOW_HOME/router.key (0600), for load generators and users.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, Field

from engine.runtime.errors import TideflowError
from engine.runtime.paths import home
from engine.runtime.process import start_ticks
from tideflow_kernels.atomic_file import atomic_write_text

URL_ENV = "TIDEFLOW_CONTROLLER_URL"
KEY_ENV = "TIDEFLOW_CONTROLLER_KEY"


class NoController(TideflowError):
    """No controller answers here; `tideflow controller` starts one (`tideflow ui` and `make run` do too)."""


class ControllerInfo(BaseModel):
    url: str = Field(description="base URL of the control API")
    admin_key: str = Field(repr=False, description="bearer key of the control API")
    pid: int | None = Field(None, description="controller process on this machine (None: remote)")
    ticks: int | None = Field(None, description="its start time, so a reused pid is not taken for it")

    def local_process_alive(self) -> bool:
        return self.pid is not None and start_ticks(self.pid) == self.ticks


def info_path() -> Path:
    return home() / "controller.json"


def router_key_path() -> Path:
    return home() / "router.key"


def register(info: ControllerInfo, router_key: str) -> None:
    atomic_write_text(info_path(), info.model_dump_json(), mode=0o600)
    set_router_key(router_key)


def set_router_key(key: str) -> None:
    """The client key users and load generators read, replaced at once (a reader sees the old or the new)."""
    atomic_write_text(router_key_path(), key + "\n", mode=0o600)


def rekey(pid: int, admin_key: str) -> None:
    """The registration's admin key after a rotation, if the registration is this controller's."""
    try:
        info = ControllerInfo.model_validate_json(info_path().read_text())
    except (OSError, ValueError):
        return
    if info.pid == pid:
        atomic_write_text(info_path(), info.model_copy(update={"admin_key": admin_key}).model_dump_json(), mode=0o600)


def unregister(pid: int) -> None:
    """Remove the registration if it is still ours (a newer controller may have replaced it)."""
    try:
        if json.loads(info_path().read_text()).get("pid") == pid:
            info_path().unlink()
    except (OSError, ValueError):
        pass


def find() -> ControllerInfo:
    url = os.environ.get(URL_ENV)
    if url:
        key = os.environ.get(KEY_ENV)
        if not key:
            raise NoController(f"{URL_ENV} is set but {KEY_ENV} (the controller's admin key) is not")
        return ControllerInfo(url=url, admin_key=key)
    try:
        return ControllerInfo.model_validate_json(info_path().read_text())
    except FileNotFoundError:
        raise NoController(f"no controller registered in {info_path()} and {URL_ENV} is unset: "
                           "start one with `tideflow controller`") from None
    except ValueError as exc:
        raise NoController(f"{info_path()} is unreadable ({exc}); restart `tideflow controller`") from None


def router_key() -> str:
    try:
        return router_key_path().read_text().strip()
    except FileNotFoundError:
        raise NoController(f"no router key at {router_key_path()}: is a controller running here?") from None
