"""One CPU build per test session, in a private TIDEFLOW_HOME, shared by every kernels test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tideflow_kernels import ops
from tideflow_kernels.build import build
from tideflow_kernels.loader import implementations
from tideflow_kernels.spec import BuildRequest


def cpu_flags() -> str:
    """The host's own word (the kernel build compiles for -march=native)."""
    return Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""


def cpu_has_amx() -> bool:
    return " amx_bf16" in cpu_flags() and " amx_tile" in cpu_flags()


def cpu_has_avx512() -> bool:
    return " avx512f" in cpu_flags()


@pytest.fixture(scope="session")
def tideflow_home(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    home = tmp_path_factory.mktemp("tideflow_home")
    mp.setenv("TIDEFLOW_HOME", str(home))
    try:
        yield home
    finally:
        mp.undo()


@pytest.fixture(scope="session")
def cpu_build(tideflow_home):
    """(manifest, op -> compiled function) of the packaged CPU sources, compiled once."""
    manifest = build(BuildRequest(arch="native", bench_iters=2, bench_hidden=256))
    impls = implementations("cpu", Path(manifest.artifact),
                            manifest.cache_key, ops.OP_NAMES)
    return manifest, impls


@pytest.fixture(autouse=True)
def reference_ops():
    """Every test starts and ends with the engine on the reference ops."""
    ops.use_reference()
    yield
    ops.use_reference()
