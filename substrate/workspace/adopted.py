"""One adopted workspace: its root held as a dir fd, who is using that fd, its policy.

The daemon reaches a workspace's files only through `Workspace.root_fd`. A release must
never close that fd under an operation using it (the number would be reused by the next
`open`), so every user holds it with `Workspace.use()`; `FdUsers` counts them and makes
the release wait, or leaves the close to the last of them.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from substrate.errors import UnknownWorkspace
from substrate.fs import paths
from substrate.schema.workspace import WorkspaceInfo
from substrate.workspace.policy import CompiledPolicy
from substrate.workspace.vcs import read_vcs


class FdUsers:
    """The operations using a workspace's root fd, so that release never closes it under one.

    The fd number is reused by the next `open` once closed: a read still holding it would
    then reach whatever file got that number. So each user enters this (one context
    manager shared by all of them); `drain` refuses new ones (`unknown_workspace`) and
    waits, bounded, for the count to reach zero; `close` closes the fd then, or leaves it
    to whichever user leaves last.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._count = 0
        self._closing: int | None = None
        self._closed = False

    def __enter__(self) -> None:
        with self._cond:
            if self._closed:
                raise UnknownWorkspace("the workspace was released")
            self._count += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._count -= 1
            if self._count == 0:
                self._cond.notify_all()
                if self._closing is not None:
                    os.close(self._closing)
                    self._closing = None

    def drain(self, timeout: float) -> bool:
        """Refuse new users from now on; wait up to `timeout` s for the current ones.

        Returns whether none is left.
        """
        with self._cond:
            self._closed = True
            return self._cond.wait_for(lambda: self._count == 0, timeout)

    def close(self, fd: int) -> None:
        """Close `fd` now if no user is left, else when the last one leaves."""
        with self._cond:
            self._closed = True
            if self._count == 0:
                os.close(fd)
            else:
                self._closing = fd


@dataclass
class Workspace:
    """One adopted checkout. `host_path` is internal: never put it in a result."""

    id: str
    root_id: str
    host_path: str
    root_fd: int
    policy: CompiledPolicy
    owner_uid: int
    owner_gid: int
    adopted: float
    dev_ino: tuple[int, int]
    #: The checkout's identity (`CheckoutId.key`): what its remembered policy, homes and
    #: change sets are kept by, and what a persisted workspace must still match.
    checkout: str
    #: The root's resolved host path (internal): how nested checkouts are found.
    checkout_path: str
    #: Serialises the check-then-rename of guarded writes in this workspace.
    commit_lock: threading.Lock = field(default_factory=threading.Lock)
    #: Who is using `root_fd` now; reads and writes hold it (`use`) while they do.
    fd_users: FdUsers = field(default_factory=FdUsers)

    def use(self) -> FdUsers:
        """`with ws.use():` holds `root_fd` open for the block; refuses `unknown_workspace`
        once the workspace is released."""
        return self.fd_users

    def check_dir(self, parts: tuple[str, ...], where: str) -> None:
        """Refuse unless `parts` names a directory beneath the root, reached as every path
        is (`paths.open_dir`: no symlink, no escape); holds the root fd while it looks.
        Blocking (one open per component at most)."""
        with self.use():
            os.close(paths.open_dir(self.root_fd, parts, where))

    def provenance(self, rel: str) -> str:
        """How a path of this workspace is named in results and the journal."""
        return f"{self.root_id}:{rel}"

    def info(self) -> WorkspaceInfo:
        """`workspace.info`: ids, VCS state and the effective policy. Holds the root fd
        while it reads `.git`; refuses `unknown_workspace` once released. Costs a few
        small reads."""
        with self.use():
            vcs = read_vcs(self.root_fd)
        return WorkspaceInfo(
            workspace=self.id,
            root_id=self.root_id,
            vcs=vcs,
            policy=self.policy.policy,
            adopted=self.adopted,
        )
