"""Agents' regexes (`fs.search`, `artifact.grep`) searched in bounded time.

Python's `re` backtracks: `(a|aa)+$` against a line of 40 `a`s and a `!` runs for
minutes, holding a worker thread (and a slot of the file-system limiter every file
operation shares) for as long. A client's input must never cost the daemon unbounded
time, so a search never runs `re` itself:

- a pattern whose RE2 translation is exact (`re2_translate.exact_of`: the same language;
  every pattern without lookarounds, atomic groups, possessive repeats, backreferences,
  conditionals or scoped flags) is searched by RE2, linear in the bytes whatever the
  pattern. Only match starts are reported, and the leftmost start from a position is a
  property of the language, so the results are `re`'s;
- any other is searched by the `regex` module (mrab-regex: `re`'s syntax and semantics,
  and a `timeout` on each call) against a budget of `REGEX_BUDGET_S` for the whole
  request; past it the request is refused `limit_exceeded` (`scope: "regex_time"`).

`re` still compiles the pattern first: its syntax, its errors (`invalid_params`) and
its parse (the literal prefilter) are the contract's.
"""

from __future__ import annotations

import importlib
import re
import sys
import time
from typing import Any, Protocol

from substrate.errors import InvalidParams, LimitExceeded
from substrate.matching.re2_translate import exact_of

#: mrab-regex ships no type information.
regex_mod: Any = importlib.import_module("regex")

#: Seconds of backtracking matching one request may spend (patterns RE2 cannot take).
REGEX_BUDGET_S = 10.0
#: The `re` flags a search may carry, by their `regex` names (their values differ).
_FLAGS = (
    (re.IGNORECASE, "IGNORECASE"),
    (re.MULTILINE, "MULTILINE"),
    (re.DOTALL, "DOTALL"),
    (re.VERBOSE, "VERBOSE"),
)


class Found(Protocol):
    def start(self) -> int: ...


class Matcher(Protocol):
    """`re.Pattern.search`'s shape, as the searches use it. `exact`: the RE2 pattern
    matching exactly where the regex does (the search's screen), or None when the
    matcher backtracks (within its budget): callers give such searches threads of their
    own, so a few of them, each holding a thread for up to the budget, never starve the
    file operations every client shares."""

    exact: Any

    def search(self, data: bytes, pos: int = 0, endpos: int = sys.maxsize) -> Found | None: ...


def matcher_for(regex: re.Pattern[bytes], budget_s: float | None = None) -> Matcher:
    """The bounded matcher of `regex` (see the module doc): RE2 when its translation is
    exact, else `regex` with a budget of `budget_s` (default `REGEX_BUDGET_S`), counted
    from its first search (not while it waits for a thread). Costs a parse and a
    compile."""
    exact = exact_of(regex)
    if exact is not None:
        return _Linear(exact, regex)
    return _Budgeted(regex, REGEX_BUDGET_S if budget_s is None else budget_s)


class _Linear:
    def __init__(self, compiled: Any, regex: re.Pattern[bytes]) -> None:
        self._compiled = self.exact = compiled
        self._regex = regex
        self.engine = "re2"

    def search(self, data: bytes, pos: int = 0, endpos: int = sys.maxsize) -> Found | None:
        if min(endpos, len(data)) == 0:
            # `re`'s own answer for an empty text (its `\B` never matches one; RE2's
            # does): nothing to backtrack over, so it costs no more than the pattern.
            return self._regex.search(data, pos, endpos)
        found: Found | None = self._compiled.search(data, pos, min(endpos, len(data)))
        return found


class _Budgeted:
    def __init__(self, regex: re.Pattern[bytes], budget_s: float) -> None:
        flags = 0
        for flag, name in _FLAGS:
            if regex.flags & flag:
                flags |= getattr(regex_mod, name)
        try:
            self._pattern = regex_mod.compile(regex.pattern, flags)
        except Exception as exc:  # `re` took it; never seen, but never an internal error
            raise InvalidParams(
                f"pattern: not supported with lookarounds or backreferences ({exc})",
                path="$.pattern",
            ) from None
        self._regex = regex
        self._deadline: float | None = None  # set by the first search
        self._budget_s = budget_s
        self.exact = None
        self.engine = "regex"

    def search(self, data: bytes, pos: int = 0, endpos: int = sys.maxsize) -> Found | None:
        if min(endpos, len(data)) == 0:
            return self._regex.search(data, pos, endpos)  # as `_Linear.search`
        if self._deadline is None:
            self._deadline = time.monotonic() + self._budget_s
        left = self._deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            found: Found | None = self._pattern.search(data, pos, endpos, timeout=left)
        except TimeoutError:
            raise LimitExceeded(
                f"the pattern took more than {self._budget_s:g} s to match (it backtracks;"
                " without lookarounds or backreferences it would run in linear time)",
                scope="regex_time",
            ) from None
        return found
