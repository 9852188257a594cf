"""`kernels build` through argparse, as the tideflow console script wires it."""

from __future__ import annotations

import argparse

import pytest

from tideflow_kernels.cli import add_commands

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def parse(argv):
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    return parser.parse_args(argv)


def test_build_command_prints_the_table_and_succeeds(cpu_build, capsys):
    args = parse(["kernels", "build", "--target", "rotary_embedding", "--arch", "native",
                  "--opt-level", "3", "--bench-iters", "2", "--bench-hidden", "256"])
    assert args.func(args) == 0
    out = capsys.readouterr()
    assert "rotary_embedding" in out.out and "verified" in out.out and "cache hit" in out.out


def test_build_command_rejects_an_unknown_op(tideflow_home, capsys):
    args = parse(["kernels", "build", "--target", "softmax"])
    assert args.func(args) == 2
    assert "target must be 'all' or one of" in capsys.readouterr().err
