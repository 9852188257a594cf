"""The generated reference pages match the code: a flag or a field changed without `make docs` fails here."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

REPO = Path(__file__).resolve().parents[1]


def test_the_reference_pages_are_those_the_code_generates():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "reference.py"), "--check"], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr


def test_the_check_fails_on_a_page_that_drifted(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import reference
    finally:
        sys.path.remove(str(REPO / "scripts"))
    monkeypatch.setattr(reference, "OUT", tmp_path)
    (tmp_path / "cli.md").write_text(reference.cli_page())
    (tmp_path / "config.md").write_text(reference.config_page().replace("| `alpha` | 0.05 |", "| `alpha` | 0.1 |"))
    monkeypatch.setattr(sys, "argv", ["reference.py", "--check"])
    assert reference.main() == 1
