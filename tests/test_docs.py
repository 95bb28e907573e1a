"""The docs stay true to the tree: the README is a front door (at most 10 KB), every relative link in the
Markdown resolves (file and heading), and every repository path the README names exists. Cheap: no imports of the
package, no subprocess."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([REPO / "README.md", REPO / "tests" / "README.md", *(REPO / "docs").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a path in backticks that starts at a top-level folder of the repository, e.g. `lit_lm/strategies/pp_schedules.py`
REPO_PATH = re.compile(r"`((?:configs|scripts|strategies|kernels|lit_lm|callbacks|tests|docs)/[\w./-]*[\w/])`")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    heads = (line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#"))
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_readme_is_at_most_10_kb() -> None:
    size = len((REPO / "README.md").read_bytes())
    assert size <= 10_000, f"README.md is {size} bytes; move detail to docs/ and link it"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for link in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link} (no such heading)")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


def test_paths_named_in_the_readme_exist() -> None:
    named = set(REPO_PATH.findall((REPO / "README.md").read_text()))
    assert named, "the pattern found no path: it is broken, not the README"
    missing = sorted(p for p in named if "<" not in p and not (REPO / p).exists())
    assert not missing, f"README.md names paths that do not exist: {missing}"


def test_yaml_files_named_in_the_readme_exist() -> None:
    """The parallelism table names its yaml files bare (`zero2.yaml`): each must be a file under configs/."""
    named = set(re.findall(r"`([\w-]+\.yaml)`", (REPO / "README.md").read_text()))
    assert named, "the pattern found no yaml: it is broken, not the README"
    present = {p.name for p in (REPO / "configs").rglob("*.yaml")}
    assert not named - present, f"README.md names yaml files not under configs/: {sorted(named - present)}"
