"""Committed docs name no path of the machine they were written on (README config tables used to print the
absolute default of the gate suites)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_docs_hold_no_absolute_path_of_this_machine():
    docs = [REPO / "README.md", *REPO.glob("deployments/**/*.md"), *REPO.glob("deployments/**/*.yaml")]
    needles = {str(REPO), str(Path.home()) + "/", "/tmp/pytest-of-"}
    found = [(d.relative_to(REPO), n) for d in docs for n in needles if n in d.read_text()]
    assert found == []
