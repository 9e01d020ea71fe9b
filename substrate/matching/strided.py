"""A faster first match for RE2 screens whose matches begin with rare bytes: a strided skip.

`fs.search` screens a pattern with no required literal (`\\d{5}`, `[A-Z]{3}_`) by running
RE2 over every byte of every file (~1.5 ns a byte). When every match begins with `n`
bytes each drawn from one small set `U` (five digits for `[0-9]{5}`), every match covers
one offset that is a multiple of `n`, and the byte there is in `U`. So only every `n`-th
byte need be looked at first: `data[::n]` (a C loop, a fifth of the file) is searched
for bytes of `U` (`memchr` per member byte for a few, else RE2), and RE2 runs only on
the few bytes around each hit: from `n - 1` before it to the longest a match can reach
past it (its bounded length, or its line's end when no match leaves its line). Where
`U`'s bytes are not rare after all (numbers all over a file), RE2 scans the file as
it would without a stride: decided from the file's first `HEAD_BYTES`, and again by
a budget of calls past which a search gives up the skip.

Theory of operation. `Stride.of` takes the sets of the first fixed positions of every
match (`re2_translate.leading_sets`, the same for the pattern and its RE2 translations)
and the longest prefix whose union holds at most `MAX_MEMBERS` bytes, none common in
text. A call `(data, pos, endpos)` answers as `first_start(screen)(data, pos, endpos)`:
let `q` be the first sampled offset at or after `pos` holding a byte of `U`. A match
starting at `s >= pos` covers a sampled offset at or after `s` holding such a byte; so
if no match starts at or before `q`, none starts before the next such offset; and every
match starting at or before `q` starts at or after `q - n + 1` and ends within the
window's end. So RE2's leftmost start in that window, when it is at or before `q`, is
the answer; otherwise go on from the next sampled byte of `U`.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable
from dataclasses import dataclass

from substrate.matching.re2_translate import compile_latin1, first_start, leading_sets

#: At most this many distinct bytes in the set a sampled byte is tested against, none
#: of them common in text (lowercase letters, blanks): the skip pays only where its
#: bytes are rare (digits, capitals).
MAX_MEMBERS = 32
COMMON = frozenset(b"abcdefghijklmnopqrstuvwxyz \t\n\r")
#: An RE2 call costs about as much as scanning this many bytes: a file whose first
#: `HEAD_BYTES` hold a sampled member byte per `CALL_BYTES` or more is scanned by RE2
#: whole; and a call gives up the skip (RE2 from there) after `MIN_TRIES` candidates
#: plus one per `TRY_BYTES` of what it searches (at most a quarter more than RE2 alone).
CALL_BYTES = 1024
HEAD_BYTES = 4096
MIN_TRIES = 4
TRY_BYTES = 4 * CALL_BYTES
#: Up to this many member bytes are looked for by `memchr` each; more, by RE2.
MAX_STREAMS = 12
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
    a search calls it again for the hits past the first, from later offsets); one per
    search, not shared between threads."""

    def __init__(self, stride: Stride, first: Callable[[bytes, int, int], int]) -> None:
        self.stride = stride
        self._first = first
        self._members = bytes(sorted(stride.members))
        compiled = compile_latin1(_class(stride.members))
        assert compiled is not None
        self._find = first_start(compiled)
        self._streams = len(stride.members) <= MAX_STREAMS
        self._data: bytes | None = None
        self._sample: bytes | None = None
        #: Per member byte, its next index in the sample at or after `_base` (before
        #: `_end`), smallest first; a byte with none is left out.
        self._heap: list[tuple[int, int]] = []
        self._base = self._end = 0

    def __call__(self, data: bytes, pos: int, endpos: int) -> int:
        """Where the leftmost match in `data[pos:endpos]` starts, or -1."""
        n = self.stride.n
        if data is not self._data:
            self._data = data  # held, so that its id is never another's
            head = data[:HEAD_BYTES:n]
            hits = len(head) - len(head.translate(None, self._members))
            # Dense with the set's bytes (numbers in code): RE2 over every byte is cheaper.
            dense = hits * CALL_BYTES > len(head) * n
            self._sample = None if dense else data[::n]
            self._base, self._end, self._heap = 0, -1, []
        sample = self._sample
        if sample is None:
            return self._first(data, pos, endpos)
        width, line_bound = self.stride.width, self.stride.line_bound
        j, jend = -(-pos // n), min(len(sample), -(-endpos // n))
        tries = MIN_TRIES + (endpos - pos) // TRY_BYTES
        while True:
            j0 = self._next(sample, j, jend)
            if j0 < 0:
                return -1
            q = j0 * n
            start = max(pos, q - n + 1)
            if tries <= 0:
                return self._first(data, start, endpos)  # denser than the head said
            tries -= 1
            end = endpos if width is None else min(endpos, q + width)
            if line_bound:
                nl = data.find(b"\n", q, end)
                if nl >= 0:
                    end = nl + 1
            at = self._first(data, start, end)
            if 0 <= at <= q:
                return at
            j = j0 + 1

    def _next(self, sample: bytes, j: int, jend: int) -> int:
        """The first index at or after `j` (before `jend`) of a member byte in `sample`,
        or -1: by RE2, or for a few members by `memchr` per member (`bytes.find`),
        each one's next index kept in a heap, so every byte is looked for once."""
        if not self._streams:
            return self._find(sample, j, jend)
        heap = self._heap
        if j < self._base or jend != self._end:
            heap = [(k, c) for c in self._members if (k := sample.find(c, j, jend)) >= 0]
            heapq.heapify(heap)
            self._heap, self._end = heap, jend
        self._base = j
        while heap and heap[0][0] < j:
            c = heap[0][1]
            k = sample.find(c, j, jend)
            if k < 0:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (k, c))
        return heap[0][0] if heap else -1


def _class(values: frozenset[int]) -> str:
    return "[" + "".join(f"\\x{{{v:02x}}}" for v in sorted(values)) + "]"


def strided(
    stride: Stride | None, first: Callable[[bytes, int, int], int]
) -> Callable[[bytes, int, int], int]:
    """`Strided(stride, first)`, or `first` itself when there is no stride."""
    return first if stride is None else Strided(stride, first)
