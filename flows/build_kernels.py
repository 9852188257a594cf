"""build_kernels: compile, verify and benchmark the custom ops for an arch (cached by source hash)."""

from __future__ import annotations

from prefect import flow

from flows.params import KernelParams
from kernels.spec import BuildManifest, BuildRequest
from tasks.kernels import compile_kernels


@flow(name="build_kernels", log_prints=True)
def build_kernels(params: KernelParams = KernelParams()) -> BuildManifest:
    return compile_kernels(BuildRequest(**params.model_dump()))
