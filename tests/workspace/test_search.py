"""substrate.workspace.search in-process: fs.search on a real temp workspace, and the
prefilter (pure), which must never change a result."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import pytest

from substrate.errors import InvalidParams
from substrate.matching.re2_translate import first_start
from substrate.schema.fs import SearchMatch, SearchParams
from substrate.workspace import search as search_module
from substrate.workspace.registry import Workspace
from tests.harness.read_tree import FILES

WS = "ws_test"

# FILES and the registry/root/ws fixtures: tests/harness/read_tree.py


def search(ws: Workspace, pattern: str, **kw: Any) -> list[tuple[str, int, int, str]]:
    result = search_module.search(ws, SearchParams(workspace=WS, pattern=pattern, **kw))
    return [(m.path, m.line, m.column, m.text) for m in result.matches]


def test_search_regex_lines_and_columns(ws: Workspace) -> None:
    assert search(ws, r"^def \w+") == [
        ("src/main.py", 3, 1, "def main() -> None:"),
        ("src/main.py", 7, 1, "def helper():"),
        ("src/pkg/deep.py", 1, 1, "def deep():"),
    ]
    assert search(ws, "gamma") == [("docs/a.txt", 3, 1, "gamma")]  # last line, no newline
    assert search(ws, "print") == [("src/main.py", 4, 5, "    print('hello')")]


def test_search_one_match_per_line_and_counts(ws: Workspace, root: Path) -> None:
    (root / "twice.txt").write_text("x hello hello\nhello\n")
    assert search(ws, "hello", glob="twice.txt") == [
        ("twice.txt", 1, 3, "x hello hello"),
        ("twice.txt", 2, 1, "hello"),
    ]
    result = search_module.search(ws, SearchParams(workspace=WS, pattern="hello", glob="twice.txt"))
    assert (result.files_scanned, result.bytes_scanned, result.truncated) == (1, 20, False)


def test_search_fixed_and_ignore_case(ws: Workspace) -> None:
    assert search(ws, "main() -> None", fixed=True) == [
        ("src/main.py", 3, 5, "def main() -> None:")
    ]
    assert search(ws, "main() -> None") == []  # as a regex, `()` is a group
    assert [m[:2] for m in search(ws, "HELLO =")] == [("src/util.py", 2)]
    insensitive = search(ws, "hello", ignore_case=True, glob="util.py")
    assert insensitive == [("src/util.py", 2, 1, "HELLO = 'Hello'")]


def test_search_glob(ws: Workspace) -> None:
    every_py = {m[0] for m in search(ws, "def", glob="*.py")}
    assert every_py == {"src/main.py", "src/pkg/deep.py"}
    top_py = {m[0] for m in search(ws, "def", glob="src/*.py")}
    assert top_py == {"src/main.py"}
    assert {m[0] for m in search(ws, "hello", glob="docs/")} == set()
    assert {m[0] for m in search(ws, "hello", path="src")} == {"src/main.py", "src/pkg/deep.py"}


def test_search_bad_glob_names_the_glob_field(ws: Workspace) -> None:
    with pytest.raises(InvalidParams) as info:
        search_module.search(ws, SearchParams(workspace=WS, pattern="x", glob="!x"))
    assert info.value.data["path"] == "$.glob"


def test_search_bad_regex(ws: Workspace) -> None:
    with pytest.raises(InvalidParams) as info:
        search_module.search(ws, SearchParams(workspace=WS, pattern="(unclosed"))
    assert info.value.data["path"] == "$.pattern"
    assert search(ws, "(unclosed", fixed=True) == []


def test_search_pattern_nested_past_the_parser_is_refused(ws: Workspace) -> None:
    deep = "(" * 1500 + "a" + ")" * 1500  # within the 4,096-character cap
    with pytest.raises(InvalidParams) as info:
        search_module.search(ws, SearchParams(workspace=WS, pattern=deep))
    assert info.value.data["path"] == "$.pattern"
    assert "nested too deeply" in str(info.value)


def test_search_max_matches(ws: Workspace) -> None:
    full = search_module.search(ws, SearchParams(workspace=WS, pattern="e"))
    assert not full.truncated and len(full.matches) > 3
    cut = search_module.search(ws, SearchParams(workspace=WS, pattern="e", max_matches=3))
    assert cut.truncated and cut.matches == full.matches[:3]


def test_search_max_line_bytes(ws: Workspace, root: Path) -> None:
    (root / "long.txt").write_text("needle " + "x" * 100 + "\n" + "é" * 20 + "needle\n")
    found = search(ws, "needle", glob="long.txt", max_line_bytes=16)
    assert found[0] == ("long.txt", 1, 1, "needle xxxxxxxxx")
    # A cut inside a multi-byte character is replaced, never an invalid string.
    assert found[1][:3] == ("long.txt", 2, 41)
    assert found[1][3] == "é" * 8


def test_search_skips_binary_denied_symlinked_and_git(ws: Workspace, root: Path) -> None:
    found = {m[0] for m in search(ws, "hello")}
    assert "data/blob.bin" not in found  # binary: a NUL in the first 8 KiB
    assert "keys/id.pem" not in found  # read_deny
    assert "link-file" not in found  # a symlink to README.md
    assert not any(p.startswith("link-out") for p in found)  # a symlink to outside
    assert "data/latin1.txt" in found  # not UTF-8, but text
    assert "README.md" in found
    (root / ".git" / "notes").write_text("hello\n")
    assert not any(p.startswith(".git") for p in {m[0] for m in search(ws, "hello")})


def test_search_late_nul_is_still_text(ws: Workspace, root: Path) -> None:
    (root / "late.txt").write_bytes(b"a" * 9000 + b"\x00\nhello\n")
    assert search(ws, "hello", glob="late.txt") == [("late.txt", 2, 1, "hello")]


def test_search_skips_fifos_without_blocking(ws: Workspace, root: Path) -> None:
    os.mkfifo(root / "src" / "fifo")
    assert [m[0] for m in search(ws, "VALUE")] == ["src/util.py"]


def test_search_counts_scanned_files(ws: Workspace) -> None:
    result = search_module.search(ws, SearchParams(workspace=WS, pattern="zzz-nothing"))
    texts = ["README.md", "src/main.py", "src/util.py", "src/pkg/deep.py", "docs/a.txt"]
    texts += ["data/latin1.txt", "empty"]
    assert result.files_scanned == len(texts)
    assert result.bytes_scanned == sum(
        len(v if isinstance(v, bytes) else v.encode()) for k, v in FILES.items() if k in texts
    )
    assert result.matches == [] and not result.truncated


def test_search_crlf_and_anchors(ws: Workspace, root: Path) -> None:
    (root / "crlf.txt").write_bytes(b"one\r\ntwo\r\n")
    assert search(ws, "^two", glob="crlf.txt") == [("crlf.txt", 2, 1, "two\r")]
    assert search(ws, "one$", glob="crlf.txt") == []  # `$` is before "\n", the "\r" is in the way


def test_search_empty_matches_terminate(ws: Workspace) -> None:
    found = search(ws, "^", glob="docs/a.txt")
    assert found == [
        ("docs/a.txt", 1, 1, "alpha"),
        ("docs/a.txt", 2, 1, "beta"),
        ("docs/a.txt", 3, 1, "gamma"),
    ]


# --- the search prefilter keeps results identical --------------------------------------------


def _reference_collect(
    regex: re.Pattern[bytes], data: bytes, rel: str, max_line_bytes: int, limit: int
) -> list[SearchMatch]:
    """The plain algorithm: regex over the whole file, one match per line."""
    out: list[SearchMatch] = []
    line_no, counted_to, pos = 1, 0, 0
    while pos <= len(data):
        m = regex.search(data, pos)
        if m is None:
            break
        start = data.rfind(b"\n", 0, m.start()) + 1
        end = data.find(b"\n", m.start())
        end = len(data) if end < 0 else end
        line_no += data.count(b"\n", counted_to, start)
        counted_to = start
        text = data[start:end][:max_line_bytes].decode("utf-8", "replace")
        out.append(SearchMatch(path=rel, line=line_no, column=m.start() - start + 1, text=text))
        if len(out) >= limit:
            break
        pos = end + 1
    return out


_ATOMS = [
    "a",
    "b",
    "ab",
    "abc",
    "A",
    "_x",
    "x(",
    "\\(",
    "1",
    " ",
    "\\n",
    "\\.",
    ".",
    "\\w",
    "\\d",
    "\\s",
    "\\S",
    "\\W",
    "\\D",
    "[a-c]",
    "[^a]",
    "[^\\n]",
    "[\\s\\S]",
    "[A-Z]",
    "(ab)",
    "(?:a|b)",
    "(a|\\n)",
    "^",
    "$",
    "\\b",
    "\\B",
    "\\A",
    "\\Z",
    "(?=a)",
    "(?!b)",
    "(?<=a)",
    "(?s:.)",
    "(?i:ab)",
    "(?>ab)",
    "(a)\\1",
    "é",
]
_QUANTS = ["", "", "", "*", "+", "?", "{1,3}", "*?", "+?", "{2}", "*+"]


def _random_pattern(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 5)):
        atom = rng.choice(_ATOMS)
        quant = rng.choice(_QUANTS)
        if quant and atom in ("^", "$", "\\b", "\\B", "\\A", "\\Z"):
            quant = ""
        parts.append(atom + quant)
    pattern = "".join(parts)
    if rng.random() < 0.15:
        pattern = pattern + "|" + rng.choice(_ATOMS)
    if rng.random() < 0.1:
        pattern = rng.choice(["(?i)", "(?s)", "(?m)", "(?x)"]) + pattern
    return pattern


def _random_text(rng: random.Random) -> bytes:
    alphabet = ["a", "b", "c", "A", "B", "x", "(", " ", "\n", "\n", "\r\n", "1", "_", "é", "."]
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120))).encode()


def test_prefilter_never_changes_search_results() -> None:
    rng = random.Random(1234)
    checked = 0
    shortcut = 0
    screened = 0
    for _ in range(4000):
        pattern = _random_pattern(rng)
        ignore_case = rng.random() < 0.3
        fixed = rng.random() < 0.1
        params = SearchParams(workspace=WS, pattern=pattern, fixed=fixed, ignore_case=ignore_case)
        try:
            regex = search_module._compile_search(params)
        except InvalidParams:
            continue
        prefilter = search_module._Prefilter.for_search(regex)
        shortcut += bool(prefilter.literal)
        screened += prefilter.screen is not None
        for _ in range(5):
            data = _random_text(rng)
            limit = rng.choice([1, 3, 1000])
            got: list[SearchMatch] = []
            search_module._collect(regex, prefilter, data, "f", 16, got, limit)
            assert got == _reference_collect(regex, data, "f", 16, limit), (pattern, data)
            assert _handed_first_hit(regex, prefilter, data, limit) == got, (pattern, data)
            checked += 1
    # Both shortcuts were exercised, often.
    assert checked > 10000 and shortcut > 1000 and screened > 1000, (shortcut, screened)


def _handed_first_hit(
    regex: re.Pattern[bytes], prefilter: Any, data: bytes, limit: int
) -> list[SearchMatch]:
    """`_collect` as `_Scan._match` calls it: the finder's (or else the screen's) first
    hit looked for by the caller and handed on; [] when the caller rejects the file."""
    finder = None if prefilter.finder is None else first_start(prefilter.finder)
    screen = None if prefilter.screen is None else first_start(prefilter.screen)
    looked = finder if prefilter.literal and finder is not None else screen
    first = -1
    if looked is not None:
        first = looked(data, 0, len(data))
        if first < 0:
            return []
    got: list[SearchMatch] = []
    search_module._collect(regex, prefilter, data, "f", 16, got, limit, None, screen, finder, first)
    return got


@pytest.mark.parametrize(
    ("pattern", "flags", "literal", "line_bound"),
    [
        (rb"def \w+_handler\(", 0, b"_handler(", True),
        (rb"[A-Z][a-z]+Error\(\w+", 0, b"Error(", True),
        (rb"abc", re.IGNORECASE, b"abc", True),
        (rb"ABC", re.IGNORECASE, b"abc", True),
        (rb"a\nb", 0, b"a\nb", False),  # the literal holds a newline
        (rb"foo\s+bar", 0, b"foo", False),  # \s matches a newline
        (rb"foo[^x]bar", 0, b"foo", False),
        (rb"foo(?=bar)", 0, b"foo", False),  # a lookahead may look past the line
        (rb"foo\Z", 0, b"foo", False),
        (rb"foo.bar", 0, b"foo", True),
        (rb"foo.bar", re.DOTALL, b"foo", False),  # files are still filtered, lines not
        (rb"(?s)foo.bar", 0, b"foo", False),
        (rb"(?i:foo)bar", 0, b"", False),  # scoped flags: no shortcut at all
        (rb"foo|bar", 0, b"", True),  # no single literal is required (RE2 screens it)
        (rb"(?:foo)+x*", 0, b"foo", True),
        (rb"(?:foo)*x", 0, b"x", True),
        (rb"\d+", 0, b"", True),
    ],
)
def test_prefilter_analysis(pattern: bytes, flags: int, literal: bytes, line_bound: bool) -> None:
    prefilter = search_module._Prefilter.of(re.compile(pattern, re.MULTILINE | flags))
    assert (prefilter.literal, prefilter.line_bound) == (literal, line_bound)
