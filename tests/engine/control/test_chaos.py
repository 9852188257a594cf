"""The chaos run's short version (benchmarks/chaos.py, 60 s): controller, routers, members and the load as
separate processes, every kind of fault injected (and seen to land) at least once, and every invariant held."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
CHAOS = Path(__file__).resolve().parents[3] / "benchmarks" / "chaos.py"


def test_a_minute_of_chaos_keeps_every_invariant(tmp_path):
    run = subprocess.run([sys.executable, str(CHAOS), "--duration-s", "60", "--fault-every-s", "8", "--seed", "1"],
                         capture_output=True, text=True, timeout=800, cwd=tmp_path)
    out = run.stdout
    print(out, run.stderr[-3000:])
    injected = re.search(r"faults injected: (\d+) (\{.*?\});", out)
    assert injected and int(injected.group(1)) >= 5, out
    kinds = ast.literal_eval(injected.group(2))
    assert set(kinds) == {"member-kill", "member-stop", "controller", "router", "release"}, kinds
    sent = re.search(r"requests: sent (\d+), completed (\d+)", out)
    assert sent and int(sent.group(1)) > 100 and int(sent.group(2)) > 0, out
    invariants = dict(re.findall(r"invariant (.+): (\S+)", out))
    assert len(invariants) == 6 and all(v == "0" for v in invariants.values()), invariants
    assert run.returncode == 0
