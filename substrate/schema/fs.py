"""Wire schema of reads (SPEC §3) and guarded writes (SPEC §4)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from substrate.schema.common import (
    NonNegative,
    Params,
    RelPath,
    Result,
    Sha256,
    WorkspaceId,
    method,
)

MAX_READ = 4 << 20

Kind = Literal["file", "dir", "symlink", "other"]


class StatParams(Params):
    workspace: WorkspaceId
    path: RelPath
    # Hash a file over `inline_hash_bytes` too (a pass over the whole file, off the reader
    # threads); without it such a file's digest is deferred unless already known.
    hash: bool = False


class StatResult(Result):
    path: str
    kind: Kind
    size: int
    mode: int
    mtime_ns: int
    sha256: str | None = None
    # True when a file's sha256 is left out because it is over `inline_hash_bytes` and
    # not known yet: ask again with `hash: true`.
    sha256_deferred: bool = False


class ReadParams(Params):
    workspace: WorkspaceId
    path: RelPath
    offset: NonNegative = 0
    # Bounded in `reads` (too_large), not here, so the refusal is the named one.
    length: NonNegative = 262144
    # As `StatParams.hash`: the whole file's digest even over `inline_hash_bytes`.
    hash: bool = False


class ReadResult(Result):
    path: str
    size: int
    # The whole file's digest, or null with `sha256_deferred` (see `StatResult`).
    sha256: str | None
    offset: int
    eof: bool
    encoding: Literal["utf-8", "base64"]
    data: str
    sha256_deferred: bool = False


class ListParams(Params):
    workspace: WorkspaceId
    path: RelPath = "."
    limit: Annotated[int, msgspec.Meta(ge=1, le=100000)] = 1000


class ListEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    # A name that is not UTF-8 has its other bytes written `\xNN` here, and its exact
    # bytes in `name_b64` (absent for UTF-8 names).
    name: str
    kind: Kind
    size: int
    name_b64: str | None = None


class ListResult(Result):
    entries: list[ListEntry]
    truncated: bool


class WalkParams(Params):
    workspace: WorkspaceId
    path: RelPath = "."
    max_entries: Annotated[int, msgspec.Meta(ge=1, le=1000000)] = 10000
    max_depth: Annotated[int, msgspec.Meta(ge=0, le=4096)] | None = None
    include_git: bool = False


class WalkEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    path: str  # escaped as `ListEntry.name` when not UTF-8, with the bytes in `path_b64`
    kind: Kind
    size: int
    path_b64: str | None = None


class WalkResult(Result):
    paths: list[WalkEntry]
    truncated: bool


class SearchParams(Params):
    workspace: WorkspaceId
    pattern: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    path: RelPath = "."
    glob: str | None = None
    fixed: bool = False
    ignore_case: bool = False
    max_matches: Annotated[int, msgspec.Meta(ge=1, le=100000)] = 200
    max_line_bytes: Annotated[int, msgspec.Meta(ge=16, le=65536)] = 512


class SearchMatch(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    path: str  # escaped as `ListEntry.name` when not UTF-8, with the bytes in `path_b64`
    line: int
    column: int
    text: str
    path_b64: str | None = None


class SearchResult(Result):
    matches: list[SearchMatch]
    truncated: bool
    files_scanned: int
    bytes_scanned: int


Mode = Annotated[int, msgspec.Meta(ge=0, le=0o7777)]


class WriteParams(Params):
    workspace: WorkspaceId
    path: RelPath
    base_sha256: Sha256 | None
    content: str | None = None
    content_b64: str | None = None
    mode: Mode | None = None
    create_parents: bool = False
    dry_run: bool = False
    plan_digest: Sha256 | None = None


class Edit(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    old: Annotated[str, msgspec.Meta(min_length=1)]
    new: str
    count: Annotated[int, msgspec.Meta(ge=1)] = 1


class PatchParams(Params):
    workspace: WorkspaceId
    path: RelPath
    base_sha256: Sha256
    edits: list[Edit] | None = None
    unified_diff: str | None = None
    dry_run: bool = False
    plan_digest: Sha256 | None = None


class DeleteParams(Params):
    workspace: WorkspaceId
    path: RelPath
    base_sha256: Sha256
    dry_run: bool = False
    plan_digest: Sha256 | None = None


class Plan(Result, omit_defaults=False):
    path: str
    op: Literal["create", "replace", "delete"]
    base_sha256: str | None
    new_sha256: str | None
    size: int
    mode: int | None
    diff: str
    diff_truncated: bool
    plan_digest: str
    applied: bool


method("fs.stat", StatParams, StatResult)
method("fs.read", ReadParams, ReadResult)
method("fs.list", ListParams, ListResult)
method("fs.walk", WalkParams, WalkResult)
method("fs.search", SearchParams, SearchResult)
# Writes are shielded: a started write finishes (and is answered) across a shutdown.
method(
    "fs.write",
    WriteParams,
    Plan,
    mutating=True,
    shielded=True,
    doc="Guarded create or replace, bound to base_sha256.",
)
method(
    "fs.patch",
    PatchParams,
    Plan,
    mutating=True,
    shielded=True,
    doc="Guarded search/replace edits or a strict unified diff.",
)
method(
    "fs.delete",
    DeleteParams,
    Plan,
    mutating=True,
    shielded=True,
    doc="Guarded delete, bound to base_sha256.",
)
