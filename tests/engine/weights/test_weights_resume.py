"""A publish SIGKILLed half-way leaves no visible version and resumes from the parts it stored."""

import signal
import subprocess
import sys

import pytest

from engine.weights import ManifestMissingError, publish, verify
from engine.weights.manifest import read_manifest

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

KILL_AFTER = 3  # config.json (1 part) + 2 of the 3 parts of the first shard

_KILLED_PUBLISH = """
import os, signal, sys
from engine.weights import publish
src, url, part_size, kill_after, record = sys.argv[1:]

def on_progress(p):
    if p.parts_sent >= int(kill_after):
        with open(record, "w") as f:
            f.write(str(p.parts_sent))
        os.kill(os.getpid(), signal.SIGKILL)

publish(src, url, part_size=int(part_size), max_concurrency=2, progress=on_progress)
"""


def test_resume_after_killed_publish(backend, checkpoint, total_parts, tmp_path):
    record = tmp_path / "sent"
    proc = subprocess.Popen([
        sys.executable, "-c", _KILLED_PUBLISH, str(checkpoint), backend.url,
        str(backend.part_size), str(KILL_AFTER), str(record),
    ])
    try:
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    landed = int(record.read_text())
    assert landed >= KILL_AFTER

    with pytest.raises(ManifestMissingError):  # a reader never sees the half-published version
        verify(backend.url)

    store = backend.store()
    events = []
    report = publish(checkpoint, store, progress=events.append)
    unchanged_parts = 1  # config.json was committed before the kill
    assert report.files_unchanged == 1
    assert report.parts_reused >= landed - unchanged_parts
    assert report.parts_uploaded + report.parts_reused + unchanged_parts == total_parts
    assert report.parts_uploaded <= total_parts - landed
    assert store.counters.parts_uploaded == report.parts_uploaded
    assert events[-1].parts_sent == report.parts_uploaded
    assert read_manifest(backend.store()) == report.manifest
    verify(backend.url)
    verify(backend.url, deep=True)
