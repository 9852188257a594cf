"""The engine's tunables, modelled once: `tideflow serve` takes them as flags, a group spec sets them per role
(roles[].engine), and the engine loop reads them. Light on purpose (no torch), so specs and CLIs import it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.kvtier.config import KVTierConfig

DEFAULT_KV_FRACTION = 0.2  # of available memory, when a config gives neither kv_cache_bytes nor kv_cache_fraction


class EngineKnobs(BaseModel):
    """One serving engine's knobs, with one set of defaults wherever they are given."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV cache block (a power of two)")
    max_num_seqs: int = Field(64, ge=1, description="most sequences in the running batch")
    max_batch_tokens: int = Field(2048, ge=1, description="token budget of one model step (decode tokens + prefill chunks)")
    step_target_ms: float | None = Field(
        None, gt=0, le=60_000, description="while sequences decode, a step holds only the prefill that fits this, at "
                                           "the time per token the engine measured, so prompts arriving together "
                                           "(a failed member's moved requests, a burst) do not stall every stream "
                                           "for one long step; costs throughput when prompts keep coming (more, "
                                           "shorter steps); None: every step may hold max_batch_tokens")
    kv_cache_bytes: int | None = Field(None, gt=0, description="KV cache size in bytes (exclusive with kv_cache_fraction)")
    kv_cache_fraction: float | None = Field(
        None, gt=0.0, le=0.95, description="KV cache size as a fraction of available memory; default 0.2 when neither is given"
    )
    max_wait_ms: float = Field(
        2.0, ge=0.0, le=1000.0,
        description="shuttle window: how long arrivals gather before departing together; 0 dispatches at once "
        "(2 ms won the window sweep of benchmarks/serving.py)",
    )
    lone_arrival_ms: float = Field(
        20.0, ge=0.0, le=60_000.0,
        description="an arrival with no other in the last this many ms departs without waiting out the shuttle window "
        "(nobody is likely to join it); arrivals closer together still gather; 0: every window waits max_wait_ms",
    )
    max_queue: int = Field(256, ge=0, description="requests allowed to wait for admission; beyond it requests get 429 (`queue_full`)")
    max_client_tokens: int | None = Field(
        None, ge=0, description="most tokens (prompt + max_tokens of its unfinished requests) one client (API key) may "
                                "have open in this engine; beyond it its requests get 429 (a client holding nothing, "
                                "and an unnamed one, is always admitted); None: 16 x the context (a chat request "
                                "without max_tokens counts the whole context); 0 = no cap")
    enable_prefix_cache: bool = Field(True, description="reuse KV blocks of shared prompt prefixes")
    kv_tiers: KVTierConfig | None = Field(
        None, description="host memory, local disk and a shared store below the KV cache: evicted blocks are kept "
                          "there and a prompt's blocks found there are loaded instead of computed (engine.kvtier); "
                          "None: the KV cache alone")
    enforce_eager: bool = Field(False, description="on cuda, run decode steps eagerly instead of replaying them as "
                                                   "CUDA graphs captured per batch-size bucket at start "
                                                   "(engine.core.decode_graphs); the CPU always runs eagerly")
    scheduling: Literal["fair", "fcfs"] = Field(
        "fair", description="fair: steps, running slots and KV blocks are shared between clients (API keys) by tokens "
                            "served, so one client's flood costs another a step, not its queue; fcfs: first come, "
                            "first served")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"block_size {value} must be a power of two")
        return value

    @model_validator(mode="after")
    def _one_budget(self) -> "EngineKnobs":
        if self.kv_cache_bytes is not None and self.kv_cache_fraction is not None:
            raise ValueError("give kv_cache_bytes or kv_cache_fraction, not both")
        return self


class EngineConfig(EngineKnobs):
    """The knobs plus what only the serving process knows: the served name, dtype and device."""

    model_name: str | None = Field(None, description="model id served on /v1/models; default: the model directory's name")
    version: str = Field("", max_length=128,
                         description="the weights version served (a group's version): names this engine's blocks in "
                                     "the shared KV tiers, so a release pipeline can remove a version's KV")
    dtype: Literal["float32", "bfloat16"] | None = Field(None, description="weight/activation dtype; default: the checkpoint's")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$",
                        description="torch device for weights and KV cache: cpu, cuda (the first GPU the process sees) "
                                    "or cuda:<index>")
