"""`tideflow drill load`: argparse wiring, a real run against the reference server, and bad specs."""

from __future__ import annotations

import argparse

import pytest

from drills.cli import add_commands
from harness.reference_server import ReferenceLatency, serve_reference

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tideflow")
    add_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_drill_load_runs_and_writes_reports(tmp_path, capsys):
    with serve_reference("ref", ReferenceLatency(ttft_s=0.01, tpot_s=0.005)) as url:
        args = _parse(["drill", "load", "--url", url, "--model", "ref", "--steps", "4,8", "--hold", "0.5",
                       "--arrival", "constant", "--output-len", "fixed:4", "--slo-ttft-ms", "2000",
                       "--out", str(tmp_path / "r"), "--no-progress", "--no-validate"])
        assert args.steps == [4.0, 8.0]
        assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "sent 6 = ok 6 + error 0" in out and "capacity watermark: 8 req/s (step 1)" in out
    assert (tmp_path / "r" / "steps.csv").is_file() and (tmp_path / "r" / "throughput.png").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--rate", "5"], "rate and duration_s go together"),
    (["--rate", "5", "--duration", "1", "--prompt-len", "uniform:9:1"], "bad length spec"),
])
def test_bad_specs_exit_2_with_the_reason(argv, message, capsys, tmp_path):
    args = _parse(["drill", "load", "--url", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path), *argv])
    assert args.func(args) == 2
    assert message in capsys.readouterr().err


def test_steps_must_be_numbers():
    with pytest.raises(SystemExit):
        _parse(["drill", "load", "--url", "http://x", "--model", "m", "--steps", "1,two", "--hold", "1"])
