"""Retry rules shared by the tasks: back off exponentially with jitter, never retry what cannot heal."""

from __future__ import annotations

from prefect.tasks import exponential_backoff

from engine.weights.errors import ChecksumMismatchError, ManifestInvalidError, VersionConflictError

BACKOFF = exponential_backoff(backoff_factor=2)  # 2, 4, 8 ... seconds
JITTER = 0.5

# Corrupt bytes, conflicting versions and failed gates give the same answer on every try.
PERMANENT = (ChecksumMismatchError, VersionConflictError, ManifestInvalidError, ValueError)


def retry_unless_permanent(task, task_run, state) -> bool:
    """Prefect retry_condition_fn: retry a failed run unless its exception is permanent."""
    try:
        state.result()
    except PERMANENT:
        return False
    except Exception:
        return True
    return False
