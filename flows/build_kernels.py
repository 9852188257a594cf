"""build_kernels: compile, verify and benchmark the custom ops for an arch (cached by source hash)."""

from __future__ import annotations

from prefect import flow

from tasks.kernels import compile_kernels
from tideflow_kernels.spec import BuildManifest, BuildRequest


@flow(name="build_kernels", log_prints=True)
def build_kernels(request: BuildRequest = BuildRequest()) -> BuildManifest:
    return compile_kernels(request)
