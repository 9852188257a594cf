"""Committed docs name no path of the machine they were written on (README config tables used to print the
absolute default of the gate suites), and every relative link between them leads to a file and heading that
exist (the README is a front door to docs/: a moved page or a renamed heading must not leave it pointing at
nothing). The README stays a front door: at most 200 lines."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted(REPO.glob("docs/**/*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_docs_hold_no_absolute_path_of_this_machine():
    docs = [*PAGES, *REPO.glob("deployments/**/*.md"), *REPO.glob("deployments/**/*.yaml")]
    needles = {str(REPO), str(Path.home()) + "/", "/tmp/pytest-of-"}
    found = [(d.relative_to(REPO), n) for d in docs for n in needles if n in d.read_text()]
    assert found == []


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    return broken


def test_every_relative_link_resolves():
    found = {str(p.relative_to(REPO)): b for p in PAGES if (b := broken_links(p))}
    assert found == {}


def test_a_broken_link_is_caught(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    page.write_text("[ok](there.md#a-heading) [gone](missing.md) [bad anchor](there.md#nowhere)\n")
    assert broken_links(page) == ["missing.md", "there.md#nowhere"]


def test_readme_is_a_front_door():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200
