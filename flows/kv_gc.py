"""kv_gc: the scheduled sweep of the fleet's shared KV stores. A store without lifecycle rules (a directory) has its
expired blocks deleted, with the bytes freed in the run's artifact; an S3 bucket has its expiry rule confirmed."""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel, Field

from engine.kvtier.expiry import StoreSweep
from tasks.kv import kv_gc as sweep_stores


class KVGcParams(BaseModel):
    extra_stores: dict[str, float] = Field(
        default_factory=dict, description="stores no group names (any more) to sweep too: URL -> TTL in seconds")


@flow(name="kv_gc", log_prints=True)
def kv_gc(params: KVGcParams = KVGcParams()) -> list[StoreSweep]:
    """Changes no group: only blocks older than their store's TTL go."""
    return sweep_stores(params.extra_stores)
