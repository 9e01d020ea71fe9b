"""The RE2 screen of `fs.search` (substrate.matching.re2_translate): a superset, never less."""

from __future__ import annotations

import random
import re

import pytest

from substrate.matching.re2_translate import superset_of

FLAGS = re.MULTILINE


def _screen(pattern: bytes, flags: int = FLAGS) -> tuple[re.Pattern[bytes], object]:
    regex = re.compile(pattern, flags)
    screen = superset_of(regex)
    assert screen is not None, pattern
    return regex, screen


def _assert_superset(regex: re.Pattern[bytes], screen: object, data: bytes) -> None:
    """Wherever `re` matches first, RE2 matched at or before it."""
    ours = regex.search(data)
    theirs = screen.search(data)  # type: ignore[attr-defined]
    if ours is not None:
        assert theirs is not None, (regex.pattern, data)
        assert theirs.start() <= ours.start(), (regex.pattern, data)


@pytest.mark.parametrize(
    ("pattern", "flags", "hit", "miss"),
    [
        (rb"\d{5}", FLAGS, b"id 12345\n", b"id 1234\n"),
        (rb"[A-Z][a-z]+Error\(\w+", FLAGS, b"raise ValueError(x)", b"raise valueerror(x)"),
        # Python's bytes \s holds \v; RE2's does not: the class is spelled out.
        (rb"a\sb", FLAGS, b"a\x0bb", b"ab"),
        (rb"[^a]x", FLAGS | re.IGNORECASE, b"bx", b"Ax"),
        (rb"^\w+$", FLAGS, b"--\nword\n--", b"-- --"),
        (rb"\bfoo\b", FLAGS, b"a foo b", b"afoob"),
        (rb"x.y", FLAGS, b"x-y", b"x\ny"),
        (rb"x.y", FLAGS | re.DOTALL, b"x\ny", b"xy"),
        (rb"(?:ab|cd)+?e", FLAGS | re.IGNORECASE, b"ABcDe", b"abe"[:2]),
        (rb"\xe9[\x80-\xff]", FLAGS, b"\xe9\x99", b"\xe9a"),
    ],
)
def test_translated_patterns_find_what_re_finds(
    pattern: bytes, flags: int, hit: bytes, miss: bytes
) -> None:
    regex, screen = _screen(pattern, flags)
    assert regex.search(hit) is not None
    assert screen.search(hit) is not None  # type: ignore[attr-defined]
    assert regex.search(miss) is None
    assert screen.search(miss) is None  # type: ignore[attr-defined]


def test_a_lookaround_is_dropped_so_the_screen_matches_more() -> None:
    regex, screen = _screen(rb"\d{3}(?!px)")
    assert regex.search(b"100px") is None
    assert screen.search(b"100px") is not None  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "pattern",
    [rb"(\w)\1", rb"(a)?(?(1)b|c)", rb"(?i:x)y", rb"a{2000}"],
)
def test_what_re2_cannot_bound_gets_no_screen(pattern: bytes) -> None:
    assert superset_of(re.compile(pattern, FLAGS)) is None


def test_random_patterns_never_miss_a_match_of_re() -> None:
    """Seeded: 400 patterns from a small grammar over 30 texts each."""
    rng = random.Random(20261201)
    atoms = [
        rb"\d",
        rb"\w",
        rb"\s",
        rb"\W",
        rb"\S",
        rb"\D",
        rb".",
        rb"[a-c]",
        rb"[^x\n]",
        rb"a",
        rb"B",
        rb"_",
        rb"\.",
        rb"^",
        rb"$",
        rb"\b",
        rb"\B",
        rb"[\x80-\xff]",
    ]
    alphabet = b"aAbBcCxX_ .\n\t\x0b019\xe9\xff-"
    for _ in range(400):
        parts = []
        for _ in range(rng.randint(1, 5)):
            atom = rng.choice(atoms)
            if rng.random() < 0.3:
                atom = b"(?:" + atom + b"|" + rng.choice(atoms) + b")"
            if rng.random() < 0.4:
                atom += rng.choice([b"*", b"+", b"?", b"{1,3}", b"*?", b"{2}"])
            parts.append(atom)
        pattern = b"".join(parts)
        flags = FLAGS | (re.IGNORECASE if rng.random() < 0.3 else 0)
        flags |= re.DOTALL if rng.random() < 0.2 else 0
        try:
            regex = re.compile(pattern, flags)
        except re.error:
            continue
        screen = superset_of(regex)
        assert screen is not None, pattern
        for _ in range(30):
            data = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
            _assert_superset(regex, screen, data)
