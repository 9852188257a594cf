"""Reads deployments/prefect.yaml with Prefect's own loaders, for `tideflow ui` (serve) and the tests."""

from __future__ import annotations

from pathlib import Path

from prefect.cli.deploy._config import _load_deploy_configs_and_actions
from prefect.cli.deploy._schedules import _construct_schedules
from prefect.cli.deploy._triggers import _initialize_deployment_triggers
from prefect.client.schemas.actions import DeploymentScheduleCreate
from prefect.flows import load_flow_from_entrypoint
from rich.console import Console

REPO = Path(__file__).resolve().parents[1]


def deployment_configs(prefect_yaml: Path) -> list[dict]:
    """Each deployment as Prefect's CLI sees it, with schedules and triggers built by Prefect."""
    console = Console(stderr=True)
    configs, _ = _load_deploy_configs_and_actions(prefect_yaml, console=console)
    out = []
    for config in configs:
        config = dict(config)
        config["schedules"] = _construct_schedules(config, {}, console=console, is_interactive=lambda: False) or []
        config["triggers"] = _initialize_deployment_triggers(config["name"], config.get("triggers") or [])
        out.append(config)
    return out


def load_deployments(prefect_yaml: Path) -> list:
    """RunnerDeployments to `prefect.serve` (entrypoints are relative to the repository)."""
    deployments = []
    for config in deployment_configs(prefect_yaml):
        flow = load_flow_from_entrypoint(str(REPO / config["entrypoint"]), use_placeholder_flow=False)
        deployments.append(flow.to_deployment(
            name=config["name"], description=config.get("description"), parameters=config.get("parameters") or {},
            schedules=[DeploymentScheduleCreate(**s) for s in config["schedules"]], triggers=config["triggers"]))
    return deployments
