"""Glob regexes that match in bounded time, whoever wrote the glob.

Globs reach the daemon from agents as well as operators: `fs.walk`/`fs.search` `glob`
and `exclude`, and the deny lists an agent may add to a workspace's policy (which the
write gate joins into one alternation). Python's `re` backtracks: the regex of
`*a*a*a*a*a*a*a*a*a*a*b` (24 characters) takes 33 s against a 40-character name, and
every star more multiplies that. RE2 (google-re2, already the `fs.search` prefilter)
runs in time linear in the text whatever the pattern, but its Python binding costs
~3 µs a call against `re`'s ~0.7 µs, and the write gate matches every path of a tree.

Decision: a glob regex with at most `MAX_RE_REPEATS` unbounded repeats (`.*`, `[^/]*`:
one per `*` or `**`, plus the unanchored prefix) is matched by `re`. With two repeats
the worst case is quadratic in a path's length (a few thousand characters at most),
and it covers the usual rules: `*.lock`, `.git/**`, `**/node_modules/**`, `src/**/*.py`.
Anything with more (`*.min.*`, `**/a/**/b/**`, a hostile one) is matched by RE2. An
alternation of several globs takes RE2 when any member needs it, or when it joins more
than `MAX_RE_ALTERNATIVES` (RE2's single pass beats `re` trying each in turn).

The regex sources (`substrate.workspace.policy._translate`) use only syntax both
engines read alike (`[^/]`, `(?:…)`, escapes of punctuation) and end with `\\z`-like
anchoring given here. Texts holding lone surrogates (names that are not UTF-8, decoded
with `surrogateescape`) match RE2 with each surrogate read as U+FFFD: one character, as
`re` reads it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from substrate.errors import InvalidParams

#: google-re2 ships no type information.
re2: Any = importlib.import_module("re2")

#: Unbounded repeats a regex may hold and still be matched by `re` (see module doc).
MAX_RE_REPEATS = 2
#: Globs an alternation may join and still be matched by `re`.
MAX_RE_ALTERNATIVES = 8
#: RE2's memory budget for one compiled alternation (its default is 8 MiB).
RE2_MAX_MEM = 64 << 20
#: The largest regex source one alternation may have: at this size a hostile set of
#: globs costs RE2 ~0.1 s to compile and ~50 ms per match of a 2 KiB path, a usual path
#: well under a millisecond; 1,024 ordinary globs take about a fifth of it.
MAX_SOURCE_CHARS = 128 << 10
#: A class no character is in (RE2 has no `(?!)`; `re` reads it alike).
NEVER = r"[^\x00-\U0010ffff]"
_NEVER_RE2 = r"[^\x00-\x{10FFFF}]"
_REPEAT = re.compile(r"(?<!\\)\*")
_SURROGATES = re.compile("[\ud800-\udfff]")


def repeats(source: str) -> int:
    """The unbounded repeats (`*` not escaped) in a translated glob regex."""
    return len(_REPEAT.findall(source))


@dataclass(frozen=True)
class GlobRegex:
    """One compiled glob (or alternation of globs) matched against whole relative
    paths: `match(text)` says whether the whole of `text` matches."""

    sources: tuple[str, ...]  # each glob's regex, unanchored
    _re: re.Pattern[str] | None
    _re2: Any

    def match(self, text: str) -> bool:
        if self._re is not None:
            return self._re.match(text) is not None
        try:
            return self._re2.match(text) is not None
        except UnicodeEncodeError:
            return self._re2.match(_SURROGATES.sub("\ufffd", text)) is not None

    @property
    def engine(self) -> str:
        """Which engine matches: "re" or "re2" (for tests and docs)."""
        return "re" if self._re is not None else "re2"


def compile_sources(
    sources: Sequence[str], where: str = "$.policy", limit: int = MAX_SOURCE_CHARS
) -> GlobRegex | None:
    """One regex matching a whole text that any of `sources` matches; None for none.
    Refuses `invalid_params` (at `where`) when the alternation's source is over
    `limit` characters or RE2 cannot hold it in its memory budget."""
    if not sources:
        return None
    joined = "|".join(f"(?:{s})" for s in sources)
    if len(joined) > limit:
        raise InvalidParams(
            f"{len(sources)} glob(s) are too large to match together "
            f"({len(joined)} regex characters, at most {limit})",
            path=where,
        )
    simple = len(sources) <= MAX_RE_ALTERNATIVES and all(
        repeats(s) <= MAX_RE_REPEATS for s in sources
    )
    if simple:
        return GlobRegex(tuple(sources), re.compile(f"(?:{joined})\\Z", re.DOTALL), None)
    options = re2.Options()
    options.dot_nl = True
    options.max_mem = RE2_MAX_MEM
    options.log_errors = False  # a refusal says it; RE2 would also print to stderr
    try:
        compiled = re2.compile(f"(?:{joined.replace(NEVER, _NEVER_RE2)})\\z", options)
    except re2.error:
        raise InvalidParams(
            f"{len(sources)} glob(s) are too complex to match together", path=where
        ) from None
    return GlobRegex(tuple(sources), None, compiled)
