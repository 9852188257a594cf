"""Process-group setup for a DEP instance: gloo on CPU, NCCL on CUDA (chosen by the engine's device, not by whether
this host has a GPU), rendezvous over TCP at rank 0 (127.0.0.1 by default)."""

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
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$",
                        description="the engine's device: cuda ranks own one GPU each (cuda: the rank's own of the GPUs "
                                    "it sees), cpu ranks compute on the host")
    backend: Backend | None = Field(None, description="collective backend; None: nccl for cuda ranks, gloo for cpu ranks")
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
        return "nccl" if self.device.startswith("cuda") else "gloo"

    @property
    def torch_device(self) -> torch.device:
        """A cuda rank's GPU: the one named, else the rank's own among those it sees (a local backend shows each
        member only its own GPU, so that is cuda:0; ranks started by hand on one host spread by rank)."""
        if self.device == "cuda":
            return torch.device("cuda", self.rank % max(1, torch.cuda.device_count()))
        return torch.device(self.device)


def init(config: DistConfig) -> None:
    """Join the instance's default process group (blocks until every rank has joined)."""
    if config.resolved_backend == "nccl":
        torch.cuda.set_device(config.torch_device)
    dist.init_process_group(
        config.resolved_backend, init_method=f"tcp://{config.host}:{config.port}", rank=config.rank,
        world_size=config.world_size, timeout=timedelta(seconds=config.timeout_s),
    )


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
