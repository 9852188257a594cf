"""TIDEFLOW_NO_AMX: a build without the AMX instructions beside the native one, and oneDNN capped below AMX."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from engine.runtime.process import tideflow_argv
from tideflow_kernels import isa
from tideflow_kernels.build import cache_key_of
from tideflow_kernels.cpu import extension
from tideflow_kernels.spec import BuildRequest

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def test_switched_off_the_cpu_build_drops_amx_and_is_cached_apart(monkeypatch):
    monkeypatch.delenv(isa.NO_AMX_ENV, raising=False)
    native = extension.flags("native", 3)
    key = cache_key_of(BuildRequest(arch="native"))
    monkeypatch.setenv(isa.NO_AMX_ENV, "1")
    assert extension.flags("native", 3) == [*native, "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
    assert cache_key_of(BuildRequest(arch="native")) != key  # never loads the AMX build, nor overwrites it
    assert "-mno-amx-tile" not in extension.flags("cpu", 3)  # a portable build has no AMX to drop


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_a_value_that_is_not_a_switch_is_refused(monkeypatch, value):
    monkeypatch.setenv(isa.NO_AMX_ENV, value)
    with pytest.raises(ValueError, match=isa.NO_AMX_ENV):
        isa.amx_off()


def test_the_users_own_library_cap_wins(monkeypatch):
    monkeypatch.setenv(isa.NO_AMX_ENV, "1")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "unset")  # recorded, so the cap set below is undone after the test
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    isa.cap_libraries()
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == isa.LIBRARY_CAPS["MKL_ENABLE_INSTRUCTIONS"]


@pytest.mark.skipif("amx_tile" not in (Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""),
                    reason="a host without AMX computes without it anyway: nothing to switch off")
def test_a_tideflow_command_computes_without_amx_when_told(tiny_model_dir):
    """Through the command as users run it: oneDNN ignores an ISA name it does not know, so its own report of the
    ISA it uses is what shows the cap took (and took before the command's first bf16 matmul)."""
    argv = tideflow_argv("generate", "--model", str(tiny_model_dir), "--prompt", "hello", "--max-tokens", "2",
                         "--dtype", "bfloat16", "--kernels", "reference")
    env = {k: v for k, v in os.environ.items() if k not in isa.LIBRARY_CAPS}
    for off in ("0", "1"):
        done = subprocess.run(argv, env={**env, isa.NO_AMX_ENV: off, "ONEDNN_VERBOSE": "1"}, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        reported = [ln for ln in done.stdout.splitlines() if ",info,cpu,isa:" in ln]
        assert reported, done.stdout[-2000:]  # a bf16 matmul went through oneDNN and said on what
        assert ("AMX" in reported[0]) == (off == "0"), (off, reported[0])
