"""The README is a user's page that stays short, and every link in it and in docs/ leads to a file in the repo."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(page: Path) -> list[str]:
    """Every link target in `page` that is not a web address or an anchor on the same page."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold code, not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_the_pattern_finds_links_and_images_and_leaves_web_addresses() -> None:
    text = "[a](docs/x.md) ![b](img.png \"title\") [c](https://e.org) [d](#top) [e](y.md#part)"
    found = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert found == ["docs/x.md", "img.png", "y.md#part"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves_to_a_file_in_the_repo(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to what the repo does not hold: {broken}"


def test_the_readme_has_links_to_check_and_stays_a_short_page() -> None:
    readme = ROOT / "README.md"
    assert len(relative_links(readme)) >= 10  # the check above would pass vacuously on a page without links
    lines = readme.read_text().count("\n")
    assert lines < 170, f"README.md has {lines} lines: move reference material to docs/ (limit 170)"
