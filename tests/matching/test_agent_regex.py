"""Agents' regexes in bounded time (substrate.matching.agent_regex): RE2 where its
translation is exact (and then the same answers as `re`), a budgeted backtracking
engine elsewhere, and `limit_exceeded` past the budget — for `fs.search` and
`artifact.grep`."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.artifacts.store import ArtifactStore
from substrate.errors import InvalidParams, LimitExceeded
from substrate.matching import agent_regex
from substrate.matching.agent_regex import matcher_for
from substrate.schema.fs import SearchParams
from substrate.store.db import Store
from substrate.workspace import search as search_module
from substrate.workspace.registry import Workspace

FLAGS = re.MULTILINE
#: Pieces of patterns both engines read alike; `(?=)` (always true) forces the budgeted
#: engine without changing what matches.
ATOMS = ["a", "b", "ab", ".", "[ab]", "[^a]", r"\w", r"\s", r"\d", r"\b", r"\B", "^", "$", r"\n"]


def _pattern(rng: random.Random, depth: int = 0) -> str:
    out = []
    for _ in range(rng.randint(1, 4)):
        roll = rng.random()
        if roll < 0.15 and depth < 2:
            atom = "(?:" + _pattern(rng, depth + 1) + "|" + _pattern(rng, depth + 1) + ")"
        else:
            atom = rng.choice(ATOMS)
        if atom not in ("^", "$", r"\b", r"\B") and rng.random() < 0.4:
            atom += rng.choice(["*", "+", "?", "{1,3}", "*?", "+?"])
        out.append(atom)
    return "".join(out)


@pytest.mark.parametrize("seed", range(4))
def test_both_engines_find_what_re_finds(seed: int) -> None:
    rng = random.Random(seed)
    data = bytes(rng.choice(b"ab 1\n") for _ in range(60))
    for _ in range(150):
        source = _pattern(rng)
        regex = re.compile(source.encode(), FLAGS)
        linear = matcher_for(regex)
        budgeted = matcher_for(re.compile(b"(?=)" + source.encode(), FLAGS))
        assert linear.engine == "re2", source
        assert budgeted.engine == "regex"
        for text, pos, endpos in (
            (data, 0, len(data)),
            (data, 7, 40),
            (data, rng.randrange(60), 60),
            (b"", 0, 0),
            (data, 0, 0),
        ):
            want = regex.search(text, pos, endpos)
            for matcher in (linear, budgeted):
                got = matcher.search(text, pos, endpos)
                assert (got and got.start()) == (want and want.start()), (source, pos, endpos)


BOMB = b"a" * 40 + b"!\n"


def test_a_backtracking_bomb_is_searched_in_linear_time(ws: Workspace, root: Path) -> None:
    # `re` takes minutes on this line; RE2 answers at once, with `re`'s answer (none).
    (root / "bomb.txt").write_bytes(BOMB * 100 + b"aaa\n")
    result = search_module.search(
        ws, SearchParams(workspace="ws_test", pattern="(a|aa)+$", glob="bomb.txt")
    )
    assert [(m.line, m.column) for m in result.matches] == [(101, 1)]


def test_a_bomb_re2_cannot_take_is_stopped_by_its_budget(
    ws: Workspace, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_regex, "REGEX_BUDGET_S", 0.2)
    (root / "bomb.txt").write_bytes(BOMB)
    with pytest.raises(LimitExceeded) as info:
        search_module.search(
            ws, SearchParams(workspace="ws_test", pattern="(?=a)(a|aa)+$", glob="bomb.txt")
        )
    assert info.value.data == {"scope": "regex_time"}
    # A lookaround that does not backtrack is searched as before.
    found = search_module.search(
        ws, SearchParams(workspace="ws_test", pattern="(?<=a)!", glob="bomb.txt")
    )
    assert [(m.line, m.column) for m in found.matches] == [(1, 41)]


@pytest.fixture
def arts(tmp_path: Path) -> Iterator[ArtifactStore]:
    db = Store(tmp_path / "state.db")
    yield ArtifactStore(db, tmp_path / "artifacts", quota_bytes=1 << 40, max_age_s=1e9)
    db.close()


def test_artifact_grep_is_bounded_too(arts: ArtifactStore, monkeypatch: pytest.MonkeyPatch) -> None:
    sink = arts.open_sink("proc_1", "stdout", 0, 1 << 40)
    sink.write(BOMB * 50 + b"aa\n")
    ref = sink.close()
    assert ref.artifact is not None
    found = arts.grep(ref.artifact, "(a|aa)+$")
    assert [m.line for m in found.matches] == [51]
    monkeypatch.setattr(agent_regex, "REGEX_BUDGET_S", 0.2)
    with pytest.raises(LimitExceeded):
        arts.grep(ref.artifact, r"(?=a)(a|aa)+$")


def test_a_pattern_the_budgeted_engine_refuses_is_invalid_params(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(pattern: bytes, flags: int) -> None:
        raise ValueError("no")

    monkeypatch.setattr(agent_regex.regex_mod, "compile", refuse)
    with pytest.raises(InvalidParams) as info:
        matcher_for(re.compile(rb"(?=a)b", re.M))
    assert info.value.data == {"path": "$.pattern"}
