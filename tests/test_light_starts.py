"""The processes that compute nothing start without torch: a router, a controller and the command parsers.

torch takes about two seconds of CPU to import (Prefect and the openai client most of another); a fleet starts two routers and a controller per restart, and the
test suite starts hundreds. Routers hash prompts, validate requests and place images with torch-free modules
(engine/core/sampling_params.py, block_hash.py, pd_messages.py, engine/encoder/prompt.py); this fails when an
import brings one of HEAVY back into one of them."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.fleet  # another Python process: this one has torch loaded already

HEAVY = ("torch", "numpy", "boto3", "prefect", "openai")


@pytest.mark.parametrize("code", [
    "import engine.router.app, engine.router.cli",
    "import engine.control.controller, engine.control.cli",
    "import engine.main; engine.main.build_parser()",
    "import flows.cli; flows.cli.build_parser()",
])
def test_starts_without_heavy_imports(code):
    probe = f"import sys\n{code}\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", f"{code!r} imports {done.stdout.strip()}"
