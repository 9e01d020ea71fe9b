"""The pure patch core: exact string edits and strict unified diffs.

No I/O and no clock: these functions take bytes and return bytes, and say no by raising
`PatchConflict`. `substrate.workspace.writes` reads the file, calls in here, and writes;
the plan's diff preview is `substrate.workspace.preview`.

Theory of operation
-------------------
Both appliers work on the file decoded as UTF-8 (strictly; anything else is not text and
is refused) and encode the result back. UTF-8 decoding is lossless for valid input, so an
untouched byte stays the same byte, a BOM included.

Lines are split on ``"\\n"`` only. A ``"\\r"`` before it belongs to the line, so CRLF files
are compared exactly as they are, and no other character (form feed, U+2028, a lone
``"\\r"``) starts a line. This is why `str.splitlines` appears nowhere here.

A unified diff is applied strictly: a hunk whose context or removed lines are not exactly
the file's lines at its stated old-start line is a conflict. There is no fuzz and, unlike
GNU patch and ``git apply``, no search for the hunk at nearby lines: an agent's diff made
against another version of the file must fail, not land somewhere plausible.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from substrate.errors import PatchConflict, TooLarge

#: Largest file the appliers produce (the same bound as the files `substrate.workspace.writes` loads):
#: a small edit with a large `count` must not build a result of any size.
MAX_RESULT_BYTES = 64 << 20


class EditLike(Protocol):
    """One exact string replacement (the wire's `EditSpec` has this shape)."""

    @property
    def old(self) -> str: ...

    @property
    def new(self) -> str: ...

    @property
    def count(self) -> int | Literal["all"]: ...


# --------------------------------------------------------------------------------------
# Shared helpers


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise PatchConflict(
            "the file is not UTF-8 text; edits and diffs apply to text only",
            reason="not_text",
        ) from None


def _encode(text: str, message: str, **data: int | None) -> bytes:
    # Wire strings may carry lone surrogates (JSON "\ud800"); they have no UTF-8 form.
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise PatchConflict(message, **data) from None


def _check_size(size: int, max_bytes: int, what: str) -> None:
    """Refuse a result over the bound before it is built (sizes are computed, not measured)."""
    if size > max_bytes:
        raise TooLarge(
            f"{what} would make the file {size} bytes, over the {max_bytes} byte bound",
            limit=max_bytes,
        )


def split_lines(text: str) -> list[str]:
    """Lines with their `\\n` kept; only the last may lack one. Splits on `\\n` only."""
    parts = text.split("\n")
    lines = [part + "\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


# --------------------------------------------------------------------------------------
# Exact string edits


def apply_edits(data: bytes, edits: Sequence[EditLike], max_bytes: int = MAX_RESULT_BYTES) -> bytes:
    """Apply exact string replacements in order, each to the previous one's result.

    Each edit's `old` must be non-empty and occur exactly `count` (>= 1) times in the text
    as it stands before that edit (non-overlapping occurrences, as `str.count`), or at
    least once for `count = "all"`; all of them are replaced by `new`. No edits means the
    content is returned unchanged.

    Refuses with `PatchConflict` when the file is not UTF-8 (`reason="not_text"`), when an
    edit's `old` is empty or its `count` is below 1 (`edit` = its index), when `old`
    occurs another number of times (`edit`, `occurrences`, `expected`: the count, or
    "all" when it does not occur at all), or when `new` is
    not encodable (a lone surrogate). Refuses with `TooLarge` when any edit's result would
    pass `max_bytes`; that size is computed from the counts before the result is built, so
    memory stays bounded by `max_bytes` whatever `count` and `new` ask for. Nothing is
    applied unless every edit applies.

    Costs one decode and one encode of the file, plus one scan and one copy per edit.
    """
    text = _decode(data)
    size = len(data)
    for index, edit in enumerate(edits):
        if not edit.old:
            raise PatchConflict(f"edit {index}: old is empty", edit=index)
        every = edit.count == "all"
        if not every and int(edit.count) < 1:
            raise PatchConflict(f"edit {index}: count must be at least 1", edit=index)
        found = text.count(edit.old)
        if (found == 0) if every else (found != edit.count):
            expected = "at least once" if every else f"{edit.count}"
            raise PatchConflict(
                f"edit {index}: old occurs {found} time{'' if found == 1 else 's'},"
                f" expected {expected}",
                edit=index,
                occurrences=found,
                expected=edit.count,
            )
        new = _encode(edit.new, f"edit {index}: new is not valid Unicode text", edit=index)
        # `old` occurs in the text, so it has no lone surrogate and encodes. The size is
        # computed from the count before any string is built, for "all" as for a number.
        size += found * (len(new) - len(edit.old.encode("utf-8")))
        _check_size(size, max_bytes, f"edit {index}")
        text = text.replace(edit.old, edit.new)
    return text.encode("utf-8")


# --------------------------------------------------------------------------------------
# Strict unified diffs

# Counts are bounded so that int() never meets a pathological digit string. What follows
# the closing "@@" is a section heading (git), after a blank.
_HUNK_HEADER = re.compile(
    r"@@ -(\d{1,12})(?:,(\d{1,12}))? \+(\d{1,12})(?:,(\d{1,12}))? @@(?:[ \t].*)?\r?"
)

# Extended git headers that do not change what the hunks mean.
_HARMLESS_HEADERS = ("index ", "new file mode ", "deleted file mode ")
# Headers announcing something a single-file text patch cannot honour.
_REFUSED_HEADERS = (
    ("old mode ", "mode changes are not supported"),
    ("new mode ", "mode changes are not supported"),
    ("rename from ", "renames and copies are not supported"),
    ("rename to ", "renames and copies are not supported"),
    ("copy from ", "renames and copies are not supported"),
    ("copy to ", "renames and copies are not supported"),
    ("similarity index ", "renames and copies are not supported"),
    ("dissimilarity index ", "renames and copies are not supported"),
    ("Binary files ", "binary diffs are not supported"),
    ("GIT binary patch", "binary diffs are not supported"),
)


@dataclass(frozen=True, slots=True)
class _Hunk:
    index: int
    old_start: int
    old_len: int
    old_lines: list[str]
    new_lines: list[str]


def _malformed(reason: str, diff_line: int, hunk: int | None = None) -> PatchConflict:
    return PatchConflict(
        f"malformed diff at diff line {diff_line}: {reason}", hunk=hunk, diff_line=diff_line
    )


def _parse_hunk(lines: list[str], at: int, index: int) -> tuple[_Hunk, int]:
    """Parse the hunk whose header is `lines[at]`; return it and the index after it."""
    match = _HUNK_HEADER.fullmatch(lines[at])
    if match is None:
        raise _malformed("bad hunk header", at + 1, index)
    old_start, new_start = int(match[1]), int(match[3])
    old_len = 1 if match[2] is None else int(match[2])
    new_len = 1 if match[4] is None else int(match[4])
    if old_len == 0 and new_len == 0:
        raise _malformed("empty hunk", at + 1, index)
    if (old_len and not old_start) or (new_len and not new_start):
        raise _malformed("line 0 with a non-zero count", at + 1, index)

    old_lines: list[str] = []
    new_lines: list[str] = []
    old_left, new_left = old_len, new_len
    # Which sides the previous body line belongs to, for a "\ No newline" marker.
    last: str | None = None
    # A side whose last line lost its newline may not continue.
    old_closed = new_closed = False
    i = at + 1

    def strip_newline(where: int) -> None:
        nonlocal last, old_closed, new_closed
        if last is None:
            raise _malformed("no-newline marker without a line before it", where + 1, index)
        if last in ("both", "old"):
            old_lines[-1] = old_lines[-1][:-1]
            old_closed = True
        if last in ("both", "new"):
            new_lines[-1] = new_lines[-1][:-1]
            new_closed = True
        last = None

    while old_left or new_left:
        if i >= len(lines):
            raise _malformed("hunk is shorter than its header says", i, index)
        line = lines[i]
        tag = line[:1]
        # The newline here is the diff's own; only a marker says the file lacks one. An
        # empty line stands for an empty context line (editors strip the lone space).
        body = line[1:] + "\n"
        if tag in (" ", ""):
            if not (old_left and new_left):
                raise _malformed("more context lines than the header says", i + 1, index)
            if old_closed or new_closed:
                raise _malformed("line after a no-newline marker", i + 1, index)
            old_lines.append(body)
            new_lines.append(body)
            old_left, new_left, last = old_left - 1, new_left - 1, "both"
        elif tag == "-":
            if not old_left:
                raise _malformed("more removed lines than the header says", i + 1, index)
            if old_closed:
                raise _malformed("line after a no-newline marker", i + 1, index)
            old_lines.append(body)
            old_left, last = old_left - 1, "old"
        elif tag == "+":
            if not new_left:
                raise _malformed("more added lines than the header says", i + 1, index)
            if new_closed:
                raise _malformed("line after a no-newline marker", i + 1, index)
            new_lines.append(body)
            new_left, last = new_left - 1, "new"
        elif tag == "\\":
            strip_newline(i)
        else:
            raise _malformed("hunk is shorter than its header says", i + 1, index)
        i += 1
    if i < len(lines) and lines[i].startswith("\\"):
        strip_newline(i)
        i += 1
    return _Hunk(index, old_start, old_len, old_lines, new_lines), i


def _starts_file(lines: list[str], i: int) -> bool:
    line = lines[i]
    if line.startswith("diff "):
        return True
    return line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")


def _parse_diff(diff: str) -> list[_Hunk]:
    lines = diff.split("\n")
    if lines[-1] == "":
        lines.pop()
    hunks: list[_Hunk] = []
    seen_diff = seen_header = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("@@"):
            hunk, i = _parse_hunk(lines, i, len(hunks))
            hunks.append(hunk)
            continue
        if hunks:
            # After the first hunk: more hunks, or nothing but blank lines.
            if _starts_file(lines, i):
                raise PatchConflict(
                    "the diff touches more than one file", hunk=None, diff_line=i + 1
                )
            if all(not rest.strip() for rest in lines[i:]):
                break
            if line[:1] in (" ", "-", "+", "\\"):
                raise _malformed("hunk is longer than its header says", i + 1, hunks[-1].index)
            raise _malformed("unexpected line between hunks", i + 1)
        if line.startswith("diff "):
            if seen_diff or seen_header:
                raise PatchConflict(
                    "the diff touches more than one file", hunk=None, diff_line=i + 1
                )
            seen_diff = True
        elif line.startswith("--- "):
            if seen_header:
                raise PatchConflict(
                    "the diff touches more than one file", hunk=None, diff_line=i + 1
                )
            if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
                raise _malformed("'---' header without '+++' after it", i + 1)
            seen_header = True
            i += 1
        elif line.startswith("+++ "):
            raise _malformed("'+++' header without '---' before it", i + 1)
        elif line.startswith(_HARMLESS_HEADERS) or not line.strip():
            pass
        else:
            for prefix, reason in _REFUSED_HEADERS:
                if line.startswith(prefix):
                    raise PatchConflict(reason, hunk=None, diff_line=i + 1)
            raise _malformed("unexpected line before the first hunk", i + 1)
        i += 1
    if not hunks:
        raise PatchConflict("the diff has no hunks", hunk=None)
    return hunks


def _extend(out: list[str], chunk: list[str], hunk: int) -> None:
    # Only the file's last line may lack a newline; nothing may be put after it.
    if chunk and out and not out[-1].endswith("\n"):
        raise PatchConflict(
            f"hunk {hunk}: lines would follow a line with no newline at end of file",
            hunk=hunk,
        )
    out.extend(chunk)


def _lines_bytes(lines: list[str]) -> int:
    # surrogatepass only to count: a lone surrogate is refused when the result is encoded.
    return sum(len(line.encode("utf-8", "surrogatepass")) for line in lines)


def apply_unified_diff(data: bytes, diff: str, max_bytes: int = MAX_RESULT_BYTES) -> bytes:
    """Apply a unified diff for one file strictly: no fuzz, no offset search.

    Accepts optional `diff ...`, `index ...`, `new file mode`/`deleted file mode`,
    `---`/`+++` headers, then one or more hunks in ascending, non-overlapping order. Each
    hunk must apply exactly at its old-start line (with no old lines, after that line:
    `@@ -0,0 +1,N @@` fills an empty file): its context and removed lines must equal the file's lines there, line
    ends included (`\\r\\n` in CRLF files), and its body must hold exactly the line counts
    its header states. A `\\ No newline at end of file` marker strips the line before it on
    the side(s) it belongs to. An empty body line is read as an empty context line. The
    new-side start is redundant and not checked. Header paths are not compared with
    anything: the caller names the file.

    Refuses with `PatchConflict` (`hunk` = index or null, and `line` or `diff_line` where
    one applies; messages never quote file contents) when the file is not UTF-8, the diff
    has no hunks, touches more than one file (a second `diff`/`---`+`+++` header), carries
    mode, rename, copy or binary headers, is malformed, or a hunk does not match. Refuses
    with `TooLarge` when the result would pass `max_bytes` (computed before it is built).

    Costs one decode, one split and one join of the file plus a pass over the diff.
    """
    text = _decode(data)
    hunks = _parse_diff(diff)
    lines = split_lines(text)
    out: list[str] = []
    cursor = 0
    size = len(data)
    for hunk in hunks:
        # With no old lines, old-start names the line the new ones go after.
        pos = hunk.old_start - 1 if hunk.old_len else hunk.old_start
        if pos < cursor:
            raise PatchConflict(
                f"hunk {hunk.index}: overlaps or precedes the hunk before it", hunk=hunk.index
            )
        if pos + hunk.old_len > len(lines):
            raise PatchConflict(
                f"hunk {hunk.index}: reaches past the end of the file ({len(lines)} lines)",
                hunk=hunk.index,
            )
        for offset, expected in enumerate(hunk.old_lines):
            if lines[pos + offset] != expected:
                number = pos + offset + 1
                raise PatchConflict(
                    f"hunk {hunk.index}: line {number} does not match the diff",
                    hunk=hunk.index,
                    line=number,
                )
        size += _lines_bytes(hunk.new_lines) - _lines_bytes(hunk.old_lines)
        _check_size(size, max_bytes, f"hunk {hunk.index}")
        _extend(out, lines[cursor:pos], hunk.index)
        _extend(out, hunk.new_lines, hunk.index)
        cursor = pos + hunk.old_len
    _extend(out, lines[cursor:], hunks[-1].index)
    return _encode("".join(out), "the diff adds text that is not valid Unicode", hunk=None)
