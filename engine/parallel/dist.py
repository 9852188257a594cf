"""Process-group setup for a DEP instance: gloo on CPU, NCCL on CUDA, rendezvous over TCP at rank 0 (127.0.0.1 by default)."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, model_validator

Backend = Literal["gloo", "nccl"]


class DistConfig(BaseModel):
    """Where one rank sits in its instance and how it finds the others."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(ge=0, description="this process's rank in the instance")
    world_size: int = Field(gt=0, description="ranks in the instance (the n of DEP<n>)")
    host: str = Field("127.0.0.1", min_length=1, description="host of rank 0's TCP store")
    port: int = Field(gt=0, lt=65536, description="TCP store port on `host`, served by rank 0")
    backend: Backend | None = Field(None, description="collective backend; None picks nccl with CUDA, else gloo")
    timeout_s: float = Field(60.0, gt=0, description="a collective that waits longer than this fails the rank")

    @model_validator(mode="after")
    def _check(self) -> "DistConfig":
        if self.rank >= self.world_size:
            raise ValueError(f"rank ({self.rank}) must be below world_size ({self.world_size})")
        return self

    @property
    def resolved_backend(self) -> Backend:
        if self.backend is not None:
            return self.backend
        return "nccl" if torch.cuda.is_available() else "gloo"

    @property
    def device(self) -> torch.device:
        """NCCL ranks own one GPU each; gloo ranks compute on the CPU."""
        if self.resolved_backend == "nccl":
            return torch.device("cuda", self.rank % torch.cuda.device_count())
        return torch.device("cpu")


def init(config: DistConfig) -> None:
    """Join the instance's default process group (blocks until every rank has joined)."""
    if config.resolved_backend == "nccl":
        torch.cuda.set_device(config.device)
    dist.init_process_group(
        config.resolved_backend, init_method=f"tcp://{config.host}:{config.port}", rank=config.rank,
        world_size=config.world_size, timeout=timedelta(seconds=config.timeout_s),
    )


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
