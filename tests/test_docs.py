"""The README and docs/*.md: every relative link points at a file that exists, and every #anchor
at a heading of its page (GitHub's slugs); every benchmarks/results/*.json the pages name exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def test_relative_links_and_anchors_resolve():
    broken = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_links_every_docs_page():
    readme = set(links(ROOT / "README.md"))
    missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in readme]
    assert not missing, f"README.md does not link {missing}"


def test_results_files_named_in_the_docs_exist():
    named = {m for page in PAGES
             for m in re.findall(r"benchmarks/results/([\w.-]+\.json)", page.read_text())}
    named |= {m for page in PAGES for m in re.findall(r"`([\w-]+\.json)`", page.read_text())
              if (ROOT / "benchmarks" / "results" / m).exists() or m.startswith(("pretrain_", "data_prep_"))}
    missing = sorted(m for m in named if not (ROOT / "benchmarks" / "results" / m).exists())
    assert not missing, f"named in the docs but not in benchmarks/results/: {missing}"
