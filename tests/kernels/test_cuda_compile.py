"""The CUDA sources compile with nvcc for sm_90 into one library exporting every
launcher; without a GPU the build records the ops as compiled but unverified."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from tideflow_kernels.build import build
from tideflow_kernels.cuda.library import SIGNATURES, nvcc
from tideflow_kernels.loader import load_cached
from tideflow_kernels.spec import BuildRequest

pytestmark = [pytest.mark.skipif(nvcc() is None, reason="nvcc not found (PATH, /usr/local/bin, /usr/local/cuda/bin)"), pytest.mark.fleet]


def test_cuda_sources_compile_for_sm_90(tideflow_home):
    arch = "sm_90"
    manifest = build(BuildRequest(arch=arch, opt_level=3, bench_iters=1, bench_hidden=256))
    assert manifest.backend == "cuda" and not manifest.cache_hit
    assert f"-arch={arch}" in manifest.flags and "release" in manifest.compiler
    assert Path(manifest.artifact).stat().st_size > 0
    lib = ctypes.CDLL(manifest.artifact)
    assert all(hasattr(lib, name) for name in SIGNATURES)
    if not torch.cuda.is_available():
        assert {r.status for r in manifest.results} == {"unverified"}
        assert load_cached(arch=arch) == {}  # unverified builds are never loaded
