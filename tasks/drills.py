"""run_load_drill, run_fault_drill: drills against the serving fleet, results as tables and plots."""

from __future__ import annotations

import base64
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_image_artifact, create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from engine.drills.fault import FaultDrillReport, FaultDrillSpec, run_fault_drill as fault_drill
from engine.drills.load import run_load_drill as load_drill
from engine.drills.results import LoadDrillReport
from engine.drills.spec import LoadDrillSpec
from engine.control.client import ControlClient
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
    create_table_artifact(key="fault-drill", description=f"{spec.target} killed {spec.repeats}x in {spec.group}", table=[
        {"repeat": r.repeat, "killed": r.killed, "eject_ms": None if r.eject_s is None else round(r.eject_s * 1000),
         "recover_s": r.recover_s, "all_members_new": r.all_members_new, "sent": r.load.sent, "ok": r.load.ok,
         "error": r.load.error} for r in report.runs])
    create_markdown_artifact(key="fault-drill-summary", markdown=(
        f"### Fault drill: {spec.target} of {spec.group}\n\nsent {report.sent} = ok {report.ok} + error {report.errors}"
        f" ({'every request accounted for' if report.accounted else '**requests unaccounted**'})\n\n"
        + "\n".join(f"- {n} x {why}" for why, n in report.error_reasons.items())))
    return report
