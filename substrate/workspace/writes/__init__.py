"""Guarded writes: the one way a byte reaches the checkout (docs/protocol.md §4).

Every change substrate makes to a workspace file goes through here: `fs.write`,
`fs.patch`, `fs.delete`, an upload's commit (docs/protocol.md §14), a checkpoint's
restore (§11) and a working layer's change set (docs/working-layer.md). Blocking I/O and
SQLite throughout: callers run it in worker threads that are never abandoned.

How a byte reaches the checkout, one write (`writer.Writer`), in order:

1. validate the path (`paths.split_relpath`: `path_invalid`), refuse substrate's own
   temp names (`temp_files.check_not_reserved`: `path_denied`);
2. the policy (`ws.policy.may_write`: `path_denied`);
3. open the parent beneath the held root fd, never through a symlink
   (`base.open_parent`), and read the target as it is now (`base.read_current`);
4. the discoverable check (`discoverable.check_write`): nothing lands beneath, or
   completes, a git directory by content, and no new name holds a control or bidi
   character;
5. the base: the current digest must be `base_sha256` (`stale_base`,
   `already_exists`);
6. the plan digest (`plan.plan_digest` of `[root_id, path, op, base, new, mode]`; a
   given one must match: `plan_mismatch`), set-id bits dropped (`plan.no_setid`); a dry
   run stops here;
7. the approval, for a `require_approval` path (`approval_required` with the digest);
8. a temp file in the same directory under a name recorded in the database before the
   file exists (`temp_files.TempFiles.create`, `O_CREAT | O_EXCL | O_NOFOLLOW`), filled
   with the old owner and the plan's mode and fsynced;
9. meanwhile its intent, the journal entry it will get, commits (`intents.Intents`),
   durable before the rename;
10. under the workspace's commit lock: the base read and checked again, the approval
    found again, the pre-image kept for a live checkpoint;
11. the rename over the target through the same dir fd (`fsops.rename_into`), then the
    directory fsynced;
12. one transaction journals the entry, consumes the approval, forgets the temp record
    and drops the intent (shared with concurrent writes by the store's group commit).

An upload (`upload.UploadWriter`) takes the same steps with its bytes streamed from the
spool and hashed again on the way. A change set (`writer.BatchWriter`, `Writer.batch`)
takes them per file (`batch_files`), per directory step (`batch_dirs`) and per
symlink (`batch_links`: made with `symlinkat` into a temp name, renamed over) over one
frame (`batch`): plan each change, record all temp files and intents in one
transaction, write the temp files and make them durable (an fsync each when they are
few, else one `syncfs` per file system: `batch.SYNCFS_FROM`), then under
the lock re-check and rename each (a new file never over one made since:
`fsops.rename_new`), make the parents durable once and journal the chunk in one
transaction. A change set's file over 1 MiB is never held in memory: copied from its
source fd into the temp file and hashed from what the temp file holds (`streamed`),
its base hashed as a stream, up to `Writer`'s `max_change_file_bytes`.

Recovery at start, before anything writes: `WorkspaceRegistry.clean_stale_temp_files`
removes the temp files earlier runs recorded (`temp_files.remove_recorded`, only
recorded ones, only regular files), and `Writer.recover` journals, `recovered: true`,
every write whose change landed but whose journal transaction a crash lost
(`intents.Intents.resolve`). A crash leaves the old or the new file, never a mix.
`drift.drift_report` compares what the journal says substrate wrote with the checkout
(`journal.replay`, §8).

The discoverable rule (`substrate.workspace.discoverable`, `check_write`) stays a
workspace-level module beside `policy`, not one of these: it says what a person's host
tools would find in a checkout, and more than the write path asks it — the sandbox's
read-only mounts (`sandbox.mounts`: every git directory by content, every `.git` file's
target), the passthrough scan, the working layer's screen of a whole change set, and
the blocked reasons of a change set or a restore. Inside this package those would all
depend on the write mechanism for a rule about the checkout; here every write path
consults it (step 4), as it consults the policy (step 2).
"""

from substrate.workspace.writes.base import Current
from substrate.workspace.writes.batch import Landing
from substrate.workspace.writes.batch_dirs import DirChange
from substrate.workspace.writes.batch_files import (
    MAX_CHANGE_FILE_BYTES,
    MAX_CHANGESET_BYTES,
    FileChange,
)
from substrate.workspace.writes.batch_links import LinkChange, link_digest
from substrate.workspace.writes.drift import WRITE_KINDS, drift_report
from substrate.workspace.writes.intents import Intent, Intents
from substrate.workspace.writes.plan import MAX_PATCH_FILE, DirOp, Op, plan_digest
from substrate.workspace.writes.streamed import STREAM_BYTES, Streamed, hash_fd_bounded
from substrate.workspace.writes.temp_files import TEMP_PREFIX, TempFiles
from substrate.workspace.writes.upload import UploadWriter
from substrate.workspace.writes.writer import BatchWriter, Writer

__all__ = [
    "MAX_CHANGESET_BYTES",
    "MAX_CHANGE_FILE_BYTES",
    "MAX_PATCH_FILE",
    "STREAM_BYTES",
    "TEMP_PREFIX",
    "WRITE_KINDS",
    "BatchWriter",
    "Current",
    "DirChange",
    "DirOp",
    "FileChange",
    "Intent",
    "Intents",
    "Landing",
    "LinkChange",
    "Op",
    "Streamed",
    "TempFiles",
    "UploadWriter",
    "Writer",
    "drift_report",
    "hash_fd_bounded",
    "link_digest",
    "plan_digest",
]
