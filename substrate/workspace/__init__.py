"""Workspaces: adopted checkouts held as directory fds, their policy, bounded reads,
guarded writes, and the write gate for sandboxed code.

Where things are: `registry` adopts and releases (`adopted`: one workspace and the guard
of its root fd; `checkouts`: the policies remembered per checkout; `vcs`: git state read
as plain files); `policy` is the glob language (matched by `substrate.matching`); paths
beneath the root fd are resolved and changed with `substrate.fs` (`paths`, `fsops`);
`reads`, `search` and `digests` answer `fs.stat/read/list/walk/search` (docs/protocol.md §3;
`search_pool` shares a search's files with a worker process, `search_worker`);
`writes` is the guarded-write package (docs/protocol.md §4: plan, base check, temp files,
intents, batches, uploads' commit, recovery) with `patching` and `preview`, and every write
asks `discoverable` what host tools would find; `checkpoints` keeps what they replace while
a checkpoint is live and `restore` puts it back; `gate` checks what sandboxed code changed
(docs/protocol.md §5). The working layer's change sets, applied through the guarded path,
are `substrate.layer.changes`.
"""

from substrate.workspace.adopted import Workspace
from substrate.workspace.checkpoints import Checkpoints
from substrate.workspace.digests import Digests
from substrate.workspace.gate import SnapshotGate
from substrate.workspace.policy import CompiledPolicy, compile_policy, is_git_path
from substrate.workspace.registry import WorkspaceRegistry
from substrate.workspace.writes import TEMP_PREFIX, TempFiles, Writer, drift_report

__all__ = [
    "TEMP_PREFIX",
    "Checkpoints",
    "CompiledPolicy",
    "Digests",
    "SnapshotGate",
    "TempFiles",
    "Workspace",
    "WorkspaceRegistry",
    "Writer",
    "compile_policy",
    "drift_report",
    "is_git_path",
]
