"""What bounds the shared KV store, run by the release pipeline: a lifecycle rule where the store has them (S3), a
sweep of expired objects where it has not (a directory: the kv-gc deployment), and the removal of a version's blocks
once no group serves it (rolled back or retired)."""

from __future__ import annotations

import math
import time

from pydantic import BaseModel, Field

from engine.kvtier.keys import version_prefix
from engine.weights.urls import open_store

KV_ROOT = "kv/"  # every block key starts here (engine.kvtier.keys.KVNamespace)


class StoreSweep(BaseModel):
    """What one pass over a KV store did."""

    url: str
    lifecycle: bool = Field(description="the store expires objects itself by a rule (nothing was deleted here)")
    objects_deleted: int = 0
    bytes_freed: int = 0


def sweep(url: str, ttl_s: float, now: float | None = None) -> StoreSweep:
    """Install (or confirm) the store's lifecycle rule on the KV keys; where it has none, delete the blocks written
    more than `ttl_s` ago."""
    store = open_store(url)
    if store.expire_prefix(KV_ROOT, max(1, math.ceil(ttl_s / 86400))):
        return StoreSweep(url=url, lifecycle=True)
    cutoff = (time.time() if now is None else now) - ttl_s
    report = StoreSweep(url=url, lifecycle=False)
    for listed in store.list_objects(KV_ROOT):
        if listed.modified < cutoff:
            store.delete(listed.key)
            report.objects_deleted += 1
            report.bytes_freed += listed.size
    return report


def remove_version(url: str, model: str, version: str) -> StoreSweep:
    """Delete every block of `version` of `model` (whatever its dtype or layout) from the store at `url`."""
    store = open_store(url)
    report = StoreSweep(url=url, lifecycle=False)
    for listed in store.list_objects(version_prefix(model, version)):
        store.delete(listed.key)
        report.objects_deleted += 1
        report.bytes_freed += listed.size
    return report
