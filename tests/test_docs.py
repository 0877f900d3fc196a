"""README.md is the front door (at most ~12 KB); docs/ holds the rest. Every relative link in them
resolves: the file exists and, with #anchor, a heading of that name (GitHub's slugs) is in it."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    out, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def test_readme_is_a_front_door():
    size = len((REPO / "README.md").read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes: move details into docs/ (limit 12 KB)"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    bad = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(REPO)}")
    assert not bad, f"{doc.relative_to(REPO)}: dead links:\n" + "\n".join(bad)


def test_no_doc_points_at_files_that_do_not_exist():
    """Comments in the tree name docs/*.md files: they must exist."""
    named = set()
    for path in [*REPO.glob(".ci/apt.d/*.txt"), *REPO.glob("tests/**/*.py"), *REPO.glob("scripts/*"),
                 *REPO.glob("nvsymlinkd/**/*.py"), REPO / "MANIFEST.in"]:
        if path.is_file():
            named |= set(re.findall(r"\bdocs/[\w-]+\.md\b", path.read_text(errors="replace")))
    missing = sorted(n for n in named if not (REPO / n).is_file())
    assert not missing, f"named in the tree but missing: {missing}"
