"""Handlers of `fs.upload.*`: chunked uploads (docs/protocol.md §14).

Each step runs in a worker thread. The commit's thread is never abandoned (trio's
default), like a guarded write's: a cancelled request or a stopping daemon still lets a
started commit finish and journal itself. Uploads are keyed by `Caller.name` (socket and
uid), so a client that lost its connection resumes on a new one.
"""

from __future__ import annotations

import base64
import binascii
import os

import trio

from substrate.api.base import Caller, Handles
from substrate.api.services import UploadServices
from substrate.errors import InvalidParams
from substrate.schema.fs import Plan
from substrate.schema.upload import (
    UploadAbortResult,
    UploadBeginParams,
    UploadBeginResult,
    UploadChunkParams,
    UploadChunkResult,
    UploadCommitParams,
    UploadRef,
    chunk_bytes,
)
from substrate.workspace.uploads import Upload, Uploads

handles = Handles(UploadServices)


@handles("fs.upload.begin")
async def begin(s: UploadServices, caller: Caller, p: UploadBeginParams) -> UploadBeginResult:
    ws = s.workspaces.get(p.workspace)
    uploads = s.uploads
    uploads.check_size(p.size)  # before hashing anything
    await trio.to_thread.run_sync(
        s.upload_writer.check, ws, p.path, p.base_sha256, p.create_parents
    )

    def open_upload() -> Upload:
        return uploads.begin(
            caller.name,
            workspace=ws.id,
            path=p.path,
            base_sha256=p.base_sha256,
            size=p.size,
            sha256=p.sha256,
            mode=p.mode,
            create_parents=p.create_parents,
        )

    up = await trio.to_thread.run_sync(open_upload)
    return UploadBeginResult(
        upload=up.id,
        chunk_bytes=chunk_bytes(s.config.max_request_bytes),
        idle_timeout_s=uploads.idle_s,
    )


@handles("fs.upload.chunk")
async def chunk(s: UploadServices, caller: Caller, p: UploadChunkParams) -> UploadChunkResult:
    def run() -> UploadChunkResult:
        # Decoded here, off the event loop (a chunk is up to a request line of base64).
        try:
            data = base64.b64decode(p.data_b64, validate=True)
        except binascii.Error:
            raise InvalidParams("data_b64 is not base64", path="$.data_b64") from None
        up = s.uploads.chunk(caller.name, p.upload, p.offset, data)
        return UploadChunkResult(upload=up.id, received=up.received, size=up.size)

    return await trio.to_thread.run_sync(run)


@handles("fs.upload.commit")
async def commit(s: UploadServices, caller: Caller, p: UploadCommitParams) -> Plan:
    uploads = s.uploads

    def run() -> Plan:
        with uploads.using(caller.name, p.upload) as up:
            Uploads.check_complete(up)
            ws = s.workspaces.get(up.workspace)
            spool = uploads.open_spool(up)
            try:
                plan = s.upload_writer.commit(ws, up, spool, p.dry_run, p.plan_digest, caller.name)
            finally:
                os.close(spool)
            if plan.applied:
                uploads.finish(up)
            return plan

    return await trio.to_thread.run_sync(run)


@handles("fs.upload.abort")
async def abort(s: UploadServices, caller: Caller, p: UploadRef) -> UploadAbortResult:
    received = await trio.to_thread.run_sync(s.uploads.abort, caller.name, p.upload)
    return UploadAbortResult(upload=p.upload, received=received)
