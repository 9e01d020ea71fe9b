"""A guarded write's plan: its digest, the modes a write gives, the set-id rule (pure).

A guarded write's plan, the pure part every write path shares (docs/protocol.md §4):
the plan digest an operator approves, the modes a write gives, and the set-id rule.

`writer`, `upload` and the batches (`batch_files`, `batch_dirs`) compute their plans
with these, so an `fs.write`, an upload and a change set's file that make the same
bytes at the same path from the same base have the same digest. Pure.
"""

from __future__ import annotations

import hashlib
import stat
from typing import Literal

from substrate.schema.fs import Plan
from substrate.store.journal import canonical
from substrate.workspace import patching

#: Files bigger than this are not loaded for patching, nor made by a patch, nor read
#: as a base.
MAX_PATCH_FILE = patching.MAX_RESULT_BYTES
#: Mode of a created file when the caller gives none.
DEFAULT_FILE_MODE = 0o644
DEFAULT_DIR_MODE = 0o755

Op = Literal["create", "replace", "delete"]
DirOp = Literal["mkdir", "rmdir", "chmod"]


def plan_digest(
    root_id: str, path: str, op: Op, base: str | None, new: str | None, mode: int | None
) -> str:
    """SHA-256 of the canonical JSON array `[root_id, path, op, base, new, mode]`."""
    return hashlib.sha256(canonical([root_id, path, op, base, new, mode])).hexdigest()


def journal_data(plan: Plan, approval: str | None) -> dict[str, object]:
    """What an applied plan's journal entry holds (and its intent, before the rename):
    path, op, digests, size, mode, plan digest and the approval that authorised it."""
    return {
        "path": plan.path,
        "op": plan.op,
        "base_sha256": plan.base_sha256,
        "new_sha256": plan.new_sha256,
        "size": plan.size,
        "mode": plan.mode,
        "plan_digest": plan.plan_digest,
        "approval_id": approval,
    }


def dir_digest(root_id: str, path: str, op: DirOp, mode: int | None) -> str:
    """The plan digest of a directory step: `[root_id, path, op, null, null, mode]`."""
    return hashlib.sha256(canonical([root_id, path, op, None, None, mode])).hexdigest()


def no_setid(mode: int) -> int:
    """`mode` without set-id bits: substrate writes as root and the bytes are the agent's
    (a write by the file's owner would clear these bits too)."""
    return mode & ~(stat.S_ISUID | stat.S_ISGID)
