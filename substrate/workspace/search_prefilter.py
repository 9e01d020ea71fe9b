"""`fs.search`'s prefilter: what a search may skip without changing its result.

A literal every match must contain (grep's "must" string), derived from the stdlib's own
parse of the pattern, or else an RE2 screen (`substrate.matching.re2_translate`); see
`substrate.workspace.search`, which uses it.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, replace
from typing import Any

from substrate.matching.re2_translate import exact_of, literal_of, superset_of
from substrate.matching.strided import Stride

#: The stdlib's own regex parser (private, stable since 3.11): see `Prefilter`.
_sre: Any = importlib.import_module("re._constants")
_sre_parser: Any = importlib.import_module("re._parser")

#: `Prefilter.for_search` without the matcher's exact pattern: translate it there.
_LOOK: Any = object()


@dataclass(frozen=True)
class Prefilter:
    """What a search may skip without changing its result (grep's "must" literal).

    `literal`: bytes every match contains (lowercased when `fold`, for IGNORECASE, whose
    bytes folding is ASCII-only like `bytes.lower`); a file without it has no match, and
    `bytes.find` rejects it far faster than the regex engine. `line_bound`: no match can
    contain a newline or look past its line's end, so the regex needs to run only on the
    lines where the literal occurs. Both are derived from the stdlib's own parse of the
    pattern; anything unrecognised makes them empty/False (search every byte).
    """

    literal: bytes = b""
    fold: bool = False
    line_bound: bool = False
    #: Without a literal: an RE2 pattern matching wherever the regex can, or None.
    screen: Any = None
    #: The screen matches exactly where the regex does (`re2_translate.exact_of`): its hit
    #: from a line's start is that line's match, with no second search.
    exact: bool = False
    #: `literal` as an RE2 pattern (`re2_translate.literal_of`), found faster than by
    #: `bytes.find` and without lowering the file for `fold`; or None.
    finder: Any = None
    #: The pattern is `literal` and nothing else (a `fixed` search, or a regex without
    #: metacharacters), case kept: where the literal is found, the match is.
    whole: bool = False
    #: With a screen: every match begins with rare bytes, so the screen's first hit is
    #: looked for at every `stride.n`-th byte first (`substrate.matching.strided`).
    stride: Stride | None = None

    @classmethod
    def for_search(cls, regex: re.Pattern[bytes], exact: Any = _LOOK) -> Prefilter:
        """The literal prefilter, or else the RE2 screen (`re2_translate`): `exact` when
        given (the matcher's, or None), else looked up."""
        literal = cls.of(regex)
        if literal.literal:
            return replace(literal, finder=literal_of(literal.literal, literal.fold))
        if exact is _LOOK:
            exact = exact_of(regex)
        line_bound = literal.line_bound
        stride = Stride.of(regex, line_bound)
        if exact is not None:
            return cls(screen=exact, exact=True, line_bound=line_bound, stride=stride)
        screen = superset_of(regex)
        return cls(screen=screen, line_bound=line_bound, stride=None if screen is None else stride)

    @classmethod
    def of(cls, regex: re.Pattern[bytes]) -> Prefilter:
        try:
            parsed = _sre_parser.parse(regex.pattern, regex.flags)
        except Exception:  # a parser this code does not know: no shortcut
            return cls()
        flags = parsed.state.flags
        if flags & _sre.SRE_FLAG_LOCALE or _scoped_flags(parsed.data):
            return cls()
        fold = bool(flags & _sre.SRE_FLAG_IGNORECASE)
        literal = max(_literals(parsed.data), key=len, default=b"")
        # With DOTALL, `.` matches a newline: the literal still filters files, not lines.
        dotall = bool(flags & _sre.SRE_FLAG_DOTALL)
        return cls(
            literal=literal.lower() if fold else literal,
            fold=fold,
            line_bound=not dotall and _line_bound(parsed.data),
            whole=bool(literal)
            and not fold
            and len(parsed.data) == len(literal)
            and all(op is _sre.LITERAL for op, _ in parsed.data),
        )


def _scoped_flags(items: Any) -> bool:
    """True when any `(?flags:...)` group changes the flags of part of the pattern."""
    for op, av in items:
        if op is _sre.SUBPATTERN and (av[1] or av[2]):
            return True
        for sub in _children(op, av):
            if _scoped_flags(sub):
                return True
    return False


def _children(op: Any, av: Any) -> list[Any]:
    if op is _sre.SUBPATTERN:
        return [av[3]]
    if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT):
        return [av[2]]
    if op is _sre.ATOMIC_GROUP:
        return [av]
    if op is _sre.BRANCH:
        return list(av[1])
    if op in (_sre.ASSERT, _sre.ASSERT_NOT):
        return [av[1]]
    if op is _sre.GROUPREF_EXISTS:
        return [x for x in av[1:] if x is not None]
    return []


def _literals(items: Any) -> list[bytes]:
    """Byte strings that every match of the sequence `items` contains."""
    found: list[bytes] = []
    run: list[int] = []
    for op, av in items:
        if op is _sre.LITERAL:
            run.append(av)
            continue
        found.append(bytes(run))
        run = []
        if op is _sre.SUBPATTERN:
            found += _literals(av[3])
        elif op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT) and av[0] >= 1:
            found += _literals(av[2])
        elif op is _sre.ATOMIC_GROUP:
            found += _literals(av)
    found.append(bytes(run))
    return [f for f in found if f]


#: Classes that never match a newline: \d, \S, \w.
_LINE_CATEGORIES = {_sre.CATEGORY_DIGIT, _sre.CATEGORY_NOT_SPACE, _sre.CATEGORY_WORD}
_NL = 10


def _set_matches_newline(items: Any) -> bool:
    hit = False
    negate = False
    for op, av in items:
        if op is _sre.NEGATE:
            negate = True
        elif op is _sre.LITERAL:
            hit = hit or av == _NL
        elif op is _sre.RANGE:
            hit = hit or av[0] <= _NL <= av[1]
        elif op is _sre.CATEGORY:
            hit = hit or av not in _LINE_CATEGORIES
        else:
            return True
    return hit != negate


def _line_bound(items: Any) -> bool:
    """True when no match of `items` can hold a newline or depend on the text past its line.

    Lookarounds and `\\Z` are refused: searching a line with `endpos` at its end would
    change what they see.
    """
    for op, av in items:
        if op is _sre.LITERAL:
            ok = av != _NL
        elif op is _sre.NOT_LITERAL:
            ok = av == _NL
        elif op is _sre.ANY:
            ok = True  # without DOTALL (checked by the caller), `.` never matches a newline
        elif op is _sre.IN:
            ok = not _set_matches_newline(av)
        elif op is _sre.AT:
            ok = av is not _sre.AT_END_STRING
        elif op is _sre.GROUPREF:
            ok = True  # repeats text of this match, which is on this line
        elif op in (_sre.SUBPATTERN, _sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT):
            ok = _line_bound(_children(op, av)[0])
        elif op in (_sre.ATOMIC_GROUP, _sre.BRANCH, _sre.GROUPREF_EXISTS):
            ok = all(_line_bound(sub) for sub in _children(op, av))
        else:
            ok = False
        if not ok:
            return False
    return True
