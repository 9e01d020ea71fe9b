"""What substrate wrote against what the checkout holds now: `drift_report`, behind
`journal.replay` and `substrate journal replay` (docs/protocol.md §8). Read-only: the
journal of one workspace and one streamed hash per file it names.
"""

from __future__ import annotations

import os

from substrate.errors import NotFound
from substrate.fs import paths
from substrate.store.journal import Journal
from substrate.workspace.adopted import Workspace
from substrate.workspace.digests import hash_fd

#: The journal kinds that change a file: every guarded write's, one file or a batch.
WRITE_KINDS = (
    "fs.write",
    "fs.patch",
    "fs.delete",
    "fs.upload",
    "changes.apply",
    "workspace.restore_file",
)


def drift_report(
    ws: Workspace, journal: Journal
) -> list[tuple[str, int, str | None, str | None, str]]:
    """For every file substrate wrote in `ws`: (path, last seq, last digest, current, status).

    Status is `match`, `drift` (other bytes now, or present after our delete), `missing`
    (we wrote it, it is gone) or `unreadable` (a symlink or non-file stands there now).
    Costs one pass over the journal of this workspace and one hash per file.
    """
    last: dict[str, tuple[int, str | None]] = {}
    since = 0
    while True:
        batch = journal.read(since=since, limit=5000, workspace=ws.id, kinds=WRITE_KINDS)
        if not batch:
            break
        for entry in batch:
            last[str(entry.data["path"])] = (entry.seq, entry.data.get("new_sha256"))
        since = batch[-1].seq
    prefix = ws.root_id + ":"
    report: list[tuple[str, int, str | None, str | None, str]] = []
    with ws.use():
        for path in sorted(last):
            seq, digest = last[path]
            rel = path[len(prefix) :] if path.startswith(prefix) else path
            try:
                parts = paths.split_relpath(rel)
                with paths.opened_dir(ws.root_fd, parts[:-1], path) as parent:
                    fd = paths.open_regular(parent, parts[-1], path)
                try:  # hashed as a stream: an uploaded file may be large
                    current = hash_fd(fd)
                finally:
                    os.close(fd)
            except NotFound:
                current = None
            except Exception:
                report.append((path, seq, digest, None, "unreadable"))
                continue
            if current == digest:
                status = "match"
            elif current is None:
                status = "missing"
            else:
                status = "drift"
            report.append((path, seq, digest, current, status))
    return report
