"""Every entry of the daemon's state dir, named once (docs/architecture.md "State").

The state dir (`state_dir`, 0700, or 0710 with `agent_socket_group`) holds the sockets,
the database and one directory per owner. Only the entries directly in it are named here;
what each directory holds is its owner's layout (`artifacts/spool/`, `homes/<checkout>/`,
`layers/<sandbox>/`, ...), documented with the owner. Code that works beneath the state
dir's fd takes an entry's name from `ENTRIES`. Pure: joins names, touches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class StatePaths:
    """The paths of one state dir, `root`, one property per entry."""

    root: Path

    @property
    def agent_socket(self) -> Path:
        """`substrate.sock`: the agent socket (0660; docs/protocol.md §1)."""
        return self.root / "substrate.sock"

    @property
    def operator_socket(self) -> Path:
        """`operator.sock`: the operator socket (0600; docs/protocol.md §1)."""
        return self.root / "operator.sock"

    @property
    def database(self) -> Path:
        """`substrate.db`: the SQLite database and journal (WAL: `-wal`, `-shm` beside it)."""
        return self.root / "substrate.db"

    @property
    def secrets(self) -> Path:
        """`secrets/`: operator secrets, one 0600 file each (`secrets.store`)."""
        return self.root / "secrets"

    @property
    def homes(self) -> Path:
        """`homes/`: the persistent homes per checkout, uid and secret set (`workspace.homes`)."""
        return self.root / "homes"

    @property
    def preimages(self) -> Path:
        """`preimages/`: bytes writes replaced under a live checkpoint (`workspace.checkpoints`)."""
        return self.root / "preimages"

    @property
    def uploads(self) -> Path:
        """`uploads/`: chunked uploads' spools, emptied at every start (`workspace.uploads`)."""
        return self.root / "uploads"

    @property
    def gate(self) -> Path:
        """`gate/`: the write gate's kept bytes of denied files (`workspace.gate.keep`)."""
        return self.root / "gate"

    @property
    def artifacts(self) -> Path:
        """`artifacts/`: command output, spooled and content-addressed (`artifacts.store`)."""
        return self.root / "artifacts"

    @property
    def sandbox_files(self) -> Path:
        """`sandbox-files/`: files bound into sandboxes (the empty resolv.conf, CA bundles)."""
        return self.root / "sandbox-files"

    @property
    def supervisor(self) -> Path:
        """`supervisor/`: each sandbox's fast-exec supervisor directory (docs/fast-exec.md)."""
        return self.root / "supervisor"

    @property
    def gitlayers(self) -> Path:
        """`gitlayers/`: each checkout's git layer, its sandboxes' writable `.git`
        (docs/working-layer.md, "The git layer")."""
        return self.root / "gitlayers"

    @property
    def layers(self) -> Path:
        """`layers/`: the working layers, a directory per sandbox (docs/working-layer.md,
        "Layout and what a generation mounts")."""
        return self.root / "layers"


#: Each entry relative to the state dir (`ENTRIES.layers.name == "layers"`), for code
#: that works beneath the state dir's fd or joins strings.
ENTRIES = StatePaths(Path())
