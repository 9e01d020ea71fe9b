"""Every relative link in README.md and docs/*.md reaches a file that exists, and a link's
`#anchor` into a Markdown page names one of its headings (GitHub's heading ids). Pure:
reads the files, no network; external links (`https:`, `mailto:`) are not followed."""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def pages(root: Path) -> list[Path]:
    """README.md and every docs/*.md page."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out: list[tuple[int, str]] = []
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's id for a heading: its text lower-cased, every character but letters,
    marks, digits, `_`, `-` and spaces dropped, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "").lower()
    kept = (
        c
        for c in text
        if c in " -" or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc"
    )
    return "".join(kept).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The ids of a Markdown page's headings, repeats numbered as GitHub does (`x`, `x-1`)."""
    seen: Counter[str] = Counter()
    out: set[str] = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if m is None:
            continue
        base = slug(m.group(2))
        out.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return out


def broken_links(root: Path) -> list[str]:
    """`page:line: target (why)` for every relative link that reaches nothing."""
    problems: list[str] = []
    cache: dict[Path, set[str]] = {}
    for page in pages(root):
        for n, line in prose_lines(page.read_text(encoding="utf-8")):
            for m in LINK.finditer(INLINE_CODE.sub("code", line)):
                target = m.group(1)
                if EXTERNAL.match(target):
                    continue
                path_part, _, anchor = target.partition("#")
                dest = (page.parent / path_part).resolve() if path_part else page
                where = f"{page.relative_to(root)}:{n}: {target}"
                if not dest.exists():
                    problems.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md":
                    if dest not in cache:
                        cache[dest] = anchors(dest)
                    if anchor not in cache[dest]:
                        problems.append(f"{where} (no such heading)")
    return problems


def test_every_relative_link_in_the_docs_reaches_a_file_and_heading() -> None:
    assert broken_links(ROOT) == []


def test_a_missing_file_or_heading_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [gone](docs/gone.md) [web](https://example.org/x.md)\n"
        "`[in code](docs/nope.md)`\n```\n[fenced](docs/nope.md)\n```\n"
    )
    (tmp_path / "docs" / "a.md").write_text(
        "# A page\n\n## Wave 2, session 3: `bench/x.py` (ratio ≤ 2)\n\n## Again\n\n## Again\n"
        "[self](#a-page) [deep](a.md#wave-2-session-3-benchxpy-ratio--2) [repeat](#again-1)\n"
        "[bad](#no-such-heading) [up](../README.md)\n"
    )
    assert broken_links(tmp_path) == [
        "README.md:1: docs/gone.md (no such file)",
        "docs/a.md:9: #no-such-heading (no such heading)",
    ]
