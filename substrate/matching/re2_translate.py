"""RE2 translations of a `re` pattern: a linear-time superset, or the same language.

A linear-time superset (the prefilter of `fs.search` patterns that hold no required
literal) or, where one exists, the same language (`exact_of`: `agent_regex` searches
with it).

Python's `re` walks every byte with a backtracking engine; a pattern like `\\d{5}` or
`[A-Z][a-z]+Error\\(` gives the literal prefilter of `substrate.workspace.search` nothing
to look for, and searching a tree costs ~10 times grep. RE2 (google-re2, a DFA) scans the
same bytes several times faster. It does not replace `re`: its syntax and semantics
differ (no backreferences or lookarounds, another `\\s`, Unicode case folding), so the
results are still `re`'s, and RE2 only says where `re` need not look.

Theory of operation. `superset_of(regex)` translates the stdlib's own parse of the
pattern into an RE2 pattern (Latin-1, so one byte is one character) whose language is a
**superset** of the original's at every position: every character class is spelled out
as explicit byte ranges (ASCII case folding added under IGNORECASE, as `re` does for
bytes), anchors and repeats keep their meaning, and constraints RE2 lacks are dropped
(a lookaround matches more without its condition; a lazy, possessive or atomic repeat
becomes a greedy one). A backreference, a conditional group, a scoped flag or a repeat
bound over RE2's 1,000 gives None: no prefilter. Hence: if RE2 finds no match in a
file, `re` finds none; and `re`'s first match starts at or after RE2's first, so `re`
may start at the line holding it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

#: google-re2 ships no type information.
re2: Any = importlib.import_module("re2")
_sre: Any = importlib.import_module("re._constants")
_sre_parser: Any = importlib.import_module("re._parser")

#: RE2's largest repeat count; larger bounds are not translated.
_RE2_MAX_REPEAT = 1000

_DIGIT = frozenset(range(0x30, 0x3A))
_WORD = frozenset([*range(0x30, 0x3A), *range(0x41, 0x5B), *range(0x61, 0x7B), 0x5F])
#: Python's bytes `\s`: [ \t\n\r\f\v] (RE2's lacks \v).
_SPACE = frozenset([0x20, 0x09, 0x0A, 0x0D, 0x0C, 0x0B])
_ALL = frozenset(range(256))
_CATEGORIES = {
    _sre.CATEGORY_DIGIT: _DIGIT,
    _sre.CATEGORY_NOT_DIGIT: _ALL - _DIGIT,
    _sre.CATEGORY_WORD: _WORD,
    _sre.CATEGORY_NOT_WORD: _ALL - _WORD,
    _sre.CATEGORY_SPACE: _SPACE,
    _sre.CATEGORY_NOT_SPACE: _ALL - _SPACE,
}
_ANCHORS = {
    # The search pattern is compiled with MULTILINE (`search._compile_search`): `^` and
    # `$` are line anchors there, as under RE2's `(?m)`.
    _sre.AT_BEGINNING: "^",
    _sre.AT_BEGINNING_LINE: "^",
    _sre.AT_END: "$",
    _sre.AT_END_LINE: "$",
    _sre.AT_BEGINNING_STRING: r"\A",
    _sre.AT_END_STRING: r"\z",
    _sre.AT_BOUNDARY: r"\b",
    _sre.AT_NON_BOUNDARY: r"\B",
}


class _Untranslatable(Exception):
    """The pattern uses something with no superset in RE2."""


def superset_of(regex: re.Pattern[bytes]) -> Any | None:
    """An RE2 pattern matching wherever `regex` can (see the module doc), or None when
    there is no such translation. Costs one parse of the pattern and one RE2 compile
    (bounded by RE2's own memory budget, 8 MiB by default: a pattern over it gives None).
    """
    translated = _translate(regex)
    return None if translated is None else _compile(translated[0])


def exact_of(regex: re.Pattern[bytes]) -> Any | None:
    """An RE2 pattern matching exactly where `regex` does — the same language, so the
    same leftmost match start from any position, which is all a search reports — or
    None when the translation had to drop a constraint (a lookaround, an atomic group,
    a possessive repeat) or there is none. Costs as `superset_of`."""
    translated = _translate(regex)
    if translated is None or not translated[1]:
        return None
    return _compile(translated[0])


def _translate(regex: re.Pattern[bytes]) -> tuple[str, bool] | None:
    """(RE2 source, exact) of `regex`, or None when it has no translation."""
    if not regex.flags & re.MULTILINE or regex.flags & re.LOCALE:
        return None
    try:
        parsed = _sre_parser.parse(regex.pattern, regex.flags)
        flags = parsed.state.flags
        translator = _Translator(
            fold=bool(flags & _sre.SRE_FLAG_IGNORECASE),
            dotall=bool(flags & _sre.SRE_FLAG_DOTALL),
        )
        return "(?m)" + translator.sequence(parsed.data), translator.exact
    except (_Untranslatable, RecursionError):
        return None
    except Exception:  # a parse tree this code does not know: no translation
        return None


def leading_sets(regex: re.Pattern[bytes], most: int = 64) -> tuple[list[frozenset[int]], int]:
    """The bytes each of the first fixed positions of every match may hold, as this
    module's translations spell them (so the same for `regex`, `superset_of(regex)` and
    `exact_of(regex)`), at most `most` of them; and the longest match's length (huge
    when unbounded). `([], 0)` when `regex` has no translation. A zero-width item
    (an anchor, a lookaround) is passed over; anything of no fixed length (a branch, a
    repeat of a range) ends the list. Costs one parse of the pattern."""
    if _translate(regex) is None:
        return [], 0
    parsed = _sre_parser.parse(regex.pattern, regex.flags)
    flags = parsed.state.flags
    translator = _Translator(
        fold=bool(flags & _sre.SRE_FLAG_IGNORECASE), dotall=bool(flags & _sre.SRE_FLAG_DOTALL)
    )
    sets: list[frozenset[int]] = []
    try:
        translator.leading(parsed.data, sets, most)
        return sets, int(parsed.getwidth()[1])
    except RecursionError:  # nested deeper than this stack: no sets
        return [], 0


def first_start(compiled: Any) -> Callable[[bytes, int, int], int]:
    """`start(data, pos, endpos)`: where the leftmost match of the RE2 pattern `compiled`
    (from this module) in `data[pos:endpos]` starts, or -1; `pos <= endpos <= len(data)`.
    The same answer as `compiled.search(data, pos, endpos)`, without the module's
    generator and match object per call (a search calls it once per candidate line)."""
    match = compiled._regexp.Match
    anchor = re2._Anchor.UNANCHORED

    def start(data: bytes, pos: int, endpos: int) -> int:
        found: int = match(anchor, data, pos, endpos)[0][0]
        return found

    return start


def compile_latin1(source: str) -> Any | None:
    """The RE2 pattern `source` (ASCII text) over bytes as Latin-1, capturing nothing,
    or None when RE2 refuses it (a syntax error, over its memory budget)."""
    return _compile(source)


def literal_of(literal: bytes, fold: bool) -> Any | None:
    """An RE2 pattern finding `literal` (any ASCII case of it when `fold`; RE2 then also
    folds Latin-1 letters, a superset). RE2 finds a literal several times faster than
    `bytes.find` (it looks for its first byte with `memchr`)."""
    return _compile(("(?i)" if fold else "") + "".join(f"\\x{b:02x}" for b in literal))


def _compile(source: str) -> Any | None:
    options = re2.Options()
    options.encoding = re2.Options.Encoding.LATIN1
    options.never_capture = True
    options.log_errors = False
    try:
        return re2.compile(source.encode("ascii"), options)
    except re2.error:
        return None


class _Translator:
    def __init__(self, *, fold: bool, dotall: bool) -> None:
        self.fold = fold
        self.dotall = dotall
        self.exact = True  # no constraint dropped so far

    def sequence(self, items: Any) -> str:
        return "".join(self.item(op, av) for op, av in items)

    def item(self, op: Any, av: Any) -> str:
        if op is _sre.LITERAL:
            return self.byte_set({av})
        if op is _sre.NOT_LITERAL:
            return _byte_class(_ALL - self.folded({av}))
        if op is _sre.ANY:
            return _byte_class(_ALL if self.dotall else _ALL - {0x0A})
        if op is _sre.IN:
            return self.byte_set(self.class_bytes(av))
        if op is _sre.CATEGORY:
            return _byte_class(_CATEGORIES[av])
        if op is _sre.AT:
            return _ANCHORS[av]
        if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT):
            # Lazy or greedy, the language is the same; possessive matches less.
            self.exact = self.exact and op is not _sre.POSSESSIVE_REPEAT
            low, high, sub = av
            if low > _RE2_MAX_REPEAT or (high is not _sre.MAXREPEAT and high > _RE2_MAX_REPEAT):
                raise _Untranslatable
            bound = f"{{{low},}}" if high is _sre.MAXREPEAT else f"{{{low},{high}}}"
            return f"(?:{self.sequence(sub)}){bound}"
        if op is _sre.SUBPATTERN:
            _group, add_flags, del_flags, sub = av
            if add_flags or del_flags:
                raise _Untranslatable
            return f"(?:{self.sequence(sub)})"
        if op is _sre.ATOMIC_GROUP:
            self.exact = False
            return f"(?:{self.sequence(av)})"
        if op is _sre.BRANCH:
            return "(?:" + "|".join(self.sequence(alt) for alt in av[1]) + ")"
        if op in (_sre.ASSERT, _sre.ASSERT_NOT):
            self.exact = False
            return ""  # without its condition, the rest matches at least where it did
        raise _Untranslatable  # GROUPREF, GROUPREF_EXISTS, anything newer

    def leading(self, items: Any, out: list[frozenset[int]], most: int) -> bool:
        """Append to `out` the byte sets of the fixed positions `items` starts with (up
        to `most` in all); True when all of `items` was of fixed length."""
        for op, av in items:
            if len(out) >= most:
                return False
            if op is _sre.AT or op in (_sre.ASSERT, _sre.ASSERT_NOT):
                continue  # zero-width: the next byte is still the match's next
            one = self.position(op, av)
            if one is not None:
                out.append(one)
            elif op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT):
                low, high, sub = av
                if low == 0:
                    return False
                first: list[frozenset[int]] = []
                whole = self.leading(sub, first, most)
                if not whole:
                    out += first[: most - len(out)]
                    return False
                for _ in range(low):
                    if len(out) >= most or not first:
                        break
                    out += first[: most - len(out)]
                if high != low or not first:
                    return False
            elif op is _sre.SUBPATTERN and not av[1] and not av[2]:
                if not self.leading(av[3], out, most):
                    return False
            else:
                return False
        return True

    def position(self, op: Any, av: Any) -> frozenset[int] | None:
        """The bytes one single-byte item matches (as `item` spells them), or None."""
        if op is _sre.LITERAL:
            return self.folded({av})
        if op is _sre.NOT_LITERAL:
            return _ALL - self.folded({av})
        if op is _sre.ANY:
            return _ALL if self.dotall else _ALL - {0x0A}
        if op is _sre.IN:
            return self.folded(self.class_bytes(av))
        if op is _sre.CATEGORY:
            return _CATEGORIES[av]
        return None

    def folded(self, values: set[int] | frozenset[int]) -> frozenset[int]:
        """`values` plus their ASCII other case under IGNORECASE (how `re` folds bytes)."""
        if not self.fold:
            return frozenset(values)
        out = set(values)
        for v in values:
            if 0x41 <= v <= 0x5A:
                out.add(v + 0x20)
            elif 0x61 <= v <= 0x7A:
                out.add(v - 0x20)
        return frozenset(out)

    def byte_set(self, values: set[int] | frozenset[int]) -> str:
        return _byte_class(self.folded(values))

    def class_bytes(self, items: Any) -> frozenset[int]:
        """The bytes a `[...]` matches, before folding."""
        chosen: set[int] = set()
        negate = False
        for op, av in items:
            if op is _sre.NEGATE:
                negate = True
            elif op is _sre.LITERAL:
                chosen.add(av)
            elif op is _sre.RANGE:
                chosen.update(range(av[0], av[1] + 1))
            elif op is _sre.CATEGORY:
                chosen.update(_CATEGORIES[av])
            else:
                raise _Untranslatable
        if negate:
            # Folding happens before the negation in `re`: [^a] under IGNORECASE
            # excludes A too.
            return _ALL - self.folded(chosen)
        return frozenset(chosen)


def _byte_class(values: frozenset[int]) -> str:
    """An RE2 character class of exactly these bytes (Latin-1 code points)."""
    if not values:
        return "[^\\x00-\\x{ff}]"  # matches nothing
    runs: list[str] = []
    ordered = sorted(values)
    start = prev = ordered[0]
    for v in [*ordered[1:], -1]:
        if v == prev + 1:
            prev = v
            continue
        runs.append(
            f"\\x{{{start:02x}}}" if start == prev else f"\\x{{{start:02x}}}-\\x{{{prev:02x}}}"
        )
        start = prev = v
    return "[" + "".join(runs) + "]"
