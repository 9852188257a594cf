"""run_load_drill, run_fault_drill: drills against the serving fleet, results as tables and plots."""

from __future__ import annotations

import base64
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_image_artifact, create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from drills.fault import FaultDrillError, FaultDrillReport, FaultDrillSpec, run_fault_drill as fault_drill
from drills.load import run_load_drill as load_drill
from drills.results import LoadDrillReport
from drills.spec import LoadDrillSpec
from engine.control.client import ControlClient
from drills.fault_report import write_fault_report
from engine.group.manager import GroupState
from engine.runtime.paths import home
from tasks.progress import ProgressArtifact


def _attach_plots(files: dict[str, str], prefix: str) -> None:
    for kind, path in files.items():
        p = Path(path)
        if p.suffix == ".png":
            data = base64.b64encode(p.read_bytes()).decode()
            create_image_artifact(image_url=f"data:image/png;base64,{data}", key=f"{prefix}-{kind}".replace("_", "-"),
                                  description=f"{prefix}: {kind}")
        else:
            create_link_artifact(link=p.resolve().as_uri(), link_text=p.name, key=f"{prefix}-{kind}".replace("_", "-"))


@task(name="run_load_drill", cache_policy=NO_CACHE, timeout_seconds=3600)
def run_load_drill(spec: LoadDrillSpec) -> LoadDrillReport:
    """No retries: a drill is a measurement; rerunning it would hide what happened."""
    progress = ProgressArtifact("load-drill", f"load drill against {spec.url}")
    report = load_drill(spec.model_copy(update={"progress_bar": False}),
                        progress=lambda p: progress.update(p.done, p.total))
    create_table_artifact(key="load-drill-steps", table=report.step_frame().to_dict(orient="records"),
                          description=f"sent {report.sent} = ok {report.ok} + error {report.error}; "
                                      f"capacity {report.capacity_rps} req/s")
    _attach_plots(report.files, "load-drill")
    get_run_logger().info("load drill: capacity %s req/s, %d/%d ok", report.capacity_rps, report.ok, report.sent)
    return report


@task(name="run_fault_drill", cache_policy=NO_CACHE, timeout_seconds=3600)
def run_fault_drill(spec: FaultDrillSpec) -> FaultDrillReport:
    """The controller kills the member; this process only sends load and watches."""
    logger = get_run_logger()
    with ControlClient.connect() as client:
        report = fault_drill(client, spec, progress=logger.info)
    create_table_artifact(key="fault-drill", description=f"{spec.target} killed {spec.repeats}x in {spec.group}",
                          table=report.table())
    create_markdown_artifact(key="fault-drill-summary", markdown=(
        f"### Fault drill: {spec.target} of {spec.group}\n\nsent {report.sent} = ok {report.ok} + error {report.errors}"
        f" ({'every request accounted for' if report.accounted else '**requests unaccounted**'}); "
        f"{report.migrated} migrated; lost tokens {report.lost_tokens}, duplicated {report.duplicated_tokens}: "
        f"{'**nothing lost**' if report.clean else '**not clean**'}\n\n"
        + "\n".join(f"- {n} x {why}" for why, n in report.error_reasons.items())))
    _attach_plots(write_fault_report(report, home() / "drills" / "fault-latest"), "fault-drill")
    return report


@task(name="start_standby_copy", cache_policy=NO_CACHE, timeout_seconds=1800)
def start_standby_copy(group: str, timeout_s: float = 600.0) -> str:
    """A silent copy of `group` (same spec but the name) for the controller's warm replacement to use."""
    with ControlClient.connect() as client:
        spec = client.group(group).spec
        if spec is None:
            raise FaultDrillError(f"the controller does not report group {group}'s spec")
        copy = spec.model_copy(update={"name": f"{group}-warm"})
        client.apply(copy, weight=client.group(group).weight, standby=True)
        view = client.wait_for(copy.name, {GroupState.STANDBY, GroupState.FAILED}, timeout_s)
    if view.state != GroupState.STANDBY:
        raise FaultDrillError(f"the standby copy {copy.name} did not come up: {view.message}")
    get_run_logger().info("standby copy %s is loaded and warm", copy.name)
    return copy.name


@task(name="restore_after_standby_drill", cache_policy=NO_CACHE, timeout_seconds=1800)
def restore_after_standby_drill(group: str, copy: str, timeout_s: float = 600.0) -> None:
    """Back to the fleet as it was: the drilled group serves under its own name and the copy is removed.
    After a takeover the copy serves and `group` was rebuilt into the pool: `group` is activated first."""
    with ControlClient.connect() as client:
        view = client.wait_for(group, {GroupState.READY, GroupState.STANDBY, GroupState.FAILED}, timeout_s)
        if view.state == GroupState.STANDBY:
            took = client.activate(group)
            get_run_logger().info("%s serves again (activated in %.0f ms); removing %s", group, took * 1000, copy)
        client.delete(copy)
