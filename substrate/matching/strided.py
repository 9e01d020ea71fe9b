"""A faster first match for RE2 screens whose matches begin with rare bytes: a strided skip.

`fs.search` screens a pattern with no required literal (`\\d{5}`, `[A-Z]{3}_`) by running
RE2 over every byte of every file (~1.5 ns a byte). When every match begins with `n`
bytes each drawn from one small set `U` (five digits for `[0-9]{5}`), every match covers
one offset that is a multiple of `n`, and the byte there is in `U`. So only every `n`-th
byte need be looked at first: `data[::n]` (a C loop over a fifth of the file) is searched
for bytes of `U`, and RE2 runs only on the short spans around those, from `n - 1` bytes
before a hit up to the longest a match can reach past it (its bounded length, or its
line's end when no match leaves its line). Hits close together are taken as one span
(one RE2 call instead of many: a call costs as much as ~400 bytes scanned), so a file
dense with `U` is scanned about once, plus the sample.

Theory of operation. `Strided.of` takes the sets of the first fixed positions of every
match (`re2_translate.leading_sets`, the same for the pattern and its RE2 translations)
and the longest prefix whose union holds at most `MAX_MEMBERS` bytes. A call
`(data, pos, endpos)` answers as `first_start(screen)(data, pos, endpos)`: let `q` be
the first sampled offset at or after `pos` holding a byte of `U` (`j0` its index in the
sample), and `last` the offset of the last hit of its span. A match starting at
`s >= pos` covers a sampled offset `q' >= s`; none is before `q`, so `s >= q - n + 1`.
Matches starting at or before `last` end within the span's end (their length bound, or
their line), so RE2's leftmost start in `[max(pos, q - n + 1), end)`, when it is at or
before `last`, is the answer. Otherwise nothing starts at or before `last`: go on after
the span.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from substrate.matching.re2_translate import compile_latin1, leading_sets, span_of

#: At most this many distinct bytes in the set a sampled byte is tested against, none
#: of them common in text (lowercase letters, blanks): the skip pays only where its
#: bytes are rare (digits, capitals).
MAX_MEMBERS = 32
COMMON = frozenset(b"abcdefghijklmnopqrstuvwxyz \t\n\r")
#: Hits this many bytes apart or closer are searched by one RE2 call.
JOIN_BYTES = 256
#: A match longer than this counts as unbounded (its line's end bounds the span, if any).
MAX_WIDTH = 1 << 16
_ALL = frozenset(range(256))


@dataclass(frozen=True)
class Stride:
    """What `Strided` needs of a pattern: the step `n`, the bytes `U` the sampled bytes
    are tested against, and how far a span reaches (`width`, `line_bound`)."""

    n: int
    members: frozenset[int]
    #: The longest match, or None when unbounded (then `line_bound` must hold).
    width: int | None
    #: No match holds a newline or looks past its line's end.
    line_bound: bool

    @classmethod
    def of(cls, regex: re.Pattern[bytes], line_bound: bool) -> Stride | None:
        """The stride of `regex` (a `fs.search` pattern, compiled MULTILINE), or None when
        none would help: fewer than two leading fixed positions within `MAX_MEMBERS`
        bytes none `COMMON`, or matches bounded neither in length nor by their line.
        Costs a parse."""
        sets, longest = leading_sets(regex)
        members: frozenset[int] = frozenset()
        n = 0
        for one in sets:
            if len(members | one) > MAX_MEMBERS or one & COMMON:
                break
            members |= one
            n += 1
        width = longest if longest <= MAX_WIDTH else None
        if n < 2 or not members or (width is None and not line_bound):
            return None
        return cls(n, members, width, line_bound)


class Strided:
    """`first_start(screen)` of a pattern of stride `stride`, skipping as the module doc
    says. Keeps the sample of the last `data` it was called with (the same bytes object:
    a search calls it again for the hits past the first); one per search, not shared
    between threads."""

    def __init__(self, stride: Stride, first: Callable[[bytes, int, int], int]) -> None:
        self.stride = stride
        self._first = first
        members = _class(stride.members)
        others = _class(_ALL - stride.members)
        gap = max(0, JOIN_BYTES // stride.n - 1)
        compiled = compile_latin1(f"{members}(?:{others}{{0,{gap}}}{members})*")
        assert compiled is not None
        self._spans = span_of(compiled)
        self._data: bytes | None = None
        self._sample = b""

    def __call__(self, data: bytes, pos: int, endpos: int) -> int:
        """Where the leftmost match in `data[pos:endpos]` starts, or -1."""
        n = self.stride.n
        if data is not self._data:
            self._data = data  # held, so that its id is never another's
            self._sample = data[::n]
        sample = self._sample
        width, line_bound = self.stride.width, self.stride.line_bound
        j, jend = -(-pos // n), min(len(sample), -(-endpos // n))
        while j < jend:
            j0, j1 = self._spans(sample, j, jend)
            if j0 < 0:
                return -1
            last = (j1 - 1) * n
            end = endpos if width is None else min(endpos, last + width)
            if line_bound:
                nl = data.find(b"\n", last, end)
                if nl >= 0:
                    end = nl + 1
            at = self._first(data, max(pos, j0 * n - n + 1), end)
            if 0 <= at <= last:
                return at
            j = j1
        return -1


def _class(values: frozenset[int]) -> str:
    return "[" + "".join(f"\\x{{{v:02x}}}" for v in sorted(values)) + "]"


def strided(
    stride: Stride | None, first: Callable[[bytes, int, int], int]
) -> Callable[[bytes, int, int], int]:
    """`Strided(stride, first)`, or `first` itself when there is no stride."""
    return first if stride is None else Strided(stride, first)
