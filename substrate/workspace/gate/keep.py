"""The kept bytes of denied files: a private content-addressed store under the state dir.

`<state_dir>/gate/<workspace>/<sha256>`, the directory 0700 and every file 0600: never
in the journal, the logs or a result. What `before` keeps here is what a revert puts
back; blobs no snapshot refers to are removed (`collect`).

A blob is written atomically (temp file, rename) but not fsynced: it is worth nothing
after a crash, when the baseline that refers to it (held in memory) is gone too.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

from substrate.fs import fsops

#: Denied files larger than this are hashed but not kept: a change to one is reported
#: with `reverted: false` (a creation is still removed).
MAX_KEPT_FILE = 64 << 20
#: Total bytes kept per workspace snapshot; past it, further files are only hashed.
MAX_KEPT_TOTAL = 512 << 20


class Keep:
    """Content-addressed bytes of denied files for one workspace (0700 dir, 0600 files).

    Blocking; used under the gate's per-workspace lock, never concurrently.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(root, 0o700)

    def has(self, sha: str) -> bool:
        return (self.root / sha).is_file()

    def put(self, sha: str, data: bytes) -> None:
        """Keep `data` under its digest `sha` (nothing to do when it is kept already)."""
        if self.has(sha):
            return
        fd = os.open(self.root, fsops.DIR_FLAGS)
        try:
            fsops.atomic_write(fd, sha, data, mode=0o600, fsync=False)
        finally:
            os.close(fd)

    def get(self, sha: str) -> bytes:
        """The kept bytes of `sha`; OSError when they are missing or damaged."""
        data = (self.root / sha).read_bytes()
        if hashlib.sha256(data).hexdigest() != sha:
            raise OSError(f"kept copy {sha[:12]} is damaged")
        return data

    def collect(self, keep: set[str]) -> None:
        """Remove every stored blob not in `keep` (and stray temp files)."""
        for name in os.listdir(self.root):
            if name not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.root / name)
