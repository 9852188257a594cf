"""A Prefect progress artifact fed by the engine's progress callbacks (throttled to whole percents)."""

from __future__ import annotations

from prefect.artifacts import create_progress_artifact, update_progress_artifact


class ProgressArtifact:
    def __init__(self, key: str, description: str) -> None:
        self._id = create_progress_artifact(progress=0.0, key=key, description=description)
        self._last = -1

    def update(self, done: float, total: float) -> None:
        pct = int(100 * done / total) if total else 100
        if pct != self._last:
            self._last = pct
            update_progress_artifact(artifact_id=self._id, progress=float(pct))
