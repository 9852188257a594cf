"""What tiers hold a member's KV blocks below its device pool, and how big and how long each may hold them.

Light on purpose (no torch): a group spec (roles[].engine.kv_tiers) and the serve CLI build it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MiB = 1 << 20
GiB = 1 << 30


class KVTierConfig(BaseModel):
    """G2 host memory, G3 a local directory, G4 a store every member reaches; each optional but G2, through which the
    others are written and read (an evicted block is copied to host memory first, and a block fetched from disk or
    the store lands there before it is onboarded)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host_bytes: int = Field(..., ge=64 << 10, description="G2: host memory for offloaded blocks, LRU (pageable, also on cuda)")
    host_ttl_s: float | None = Field(None, gt=0, description="G2: a block unused this long is dropped; None: size only")
    disk_path: str | None = Field(None, min_length=1, description="G3: a local directory for offloaded blocks; None: no G3")
    disk_bytes: int = Field(8 * GiB, ge=MiB, description="G3: most bytes kept in disk_path, LRU")
    disk_ttl_s: float | None = Field(24 * 3600.0, gt=0, description="G3: a block unused this long is deleted")
    disk_min_uses: int = Field(1, ge=1, description="G3 admits a block once this many requests used it (computed or "
                                                    "reused): written then, or when the KV cache evicts it (the "
                                                    "frequency filter that keeps one-off prompts off the disk)")
    store_url: str | None = Field(None, min_length=1,
                                  description="G4: s3://bucket/prefix/ or file:///dir/ shared by the fleet; None: no G4")
    store_ttl_s: float = Field(24 * 3600.0, ge=3600.0,
                               description="G4: objects older than this expire (an S3 lifecycle rule, rounded up to "
                                           "whole days, or the kv-gc deployment where the store has no lifecycle)")
    store_min_uses: int = Field(2, ge=1, description="G4 admits a block once this many requests used it, as disk_min_uses")
    store_timeout_s: float = Field(2.0, gt=0, le=60, description="G4: one read or write gives up after this; the "
                                                                 "block is then recomputed (reads) or not kept (writes)")
    queue_blocks: int = Field(512, ge=1, description="offload writes waiting for G3/G4; beyond it offload is skipped "
                                                      "(counted), never the request")


def tier_names(config: KVTierConfig) -> list[str]:
    """The configured tiers, nearest first."""
    return ["host"] + (["disk"] if config.disk_path else []) + (["store"] if config.store_url else [])
