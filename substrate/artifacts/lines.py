"""Reading stored output back by line: `artifact.lines` and `artifact.grep`, bounded.

Pure over an open fd (`os.pread` only: the fd's offset is never moved, so readers may
share it). Lines end at `\\n`; a last line without one counts. Finding line N uses a
line index, `counts[i]` = newlines before block `i` (`count_blocks`, one `uint64` per
`BLOCK`), so it reads one block; the store keeps that index for large artifacts.
Memory stays at about two blocks whatever the artifact's size or its longest line.
"""

from __future__ import annotations

import array
import bisect
import os

from substrate.artifacts.sink import boundary_before
from substrate.matching.agent_regex import Matcher
from substrate.schema.artifact import GrepMatch, GrepResult, LinesResult

#: Read size when scanning; also the granularity of the line index.
BLOCK = 1 << 20
MAX_LINE_BYTES = 64 << 10  # a longer line is cut here by `read_lines`
LINES_BUDGET = 1 << 20  # `read_lines` stops adding lines past this many bytes
GREP_TEXT_BYTES = 4096  # a matching line's text is cut here
GREP_LINE_BYTES = 1 << 20  # only this much of a longer line is searched


def count_blocks(fd: int, size: int) -> array.array[int]:
    """`counts[i]` = newlines in bytes [0, i * BLOCK); one entry per block, plus one."""
    counts = array.array("Q", [0])
    total = 0
    for offset in range(0, size, BLOCK):
        total += os.pread(fd, BLOCK, offset).count(b"\n")
        counts.append(total)
    return counts


def line_offset(fd: int, counts: array.array[int], size: int, start: int) -> int | None:
    """Byte offset where line `start` begins, or None past the last line."""
    need = start - 1  # newlines before that line
    if need == 0:
        return 0 if size > 0 else None
    if need > counts[-1]:
        return None
    i = bisect.bisect_left(counts, need) - 1  # the block holding the need-th newline
    block = os.pread(fd, BLOCK, i * BLOCK)
    need -= counts[i]
    lo, hi = 0, len(block)
    # Halve the range by counting (C speed), then walk the last few newlines.
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        c = block.count(b"\n", lo, mid)
        if c >= need:
            hi = mid
        else:
            need -= c
            lo = mid
    pos = lo - 1
    for _ in range(need):
        pos = block.find(b"\n", pos + 1, hi)
    offset = i * BLOCK + pos + 1
    return offset if offset < size else None


def decode_cut(data: bytes | bytearray, limit: int) -> str:
    """At most `limit` bytes of `data`, cut on a character boundary, U+FFFD for bad bytes."""
    return bytes(data[: boundary_before(data, limit)]).decode("utf-8", "replace")


def read_lines(fd: int, offset: int, size: int, start: int, count: int) -> LinesResult:
    """Up to `count` lines from byte `offset` (where line `start` begins), bounded.

    Each line is cut at `MAX_LINE_BYTES` (the rest of it is read and skipped); no more
    lines are added once `LINES_BUDGET` bytes were returned.
    """
    lines: list[str] = []
    budget = LINES_BUDGET
    cut_any = False
    line = bytearray()  # the current line's first MAX_LINE_BYTES (+1 to detect a cut)
    pos = offset  # next byte to read
    while len(lines) < count and budget > 0 and pos < size:
        block = os.pread(fd, min(BLOCK, size - pos), pos)
        if not block:
            break
        i = 0
        while i < len(block) and len(lines) < count and budget > 0:
            nl = block.find(b"\n", i)
            end = len(block) if nl < 0 else nl
            room = MAX_LINE_BYTES + 1 - len(line)
            if room > 0:
                line += block[i : min(end, i + room)]
            if nl < 0:
                i = len(block)
                break
            i = nl + 1
            cut_any |= len(line) > MAX_LINE_BYTES
            lines.append(decode_cut(line, MAX_LINE_BYTES))
            budget -= min(len(line), MAX_LINE_BYTES)
            line.clear()
        pos += i
    if line:  # the last line, without a newline
        cut_any |= len(line) > MAX_LINE_BYTES
        lines.append(decode_cut(line, MAX_LINE_BYTES))
    return LinesResult(start=start, lines=lines, eof=pos >= size, truncated=cut_any)


def grep_fd(fd: int, regex: Matcher, limit: int) -> GrepResult:
    """One match per matching line, reading `BLOCK` at a time (memory ≤ 2 blocks).

    The pattern runs over whole lines (`re.MULTILINE`); of a line longer than
    `GREP_LINE_BYTES` only its head is searched.
    """
    matches: list[GrepMatch] = []
    line_no = 1  # the line that starts at data[0]
    carry = b""
    pos = 0
    skipping = False  # inside a line longer than GREP_LINE_BYTES, already searched
    while True:
        block = os.pread(fd, BLOCK, pos)
        pos += len(block)
        eof = not block
        if skipping:
            nl = block.find(b"\n")
            if nl < 0:
                if eof:
                    return GrepResult(matches=matches, truncated=False)
                continue
            block = block[nl + 1 :]
            skipping = False
            line_no += 1
        data = carry + block
        if eof:
            _scan(regex, data, len(data), line_no, matches, limit)
            return GrepResult(matches=matches, truncated=len(matches) >= limit)
        end = data.rfind(b"\n") + 1
        if end == 0:
            if len(data) < GREP_LINE_BYTES:
                carry = data
                continue
            # One line longer than we search: its head is searched, the rest skipped.
            data, end, carry, skipping = data[:GREP_LINE_BYTES], GREP_LINE_BYTES, b"", True
            if _scan(regex, data, end, line_no, matches, limit):
                return GrepResult(matches=matches, truncated=True)
            continue
        if _scan(regex, data, end, line_no, matches, limit):
            return GrepResult(matches=matches, truncated=True)
        line_no += data.count(b"\n", 0, end)
        carry = data[end:]


def _scan(
    regex: Matcher,
    data: bytes,
    end: int,
    line_no: int,
    out: list[GrepMatch],
    limit: int,
) -> bool:
    """Append one match per matching line of `data[:end]`; True when `limit` was reached."""
    counted_to = 0
    pos = 0
    while pos < end:
        m = regex.search(data, pos, end)
        # An empty match at `end` after a newline is the start of a line not in this piece.
        if m is None or (m.start() == end and data[end - 1 : end] == b"\n"):
            return False
        start = data.rfind(b"\n", 0, m.start()) + 1
        stop = data.find(b"\n", m.start(), end)
        stop = end if stop < 0 else stop
        line_no += data.count(b"\n", counted_to, start)
        counted_to = start
        text = decode_cut(data[start : min(stop, start + GREP_TEXT_BYTES + 1)], GREP_TEXT_BYTES)
        out.append(GrepMatch(line=line_no, text=text))
        if len(out) >= limit:
            return True
        pos = stop + 1
    return False
