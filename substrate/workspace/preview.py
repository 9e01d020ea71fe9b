"""Bounded `diff -u` previews of a guarded write's plan: pure, never refusing.

The preview is for a person or an agent to read, and a full one is itself a diff
`patching.apply_unified_diff` accepts (lines split on `\\n` only, as there). Its cost
is bounded on any input: the common head and tail are matched for free, big middles are
cut at lines unique to both sides (patience anchors) before `difflib` sees them, and
output work stops at the byte bound.
"""

from __future__ import annotations

import bisect
import difflib
import json
from collections import Counter
from collections.abc import Iterator

from substrate.workspace.patching import split_lines

#: Either side larger than this many bytes is summarized instead of diffed:
#: `difflib.SequenceMatcher` is superlinear in the number of changed lines.
PREVIEW_DIFF_LIMIT = 2 << 20
#: Largest span of lines (per side) handed to `difflib.SequenceMatcher` in a preview;
#: bigger spans are cut at unique lines first, and shown coarsely if still too big.
PREVIEW_MATCH_LINES = 10000
#: Context lines around each change in a preview, as `diff -u`.
PREVIEW_CONTEXT = 3

_Opcode = tuple[str, int, int, int, int]


def _push(codes: list[_Opcode], tag: str, i1: int, i2: int, j1: int, j2: int) -> None:
    if i1 == i2 and j1 == j2:
        return
    # Equal runs are merged so that grouping sees how long they really are.
    if tag == "equal" and codes and codes[-1][0] == "equal":
        codes[-1] = ("equal", codes[-1][1], i2, codes[-1][3], j2)
    else:
        codes.append((tag, i1, i2, j1, j2))


def _matched(
    a: list[str], b: list[str], a_span: range, b_span: range, codes: list[_Opcode]
) -> None:
    """SequenceMatcher over a small span pair; a too big one becomes one coarse replace."""
    if not a_span or not b_span or max(len(a_span), len(b_span)) > PREVIEW_MATCH_LINES:
        # Nothing to match (common between anchors), or too much to match cheaply.
        _push(codes, "replace", a_span.start, a_span.stop, b_span.start, b_span.stop)
        return
    matcher = difflib.SequenceMatcher(
        None, a[a_span.start : a_span.stop], b[b_span.start : b_span.stop]
    )
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        _push(
            codes, tag, i1 + a_span.start, i2 + a_span.start, j1 + b_span.start, j2 + b_span.start
        )


def _anchors(a: list[str], b: list[str], a_span: range, b_span: range) -> list[tuple[int, int]]:
    """The longest in-order run of lines found exactly once on each side (patience diff)."""
    a_mid, b_mid = a[a_span.start : a_span.stop], b[b_span.start : b_span.stop]
    a_count, b_count = Counter(a_mid), Counter(b_mid)
    b_where = {line: j for j, line in enumerate(b_mid, b_span.start) if b_count[line] == 1}
    pairs = [
        (i, b_where[line])
        for i, line in enumerate(a_mid, a_span.start)
        if line in b_where and a_count[line] == 1
    ]
    # Longest increasing subsequence in the b index, O(k log k).
    tails: list[int] = []
    tail_at: list[int] = []
    back = [-1] * len(pairs)
    for n, (_, j) in enumerate(pairs):
        k = bisect.bisect_left(tails, j)
        if k == len(tails):
            tails.append(j)
            tail_at.append(n)
        else:
            tails[k] = j
            tail_at[k] = n
        back[n] = tail_at[k - 1] if k else -1
    run: list[tuple[int, int]] = []
    n = tail_at[-1] if tail_at else -1
    while n >= 0:
        run.append(pairs[n])
        n = back[n]
    run.reverse()
    return run


def _opcodes(a: list[str], b: list[str]) -> list[_Opcode]:
    """Opcodes turning `a` into `b`, cheap on big inputs.

    The common head and tail are matched for free, so a small change in a big file never
    reaches the matcher. A middle of more than `PREVIEW_MATCH_LINES` lines is first cut at
    lines unique to both sides (patience anchors); only the gaps between anchors go to
    `SequenceMatcher`, and a gap still too big is one coarse replace: a correct diff,
    only not a minimal one.
    """
    head = 0
    limit = min(len(a), len(b))
    while head < limit and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < limit - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    a_span, b_span = range(head, len(a) - tail), range(head, len(b) - tail)
    codes: list[_Opcode] = []
    _push(codes, "equal", 0, head, 0, head)
    if max(len(a_span), len(b_span)) <= PREVIEW_MATCH_LINES:
        _matched(a, b, a_span, b_span, codes)
    else:
        i, j = a_span.start, b_span.start
        for ai, bj in [*_anchors(a, b, a_span, b_span), (a_span.stop, b_span.stop)]:
            _matched(a, b, range(i, ai), range(j, bj), codes)
            _push(codes, "equal", ai, min(ai + 1, a_span.stop), bj, min(bj + 1, b_span.stop))
            i, j = ai + 1, bj + 1
    _push(codes, "equal", len(a) - tail, len(a), len(b) - tail, len(b))
    return codes


def _grouped(codes: list[_Opcode], context: int) -> Iterator[list[_Opcode]]:
    """Hunks of opcodes with `context` equal lines around changes (as difflib groups)."""
    if not codes:
        return
    codes = list(codes)
    tag, i1, i2, j1, j2 = codes[0]
    if tag == "equal":
        codes[0] = (tag, max(i1, i2 - context), i2, max(j1, j2 - context), j2)
    tag, i1, i2, j1, j2 = codes[-1]
    if tag == "equal":
        codes[-1] = (tag, i1, min(i2, i1 + context), j1, min(j2, j1 + context))
    group: list[_Opcode] = []
    for tag, i1, i2, j1, j2 in codes:
        # An equal run too long to be context for both neighbours splits the hunk.
        if tag == "equal" and i2 - i1 > 2 * context:
            group.append((tag, i1, min(i2, i1 + context), j1, min(j2, j1 + context)))
            yield group
            group = []
            i1, j1 = max(i1, i2 - context), max(j1, j2 - context)
        group.append((tag, i1, i2, j1, j2))
    if group and not (len(group) == 1 and group[0][0] == "equal"):
        yield group


def _range(start: int, stop: int) -> str:
    length = stop - start
    if length == 1:
        return str(start + 1)
    # An empty range names the line before it, as diff -u does.
    return f"{start + 1 if length else start},{length}"


def _body(prefix: str, line: str) -> Iterator[str]:
    if line.endswith("\n"):
        yield prefix + line
    else:
        yield prefix + line + "\n"
        yield "\\ No newline at end of file\n"


def _quote(name: str) -> str:
    # A control character or quote in a path would break the diff's line structure.
    if any(ch in '"\\' or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in name):
        return json.dumps(name, ensure_ascii=False)
    return name


def _unified_lines(a: list[str], b: list[str], path: str) -> Iterator[str]:
    """A `diff -u` of two split texts, `\\ No newline` markers included (difflib lacks them)."""
    header = False
    for group in _grouped(_opcodes(a, b), PREVIEW_CONTEXT):
        if not header:
            yield f"--- {_quote('a/' + path)}\n"
            yield f"+++ {_quote('b/' + path)}\n"
            header = True
        first, last = group[0], group[-1]
        yield f"@@ -{_range(first[1], last[2])} +{_range(first[3], last[4])} @@\n"
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                for line in a[i1:i2]:
                    yield from _body(" ", line)
                continue
            for line in a[i1:i2]:
                yield from _body("-", line)
            for line in b[j1:j2]:
                yield from _body("+", line)


def _bounded(lines: Iterator[str], max_bytes: int) -> tuple[str, bool]:
    kept: list[str] = []
    used = 0
    for line in lines:
        size = len(line.encode("utf-8"))
        if used + size > max_bytes:
            return "".join(kept), True
        kept.append(line)
        used += size
    return "".join(kept), False


def unified_preview(old: bytes, new: bytes, path: str, max_bytes: int = 16384) -> tuple[str, bool]:
    """A bounded `diff -u` style preview of `old` → `new`: `(text, truncated)`.

    Headers are `--- a/<path>` / `+++ b/<path>` (quoted when the path holds a control
    character or quote), with 3 lines of context and `\\ No newline at end of file`
    markers, so a full preview is itself a diff `apply_unified_diff` accepts. The text is
    cut on a line boundary so it holds at most `max_bytes` UTF-8 bytes; `truncated` says
    whether anything was cut. Equal inputs give `("", False)`.

    Summaries instead of a diff, one line each:
    - either side not UTF-8: `Binary files differ (N -> M bytes)`, truncated False;
    - either side over `PREVIEW_DIFF_LIMIT` (2 MiB): `Files differ (N -> M bytes; too
      large to diff)`, truncated True, since a diff exists that is not shown.

    Never refuses. Costs a linear pass over both sides, plus `difflib.SequenceMatcher`
    (superlinear in the worst case) over the lines between their common head and tail.
    Where those exceed `PREVIEW_MATCH_LINES` on either side they are first cut at lines
    unique to both (O(n log n)), and a piece still too big is shown as one removed block
    and one added block (a correct but coarse diff). Output work stops at `max_bytes`.
    """
    if old == new:
        return "", False
    if len(old) > PREVIEW_DIFF_LIMIT or len(new) > PREVIEW_DIFF_LIMIT:
        summary = f"Files differ ({len(old)} -> {len(new)} bytes; too large to diff)\n"
        return _bounded(iter([summary]), max_bytes)[0], True
    try:
        a, b = old.decode("utf-8"), new.decode("utf-8")
    except UnicodeDecodeError:
        return _bounded(
            iter([f"Binary files differ ({len(old)} -> {len(new)} bytes)\n"]), max_bytes
        )
    return _bounded(_unified_lines(split_lines(a), split_lines(b), path), max_bytes)
