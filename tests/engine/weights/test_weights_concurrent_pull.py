"""Two processes pulling the same version into one cache leave one correct cache."""

import json
import subprocess
import sys

import pytest

from engine.weights import publish, require_verified

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

_PULL = """
import json, sys
from engine.weights import pull
r = pull(sys.argv[1], sys.argv[2], max_concurrency=2)
print(json.dumps({"noop": r.noop, "bytes": r.bytes_fetched}))
"""


def test_concurrent_pulls_leave_one_correct_cache(backend, checkpoint, tmp_path):
    manifest = publish(checkpoint, backend.store()).manifest
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen([sys.executable, "-c", _PULL, backend.url, str(cache)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    results = sorted((json.loads(out) for out, _ in outputs), key=lambda r: r["bytes"])
    total = sum(f.size for f in manifest.files)
    # The lock serialises them: one downloads everything, the other finds a verified cache.
    assert results == [{"noop": True, "bytes": 0}, {"noop": False, "bytes": total}]
    assert require_verified(cache, deep=True) == manifest
    for entry in manifest.files:
        assert (cache / entry.path).read_bytes() == (checkpoint / entry.path).read_bytes()
    assert not list(cache.rglob("*.tideflow-partial"))
