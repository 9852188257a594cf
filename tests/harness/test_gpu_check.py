"""The prepared GPU check (scripts/gpu_check.sh -> harness.gpu_check) runs its steps on the CPU here, so it is
ready for the next machine with a GPU; and it fails when what it checks is wrong."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from harness import gpu_check
from tideflow_kernels import ops, reference

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_path_steps_pass_on_the_cpu(capsys, tideflow_home):
    assert gpu_check.main(["--device", "cpu", "--tiny", "--steps", "attention,parity,serve,dep2"]) == 0
    out = capsys.readouterr().out
    for step in ("attention", "parity", "serve", "dep2"):
        assert f"PASS {step}" in out
    assert "decisive greedy choices identical" in out
    assert "2 DEP ranks on cpu, openai client" in out


def test_the_decode_step_runs_on_the_tiny_model(capsys, tideflow_home):
    """--tiny draws its prompts within the tiny vocabulary (512 tokens), not up to 8000."""
    assert gpu_check.main(["--device", "cpu", "--tiny", "--steps", "decode"]) == 0
    assert "PASS decode" in capsys.readouterr().out


def test_a_wrong_attention_op_fails_the_check(capsys):
    """The check compares the routed op with SDPA: an op off by a little is caught."""
    def off_by_a_little(q, k_cache, v_cache, block_tables, context_lens, scale):
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale) + 1e-2

    ops.use_compiled("paged_decode_attention", off_by_a_little, "cpu")
    try:
        assert gpu_check.main(["--device", "cpu", "--steps", "attention"]) == 1
    finally:
        ops.use_reference()
    assert "FAIL attention" in capsys.readouterr().out


def test_unknown_steps_and_devices_are_refused(capsys):
    assert gpu_check.main(["--device", "cpu", "--steps", "kernels,warp"]) == 2
    assert "unknown steps warp" in capsys.readouterr().err
    assert gpu_check.main(["--device", "tpu"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: the script would run for real")
def test_the_script_says_why_it_cannot_run_without_a_gpu():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "sees no CUDA device" in done.stdout + done.stderr
