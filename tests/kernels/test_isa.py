"""TIDEFLOW_NO_AMX: a build without the AMX instructions beside the native one, and oneDNN capped below AMX."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tideflow_kernels import isa
from tideflow_kernels.build import cache_key_of
from tideflow_kernels.cpu import extension
from tideflow_kernels.spec import BuildRequest


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
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    isa.cap_libraries()
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == isa.LIBRARY_CAPS["MKL_ENABLE_INSTRUCTIONS"]


def test_onednn_takes_the_cap_and_computes_without_amx():
    """oneDNN ignores an ISA name it does not know: its own report of the ISA it uses shows the cap took."""
    probe = ("from tideflow_kernels import isa; isa.cap_libraries(); import torch; "
             "a = torch.ones(16, 64, dtype=torch.bfloat16); print(float((a @ a.T)[0, 0]))")
    env = {**os.environ, isa.NO_AMX_ENV: "1", "ONEDNN_VERBOSE": "1"}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    isa_lines = [ln for ln in done.stdout.splitlines() if ",info,cpu,isa:" in ln]
    if not isa_lines:
        pytest.skip("this torch's oneDNN ran no primitive for a bf16 matmul (no report of its ISA)")
    assert "AMX" not in isa_lines[0], isa_lines[0]
    assert done.stdout.strip().splitlines()[-1] == "64.0"
