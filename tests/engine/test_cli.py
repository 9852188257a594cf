"""The model commands through the real console script."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tideflow_kernels.spec import KERNELS_ENV

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def run(*args, env_home):
    """In a fresh home, with the kernel build the suite already made or torch's ops (tests/conftest.py): the
    first-start build is tests/kernels/test_startup.py's to test, not every command's."""
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, timeout=120,
                          env={"TIDEFLOW_HOME": str(env_home), "PATH": "/usr/bin:/bin",
                               KERNELS_ENV: os.environ.get(KERNELS_ENV, "cached")})


def test_model_init_then_generate(tmp_path):
    init = run("model", "init", str(tmp_path / "m"), "--tiny", env_home=tmp_path)
    assert init.returncode == 0, init.stderr
    assert (tmp_path / "m" / "model.safetensors").is_file()
    gen = run("generate", "--model", str(tmp_path / "m"), "--prompt", "hello", "--max-tokens", "5", env_home=tmp_path)
    assert gen.returncode == 0, gen.stderr
    assert "tokens/s" in gen.stdout and "--- prompt: 'hello'" in gen.stdout


def test_bad_checkpoint_is_one_line_error(tmp_path):
    out = run("generate", "--model", str(tmp_path), env_home=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == f"tideflow: error: {tmp_path} has no config.json: point --model at a Hugging Face checkpoint directory"
