"""The strided first match (substrate.matching.strided): RE2's answer, found by a skip."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from substrate.matching import strided as strided_module
from substrate.matching.re2_translate import exact_of, first_start, leading_sets, superset_of
from substrate.matching.strided import Stride, Strided
from substrate.workspace.search_prefilter import Prefilter

FLAGS = re.MULTILINE

#: Patterns with a stride: bounded, unbounded but line-bound, anchored, folded, lookarounds.
STRIDED = [
    rb"[0-9]{5}",
    rb"\d{3,}",
    rb"\b\d\d\b",
    rb"^[0-9]{2}",
    rb"[0-9]{2}$",
    rb"[A-Z]{3}_\w*",
    rb"[A-Z]{2}\d",
    rb"(?:12){2}",
    rb"\d{2}(?=x)",
    rb"(?<!1)\d{4}",
    rb"[0-9]{2}[^\n]{0,3}9",
    rb"(?s)\d{2}.\d",
]
_TEXT = st.lists(
    st.sampled_from(["1", "12", "123", "12345", "x", "abc", "ABC_", "\n", " ", "9", "Q", "é"]),
    max_size=60,
).map(lambda parts: "".join(parts).encode())


def _stride(pattern: bytes) -> tuple[re.Pattern[bytes], Stride]:
    regex = re.compile(pattern, FLAGS)
    stride = Stride.of(regex, Prefilter.of(regex).line_bound)
    assert stride is not None, pattern
    return regex, stride


@pytest.mark.parametrize(
    ("pattern", "n", "width", "line_bound"),
    [
        (rb"[0-9]{5}", 5, 5, True),
        (rb"\d{3,}", 3, None, True),
        (rb"\b[A-Z]{3}_\w+", 4, None, True),
        (rb"(?:12){3}x", 6, 7, True),  # `x` is common: not in the set
        (rb"(?s)\d{2}.\d", 2, 4, False),
    ],
)
def test_the_stride_of_a_pattern(
    pattern: bytes, n: int, width: int | None, line_bound: bool
) -> None:
    """`n`: the leading fixed positions whose union stays small and rare (`_` joins the
    capitals, `\\w` does not); `width`: the longest match, None when unbounded."""
    _, stride = _stride(pattern)
    assert (stride.n, stride.width, stride.line_bound) == (n, width, line_bound)


@pytest.mark.parametrize(
    "pattern",
    [rb"\d", rb"[a-z]{3}", rb"(?i)[A-C]{2}9", rb"\w{4}", rb"a|bc", rb"(?s)\d{2}.*", rb"x?\d{4}"],
)
def test_no_stride_where_it_cannot_help_or_hold(pattern: bytes) -> None:
    """One position, common bytes (lowercase, also by folding), a set over
    `MAX_MEMBERS`, a branch, no bound on the match, or an optional first item."""
    regex = re.compile(pattern, FLAGS)
    assert Stride.of(regex, Prefilter.of(regex).line_bound) is None


def test_a_search_screens_digit_runs_by_stride() -> None:
    """`fs.search`'s prefilter carries the stride for a screened pattern (the benchmark's
    `[0-9]{5}`), and none for a pattern with a literal (it has a faster finder)."""
    regex = re.compile(rb"[0-9]{5}", FLAGS)
    assert Prefilter.for_search(regex).stride == Stride(5, frozenset(b"0123456789"), 5, True)
    assert Prefilter.for_search(re.compile(rb"id[0-9]{5}", FLAGS)).stride is None


@settings(max_examples=400, deadline=None)
@given(
    pattern=st.sampled_from(STRIDED),
    data=_TEXT,
    pos=st.integers(0, 40),
    cut=st.integers(0, 40),
    call_bytes=st.sampled_from([1, 16, 1024, 1 << 20]),
    streams=st.sampled_from([0, 12]),
)
def test_strided_equals_re2(
    pattern: bytes, data: bytes, pos: int, cut: int, call_bytes: int, streams: int
) -> None:
    """From any `pos` to any `endpos`, again and again on the same bytes (a search asks
    for the hits past each line), the strided answer is RE2's own, for the exact and the
    superset screens alike: dense or not, giving up the skip early or never, with the
    member bytes found by RE2 or by `memchr`."""
    regex, stride = _stride(pattern)
    pos = min(pos, len(data))
    endpos = max(pos, len(data) - cut)
    module = strided_module
    saved = module.CALL_BYTES, module.TRY_BYTES, module.MAX_STREAMS, module.MIN_TRIES
    module.CALL_BYTES, module.TRY_BYTES, module.MAX_STREAMS = call_bytes, call_bytes, streams
    module.MIN_TRIES = 0 if call_bytes == 1 else 4
    try:
        for screen in (exact_of(regex), superset_of(regex)):
            if screen is None:
                continue
            first = first_start(screen)
            fast = Strided(stride, first)
            assert fast(data, pos, endpos) == first(data, pos, endpos), (pattern, data)
            assert fast(data, 0, len(data)) == first(data, 0, len(data))
            at = first(data, 0, len(data))
            while at >= 0 and at + 1 <= len(data):
                nxt = first(data, at + 1, len(data))
                assert fast(data, at + 1, len(data)) == nxt
                at = nxt
    finally:
        module.CALL_BYTES, module.TRY_BYTES, module.MAX_STREAMS, module.MIN_TRIES = saved


def _counted(
    first: Callable[[bytes, int, int], int], calls: list[tuple[int, int]]
) -> Callable[[bytes, int, int], int]:
    def counted(data: bytes, pos: int, endpos: int) -> int:
        calls.append((pos, endpos))
        return first(data, pos, endpos)

    return counted


def test_strided_finds_a_run_across_every_alignment() -> None:
    """A run of five digits at every offset of a long file, with sampled digits before
    it that start no match: found where RE2 finds it, with RE2 called only around the
    digits (the sparse path), and again from each later offset."""
    regex, stride = _stride(rb"[0-9]{5}")
    first = first_start(exact_of(regex))
    for at in range(0, 40):
        data = b"x" * 600 + b"7 " + b"y" * at + b"12345" + b"1234 " + b"z" * 7000
        calls: list[tuple[int, int]] = []
        fast = Strided(stride, _counted(first, calls))
        assert fast(data, 0, len(data)) == first(data, 0, len(data)) == 602 + at
        assert all(end - pos <= 9 for pos, end in calls)
        for pos in range(603 + at, 603 + at + 20):
            assert fast(data, pos, len(data)) == first(data, pos, len(data))


def test_a_file_dense_with_digits_is_scanned_by_re2() -> None:
    """Numbers everywhere (as in much code): one RE2 call over the whole file, as without
    a stride, instead of one per digit."""
    regex, stride = _stride(rb"[0-9]{5}")
    first = first_start(exact_of(regex))
    data = b"x = 12 + 345 * 6789\n" * 400 + b"y = 12345\n"
    calls: list[tuple[int, int]] = []
    assert Strided(stride, _counted(first, calls))(data, 0, len(data)) == first(data, 0, len(data))
    assert calls == [(0, len(data))]


@pytest.mark.parametrize(
    ("pattern", "sizes", "longest"),
    [
        (rb"[0-9]{5}", [10] * 5, 5),
        (rb"\b[A-Z]{2}(?=x)_", [26, 26, 1], 3),  # zero-width items passed over
        (rb"(?i)ab[0-9]", [2, 2, 10], 3),  # folded as `re` folds bytes
        (rb"(?:ab){2,3}", [1, 1, 1, 1], 6),  # a range of repeats ends the list
        (rb"(?:a\d?){2}", [1], 4),  # so does an item of no fixed length
        (rb"[^a].", [255, 255], 2),
        (rb"(a)\1", [], 0),  # no translation
    ],
)
def test_leading_sets(pattern: bytes, sizes: list[int], longest: int) -> None:
    sets, width = leading_sets(re.compile(pattern, FLAGS))
    assert [len(s) for s in sets] == sizes
    assert width == longest


@pytest.mark.parametrize(
    ("pattern", "data", "at"),
    [(rb"\b\d\d\b", b"xx 123 45", 7), (rb"[0-9]{2}$", b"1234x\n99", 6), (rb"^\d\d", b"a12\n34", 4)],
)
def test_a_window_sees_the_bytes_around_it(pattern: bytes, data: bytes, at: int) -> None:
    """RE2 searched in a window still sees the text past its ends for `\\b`, `$`, `^`
    (`first_start`'s context is the whole text): `12` in `123` is no `\\b\\d\\d\\b`."""
    regex, stride = _stride(pattern)
    first = first_start(exact_of(regex))
    assert Strided(stride, first)(data, 0, len(data)) == at == regex.search(data).start()  # type: ignore[union-attr]
