"""Reads prefect.yaml (the shipped one is package data: flows/prefect.yaml) for `tideflow ui` (serve) and
the tests, through Prefect's public API only:
the YAML is validated here (pydantic), schedules become `prefect.schedules.Cron`, triggers
`prefect.events.DeploymentEventTrigger`, and each flow's `to_deployment` builds the RunnerDeployment."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml
from prefect.events import DeploymentEventTrigger
from prefect.flows import load_flow_from_entrypoint
from prefect.schedules import Cron
from pydantic import BaseModel, ConfigDict, Field

from engine.runtime.errors import TideflowError

# Entrypoints (flows/x.py:f) are relative to the directory that holds the flows package: the repository,
# or site-packages once installed; `prefect deploy` reads them relative to its working directory, the same.
ENTRYPOINT_ROOT = Path(__file__).resolve().parents[1]
# Every tideflow deployment, shipped inside the package so an installed `tideflow ui` finds it.
SHIPPED_PREFECT_FILE = Path(str(resources.files(__package__).joinpath("prefect.yaml")))


class DeploymentsFileError(TideflowError):
    """prefect.yaml cannot be read or holds a deployment this loader does not understand."""


class CronEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cron: str
    timezone: str | None = Field(None, description="IANA zone; unset: `schedule_timezone()`")
    active: bool = True


def schedule_timezone() -> str:
    """The zone of crons that name none: $TZ when it is an IANA name (Asia/Shanghai), else UTC."""
    zone = os.environ.get("TZ", "").lstrip(":")
    try:
        ZoneInfo(zone)
    except (ValueError, ZoneInfoNotFoundError):
        return "UTC"
    return zone or "UTC"


class DeploymentEntry(BaseModel):
    """One entry of prefect.yaml's `deployments:` (the keys `prefect deploy` reads that tideflow uses)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    entrypoint: str = Field(pattern=r"^[\w./-]+\.py:\w+$")
    description: str | None = None
    parameters: dict = Field(default_factory=dict)
    schedules: list[CronEntry] = Field(default_factory=list)
    triggers: list[DeploymentEventTrigger] = Field(default_factory=list)
    work_pool: dict = Field(default_factory=dict)


def deployment_entries(prefect_yaml: Path) -> list[DeploymentEntry]:
    """Each deployment of the file, validated; a wrong key or type names the deployment and the field."""
    try:
        data = yaml.safe_load(Path(prefect_yaml).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise DeploymentsFileError(f"{prefect_yaml}: {exc}") from None
    out = []
    for i, raw in enumerate(data.get("deployments") or []):
        try:
            out.append(DeploymentEntry.model_validate(raw))
        except ValueError as exc:
            raise DeploymentsFileError(f"{prefect_yaml}: deployment {raw.get('name', i)!r}: {exc}") from None
    return out


def load_deployments(prefect_yaml: Path) -> list:
    """RunnerDeployments to `prefect.serve`."""
    deployments = []
    for entry in deployment_entries(prefect_yaml):
        flow = load_flow_from_entrypoint(str(ENTRYPOINT_ROOT / entry.entrypoint), use_placeholder_flow=False)
        deployments.append(flow.to_deployment(
            name=entry.name, description=entry.description, parameters=entry.parameters, triggers=entry.triggers,
            schedules=[Cron(s.cron, timezone=s.timezone or schedule_timezone(), active=s.active)
                       for s in entry.schedules]))
    return deployments
