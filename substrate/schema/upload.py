"""Wire schema of chunked uploads (docs/protocol.md §14).

A file of any size up to
`max_upload_bytes`, sent in pieces that each fit a request line, then written by the
guarded path as one `fs.write` would be (bound to a base, same-directory atomic replace).

`fs.upload.begin` declares the whole file (where, bound to which base, its size and
SHA-256); `fs.upload.chunk` sends bytes in order; `fs.upload.commit` checks them and
answers the usual `Plan` (a dry run writes nothing and keeps the upload open);
`fs.upload.abort` drops an upload early. Uploads are the caller's (its socket and uid),
live in the daemon's memory and its state dir's spool, and expire when idle.
"""

from __future__ import annotations

from typing import Annotated

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
from substrate.schema.fs import Mode, Plan

#: An upload handle, as returned by `fs.upload.begin`: `upl_` and 32 hex digits.
UploadId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class UploadBeginParams(Params):
    """A file to upload: the target, the base it replaces, and what will be sent.

    Checked at once as `fs.write` would check it (path, policy, base: `stale_base`,
    `already_exists`, `not_found`), and again at commit.
    """

    workspace: WorkspaceId
    path: RelPath
    #: The target's current SHA-256 (null: it must not exist, a create).
    base_sha256: Sha256 | None
    #: Bytes that will be sent, in all; at most `max_upload_bytes`, else `too_large`.
    size: NonNegative
    #: SHA-256 of all `size` bytes; checked at commit (`upload_mismatch`).
    sha256: Sha256
    #: The new file's mode (set-id bits dropped); default: the old file's, or 0644.
    mode: Mode | None = None
    #: Make missing parent directories at commit (the workspace owner's, 0755).
    create_parents: bool = False


class UploadBeginResult(Result):
    upload: str
    #: The largest `fs.upload.chunk` piece, in decoded bytes, whose request fits the
    #: daemon's `max_request_bytes`.
    chunk_bytes: int
    #: The upload expires after this many seconds without a call naming it.
    idle_timeout_s: float


class UploadChunkParams(Params):
    """The next bytes of an upload, at `offset`.

    `offset` must be the count of bytes received so far; a range already received may
    be sent again with the same bytes (a retry), else `upload_conflict`.
    """

    upload: UploadId
    offset: NonNegative
    #: The bytes, base64; the request line must fit `max_request_bytes`.
    data_b64: str


class UploadChunkResult(Result):
    upload: str
    #: Bytes received so far (contiguous from 0): the next chunk's `offset`.
    received: int
    size: int


class UploadCommitParams(Params):
    """Write an upload whose bytes have all arrived, through the guarded path.

    Refuses `upload_incomplete`, `upload_mismatch`, and all that `fs.write` refuses
    (`stale_base` when the target changed since begin, `plan_mismatch`,
    `approval_required`, ...); a refusal leaves the upload open, a dry run too.
    """

    upload: UploadId
    dry_run: bool = False
    plan_digest: Sha256 | None = None


class UploadRef(Params):
    upload: UploadId


class UploadAbortResult(Result):
    upload: str
    #: Bytes that had been received (and are now dropped with the spool).
    received: int


#: Bytes of a `fs.upload.chunk` request line besides its base64 data (the envelope, an
#: id, the upload id, a 64-bit offset), with room to spare.
CHUNK_LINE_OVERHEAD = 512


def chunk_bytes(max_request_bytes: int) -> int:
    """The largest chunk, in decoded bytes, whose `fs.upload.chunk` request line fits in
    `max_request_bytes` (base64 makes 3 bytes 4 characters)."""
    return max(3, (max_request_bytes - CHUNK_LINE_OVERHEAD) // 4 * 3)


method(
    "fs.upload.begin",
    UploadBeginParams,
    UploadBeginResult,
    doc="Open a chunked upload of a file, bound to a base like fs.write.",
)
method(
    "fs.upload.chunk",
    UploadChunkParams,
    UploadChunkResult,
    doc="Send the next bytes of an upload (contiguous; an identical re-send is a no-op).",
)
# Shielded like fs.write: a started commit finishes (and is answered) across a shutdown.
method(
    "fs.upload.commit",
    UploadCommitParams,
    Plan,
    mutating=True,
    shielded=True,
    doc="Check an upload's size and SHA-256, then write it by the guarded path: a Plan.",
)
method(
    "fs.upload.abort",
    UploadRef,
    UploadAbortResult,
    doc="Drop an open upload and its spooled bytes.",
)
