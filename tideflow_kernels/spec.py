"""Pydantic types of a kernel build: what to build (request), how each op fared (result), and
the manifest written next to the cached artifact."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, computed_field, field_validator

OP_NAMES = ("rms_norm", "rotary_embedding", "topk_gating", "moe_experts", "paged_decode_attention")  # the custom ops
CPU_ARCHES = ("native", "cpu")
_CPU_MARCH = re.compile(r"^x86-64(-v[234])?$")
_CUDA_ARCH = re.compile(r"^sm_[0-9]{2,3}a?$")

OpStatus = Literal["verified", "unverified", "wrong_result", "compile_failed"]


# How a serving process picks its ops (tideflow_kernels.startup): the flag --kernels or this variable.
KERNELS_ENV = "TIDEFLOW_KERNELS"
KERNEL_MODES = ("auto", "cached", "reference")


def backend_of(arch: str) -> Literal["cpu", "cuda"]:
    """'cuda' for sm_XX targets, 'cpu' for native/cpu/x86-64-vN."""
    return "cuda" if _CUDA_ARCH.match(arch) else "cpu"


class BuildRequest(BaseModel):
    """One `kernels build`: which ops, for which arch, at which optimisation level."""

    target: str = Field("all", description="An op name or 'all'.")
    arch: str = Field(
        "native",
        description="CPU: 'native' (-march=native), 'cpu' (portable) or x86-64[-v2|-v3|-v4]; "
        "CUDA: sm_80, sm_90, ...",
    )
    opt_level: int = Field(3, ge=0, le=3, description="Compiler optimisation level -O0..-O3.")
    source_dir: Path | None = Field(
        None, description="Kernel sources to build instead of the packaged tideflow_kernels/csrc/<backend>."
    )
    tolerances: dict[str, float] = Field(
        default_factory=dict,
        description="Per-op relative error limit overriding the per-dtype defaults.",
    )
    bench_iters: int = Field(20, ge=1, le=10_000, description="Timed calls per op and side.")
    bench_hidden: int = Field(
        4096, ge=64, le=16384, description="Hidden size of the decode-like timing call (4 tokens)."
    )
    activate: bool = Field(
        False, description="Route this process's verified ops to the new build (tideflow_kernels.ops)."
    )

    @field_validator("target")
    @classmethod
    def _known_target(cls, v: str) -> str:
        if v != "all" and v not in OP_NAMES:
            raise ValueError(f"target must be 'all' or one of {', '.join(OP_NAMES)}; got {v!r}")
        return v

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, v: str) -> str:
        if v in CPU_ARCHES or _CPU_MARCH.match(v) or _CUDA_ARCH.match(v):
            return v
        raise ValueError(f"arch must be native, cpu, x86-64[-vN] or sm_XX; got {v!r}")

    @field_validator("tolerances")
    @classmethod
    def _known_ops(cls, v: dict[str, float]) -> dict[str, float]:
        for op, tol in v.items():
            if op not in OP_NAMES:
                raise ValueError(f"tolerances: unknown op {op!r}")
            if tol < 0:
                raise ValueError(f"tolerances[{op!r}] must be >= 0, got {tol}")
        return v

    @property
    def ops(self) -> tuple[str, ...]:
        return OP_NAMES if self.target == "all" else (self.target,)

    @property
    def backend(self) -> Literal["cpu", "cuda"]:
        return backend_of(self.arch)


class BuildResult(BaseModel):
    """How one op fared: verified against the reference, and timed against it."""

    op: str = Field(description="Op name (tideflow_kernels.ops.OP_NAMES).")
    status: OpStatus = Field(
        description="verified: matches the reference; unverified: compiled but no device here "
        "to run it; wrong_result / compile_failed: the build fails."
    )
    errors: dict[str, float] = Field(
        default_factory=dict, description="dtype -> max relative error over the check cases."
    )
    tolerances: dict[str, float] = Field(
        default_factory=dict, description="dtype -> relative error limit applied."
    )
    compiled_us: float | None = Field(None, description="Median call time of the compiled op (us).")
    reference_us: float | None = Field(None, description="Median call time of the reference (us).")
    message: str = Field("", description="Why it failed (compiler output, error vs limit), or why a variant won.")
    variant: str = Field("compiled", description="What the op is routed to: `compiled` (this build's kernel) or "
                                                 "`grouped_mm` (moe_experts on torch's grouped GEMM, where the "
                                                 "build measured it faster: tideflow_kernels.grouped_moe).")

    @computed_field
    @property
    def speedup(self) -> float | None:
        if self.compiled_us and self.reference_us:
            return round(self.reference_us / self.compiled_us, 3)
        return None


class BuildManifest(BaseModel):
    """Written to the cache next to the artifact; `tideflow_kernels.loader` picks builds from these."""

    target: str = Field(description="The request's target.")
    arch: str = Field(description="The request's arch.")
    backend: Literal["cpu", "cuda"] = Field(description="Which source set was built.")
    opt_level: int = Field(ge=0, le=3, description="Optimisation level.")
    flags: list[str] = Field(description="Compiler flags used (part of the cache key).")
    compiler: str = Field(description="Compiler version line.")
    torch_version: str = Field(description="torch.__version__ the artifact was built against.")
    source_hash: str = Field(description="sha256 over the source set's file names and contents.")
    cache_key: str = Field(description="Hash of source hash + flags + torch version + arch.")
    cache_hit: bool = Field(description="True when the artifact came from the cache (no compile).")
    artifact: str = Field(description="Path of the built library.")
    compile_s: float = Field(ge=0, description="Seconds spent compiling (0 on a cache hit).")
    created_at: datetime = Field(description="When this build finished (UTC).")
    results: list[BuildResult] = Field(description="One entry per op in the target.")

    @computed_field
    @property
    def ok(self) -> bool:
        return all(r.status in ("verified", "unverified") for r in self.results)

    def failures(self) -> list[BuildResult]:
        return [r for r in self.results if r.status in ("wrong_result", "compile_failed")]
