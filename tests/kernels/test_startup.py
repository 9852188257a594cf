"""Serving processes build the compiled ops themselves on first start (cached by source hash), once per home
even when several start together, and say which ops they run; `cached` and `reference` build nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tideflow_kernels.spec import OP_NAMES
from tideflow_kernels.startup import startup_ops

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

PROBE = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr); "
         "from tideflow_kernels.startup import startup_ops; print(sorted(startup_ops('native', sys.argv[1])))")


def start(home, mode: str) -> subprocess.Popen:
    env = {**os.environ, "TIDEFLOW_HOME": str(home)}
    env.pop("TIDEFLOW_KERNELS", None)
    return subprocess.Popen([sys.executable, "-c", PROBE, mode], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[list[str], str]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    return eval(out.strip().splitlines()[-1]), err  # noqa: S307 - a list of op names printed by PROBE


def test_two_members_starting_together_compile_once_and_both_run_compiled(tmp_path):
    home = tmp_path / "home"
    first, second = start(home, "auto"), start(home, "auto")
    (ops_a, err_a), (ops_b, err_b) = finish(first), finish(second)
    assert ops_a == ops_b == sorted(OP_NAMES)
    compiled = [e for e in (err_a, err_b) if "compiling and verifying once" in e]
    assert len(compiled) == 1, (err_a[-1000:], err_b[-1000:])
    again, err = finish(start(home, "auto"))  # a restart loads the cached build
    assert again == sorted(OP_NAMES) and "compiling" not in err and "kernels: compiled native ops" in err


def test_cached_and_reference_build_nothing(tmp_path):
    assert finish(start(tmp_path / "fresh", "cached"))[0] == []
    ops, err = finish(start(tmp_path / "fresh", "reference"))
    assert ops == [] and "torch reference ops only" in err
    assert not (tmp_path / "fresh" / "kernels").exists() or not any((tmp_path / "fresh" / "kernels").rglob("*.so"))


def test_an_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="choose one of auto, cached, reference"):
        startup_ops("native", "fast")
