"""publish_weights, verify_weights, pull_weights: thin wrappers over engine.weights."""

from __future__ import annotations

import hashlib
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event

from engine.weights import PublishReport, PullReport, VerifyReport, open_store, publish, pull, verify
from engine.weights.manifest import read_manifest
from engine.weights.progress import Progress
from tasks.progress import ProgressArtifact
from tasks.retry import BACKOFF, JITTER, retry_unless_permanent

PUBLISHED_EVENT = "tideflow.weights.published"


def _feed(artifact: ProgressArtifact):
    def callback(p: Progress) -> None:
        artifact.update(p.bytes_done, p.bytes_total)
    return callback


@task(name="publish_weights", retries=3, retry_delay_seconds=BACKOFF, retry_jitter_factor=JITTER,
      retry_condition_fn=retry_unless_permanent, timeout_seconds=3600)
def publish_weights(src: Path, dest: str, model: str, version: str, force: bool = False,
                    announce: bool = True) -> PublishReport:
    """Retried on store errors (a retry resumes from the parts already stored), never on a conflict. `announce`
    emits tideflow.weights.published, the event the canary-release deployment is triggered by."""
    report = publish(src, dest, force=force, progress=_feed(ProgressArtifact("publish-weights", f"publishing {src} to {dest}")))
    get_run_logger().info("published %s: %d parts uploaded, %d reused, %d files unchanged", report.url,
                          report.parts_uploaded, report.parts_reused, report.files_unchanged)
    if announce:
        emit_event(event=PUBLISHED_EVENT, resource={"prefect.resource.id": f"tideflow.weights.{model}.{version}",
                                                    "tideflow.model": model, "tideflow.version": version},
                   payload={"url": report.url, "manifest_digest": report.manifest.digest})
    create_markdown_artifact(key="weights-published", markdown=(
        f"### Weights {model} {version}\n\n{report.url}\n\n| files | bytes uploaded | parts uploaded | parts reused |\n"
        f"|---|---|---|---|\n| {len(report.manifest.files)} | {report.bytes_uploaded} | {report.parts_uploaded} | {report.parts_reused} |"))
    return report


def _manifest_digest_key(context, parameters) -> str | None:
    """Cache verification by manifest digest at that URL: the same manifest verified once there stays verified."""
    try:
        manifest = read_manifest(open_store(parameters["url"]))
    except Exception:
        return None
    where = hashlib.sha256(parameters["url"].encode()).hexdigest()[:16]
    return f"verify-{where}-{manifest.digest}-{'deep' if parameters.get('deep') else 'shallow'}"


@task(name="verify_weights", retries=2, retry_delay_seconds=BACKOFF, retry_jitter_factor=JITTER,
      retry_condition_fn=retry_unless_permanent, cache_key_fn=_manifest_digest_key, timeout_seconds=3600)
def verify_weights(url: str, deep: bool = False) -> VerifyReport:
    return verify(url, deep=deep)


@task(name="pull_weights", retries=3, retry_delay_seconds=BACKOFF, retry_jitter_factor=JITTER,
      retry_condition_fn=retry_unless_permanent, timeout_seconds=3600)
def pull_weights(url: str, cache_dir: Path) -> PullReport:
    report = pull(url, cache_dir, progress=_feed(ProgressArtifact("pull-weights", f"pulling {url}")))
    get_run_logger().info("pull %s -> %s: %s", url, cache_dir,
                          "cache already verified" if report.noop else f"{report.files_fetched} files fetched")
    return report
