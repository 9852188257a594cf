"""The engine thread's OpenMP team is pinned, thread i to the i-th CPU of the process, only when those CPUs
are exactly the team's; each case runs in its own process, so this one's threads stay where they are."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

# Restricts the process to the CPUs given, records the engine thread count, optionally loads the CPU build,
# then claims on a fresh thread (as the engine thread does) and reports what it pinned and where it runs.
CLAIM = """
import json, os, sys, threading
cpus, threads, key = json.loads(sys.argv[1])
os.sched_setaffinity(0, cpus)
from engine.runtime import intraop
intraop.serial_process(threads)
if key:
    from tideflow_kernels.loader import load_cached
    load_cached("native", key)
out = {}
def engine_thread():
    out["pinned"] = intraop.claim()
    out["affinity"] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=engine_thread)
t.start(); t.join()
print(json.dumps(out))
"""


def claim(cpus: list[int], threads: int, key: str | None) -> dict:
    done = subprocess.run([sys.executable, "-c", CLAIM, json.dumps([cpus, threads, key])], capture_output=True,
                          text=True, timeout=120, env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_team_with_the_process_s_cpus_to_itself_is_pinned_thread_by_thread(cpu_build):
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    got = claim(cpus, 2, cpu_build[0].cache_key)
    assert got == {"pinned": cpus, "affinity": cpus[:1]}  # each thread on its own CPU; the engine thread on the first


def test_nothing_is_pinned_when_the_cpus_are_not_the_team_s_alone_or_no_build_is_loaded(cpu_build):
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    assert claim(cpus, 1, cpu_build[0].cache_key) == {"pinned": None, "affinity": cpus}  # a member sharing a host
    assert claim(cpus, 2, None) == {"pinned": None, "affinity": cpus}  # torch's reference ops only
