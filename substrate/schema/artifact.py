"""Wire schema of output refs (docs/protocol.md §5 "Output refs") and artifacts (docs/protocol.md §6).

Bounds that have a named refusal (`too_large`) are checked in `substrate.artifacts.store`, not
here, so a caller asking for too much gets `too_large` rather than `invalid_params`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from substrate.schema.common import NonNegative, Params, Result, method

#: An artifact id as handed out in an output ref (`art_<32 hex>`). Any other string is
#: simply unknown (`artifact_unknown`), so the schema only bounds the length.
ArtifactId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Encoding = Literal["utf-8", "base64"]


class OutputRef(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """One output stream of a process (`stdout`, `stderr` of a proc result).

    Inline (the stream is at most the inline limit): `{bytes, sha256, truncated, encoding,
    inline}`. Spilled: `{bytes, sha256, truncated, artifact, preview_head, preview_tail}`.
    `bytes` and `sha256` describe what was kept; `truncated` means the stream passed
    `max_output_bytes` (or the disk refused more) and the rest was discarded.
    """

    bytes: int
    sha256: str
    truncated: bool
    encoding: Encoding | None = None
    inline: str | None = None
    artifact: str | None = None
    #: At most 4096 bytes of UTF-8 each; never splits a character; invalid bytes → U+FFFD.
    preview_head: str | None = None
    preview_tail: str | None = None


class StatParams(Params):
    artifact: ArtifactId


class StatResult(Result):
    artifact: str
    bytes: int
    sha256: str
    created: float  # unix time the output started
    proc: str
    stream: str
    truncated: bool
    #: Kept from a spool a dead daemon left behind: the stream may have gone on.
    lost: bool = False


class ReadParams(Params):
    artifact: ArtifactId
    offset: NonNegative = 0
    length: NonNegative = 65536  # at most 1 MiB, else too_large


class ReadResult(Result):
    offset: int
    eof: bool
    encoding: Encoding  # utf-8 when the slice is valid UTF-8, else base64
    data: str


class LinesParams(Params):
    artifact: ArtifactId
    start: Annotated[int, msgspec.Meta(ge=1)] = 1  # 1-based line number
    count: Annotated[int, msgspec.Meta(ge=1)] = 100  # at most 10000, else too_large


class LinesResult(Result):
    start: int
    #: Lines without their `\n`, decoded with U+FFFD for invalid bytes. Fewer than asked
    #: when the artifact ends (`eof`) or the reply reached its 1 MiB budget (not `eof`:
    #: continue at `start + len(lines)`).
    lines: list[str]
    eof: bool
    #: Some line was longer than 64 KiB and was cut there.
    truncated: bool = False


class GrepParams(Params):
    artifact: ArtifactId
    pattern: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    fixed: bool = False  # the pattern is a literal string, not a regex
    ignore_case: bool = False
    max_matches: Annotated[int, msgspec.Meta(ge=1)] = 100  # at most 10000, else too_large


class GrepMatch(msgspec.Struct, frozen=True, kw_only=True):
    line: int  # 1-based
    text: str  # the line, cut at 4096 bytes on a character boundary


class GrepResult(Result, omit_defaults=False):
    matches: list[GrepMatch]
    truncated: bool  # max_matches was reached; more may follow


method("artifact.stat", StatParams, StatResult, doc="Size, digest and origin of an artifact.")
method("artifact.read", ReadParams, ReadResult, doc="A byte range of an artifact (≤ 1 MiB).")
method("artifact.lines", LinesParams, LinesResult, doc="Lines by number (≤ 10000, ≤ 1 MiB).")
method("artifact.grep", GrepParams, GrepResult, doc="Lines matching a regex (bytes).")
