"""Glob regexes in bounded time (substrate.matching.glob_regex): which engine matches
what, that both engines mean the same, and the caps."""

from __future__ import annotations

import random
import re

import pytest

from substrate.errors import InvalidParams
from substrate.matching.glob_regex import MAX_SOURCE_CHARS, compile_sources
from substrate.schema.workspace import Policy
from substrate.workspace.policy import GlobSet, compile_glob, compile_policy, glob_source


@pytest.mark.parametrize("glob", ["*.lock", ".git/**", "**/node_modules/**", "src/**/*.py", "a"])
def test_usual_globs_are_matched_by_re(glob: str) -> None:
    assert compile_glob(glob).engine == "re"


@pytest.mark.parametrize("glob", ["*.min.*", "**/a/**/b/**", "*a" * 30 + "*b"])
def test_globs_with_more_repeats_are_matched_by_re2(glob: str) -> None:
    assert compile_glob(glob).engine == "re2"


def test_a_backtracking_bomb_answers() -> None:
    # With `re` this glob takes about 30 s against a 40-character name (and doubles with
    # each star): RE2 answers at once, and right.
    bomb = compile_glob("*a" * 30 + "*b")
    assert not bomb.match("a" * 4000)
    assert bomb.match("a" * 40 + "b")
    assert not bomb.match("a" * 40 + "/b")  # `*` never crosses `/`


def test_alternations_take_re2_past_a_few_globs() -> None:
    few = GlobSet.of([f"*.x{i}" for i in range(8)])
    many = GlobSet.of([f"*.x{i}" for i in range(9)])
    assert few.matches("a/b.x7") and many.matches("a/b.x8") and not many.matches("a/b.x9")
    assert few._regex is not None and few._regex.engine == "re"
    assert many._regex is not None and many._regex.engine == "re2"


_ALPHABET = "ab/.*?[]!"


def _random_glob(rng: random.Random) -> str:
    while True:
        glob = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 9)))
        try:
            glob_source(glob)
        except InvalidParams:
            continue
        return glob


def test_both_engines_mean_the_same() -> None:
    rng = random.Random(12)
    texts = ["".join(rng.choice("ab/.") for _ in range(rng.randint(0, 10))) for _ in range(300)]
    for _ in range(400):
        source = glob_source(_random_glob(rng))
        by_re = re.compile(f"(?:{source})\\Z", re.DOTALL)
        # Nine copies force RE2 (`MAX_RE_ALTERNATIVES`) without changing what matches.
        by_re2 = compile_sources([source] * 9)
        assert by_re2 is not None and by_re2.engine == "re2"
        for text in texts:
            assert by_re2.match(text) == (by_re.match(text) is not None), (source, text)


def test_names_that_are_not_utf8_match_alike() -> None:
    name = "x\udcff.env"  # a byte 0xff decoded with surrogateescape
    assert compile_glob("*.env").match(name)  # re
    assert compile_glob("x*.*v").engine == "re2" and compile_glob("x*.*v").match(name)
    assert compile_glob("x?.env").match(name) and compile_glob("x*?*.env").match(name)


def test_an_empty_class_matches_nothing_in_both_engines() -> None:
    assert not compile_glob("a[/]").match("a/")
    assert not compile_glob("*a*[/]*").match("xa/y")


def test_too_large_a_set_is_refused_with_its_list() -> None:
    long_glob = "*" + "ab" * 500
    with pytest.raises(InvalidParams) as info:
        compile_policy(Policy(write_deny=[f"{long_glob}{i}" for i in range(200)]))
    assert info.value.data["path"] == "$.policy"
    assert str(MAX_SOURCE_CHARS) in info.value.message
    # The usual large policy fits: 1,024 short globs.
    compile_policy(Policy(write_deny=[f"*.generated{i}" for i in range(1024)]))
