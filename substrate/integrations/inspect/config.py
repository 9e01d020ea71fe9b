"""What a task may configure of the `substrate` sandbox: profile, checkout, files (docs/integrations.md).

`sandbox="substrate"` (no config) uses the daemon at `$SUBSTRATE_STATE_DIR` (else the
default state dir), the `default` profile, and an empty fresh checkout per sample.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SubstrateSandboxConfig(BaseModel, frozen=True):
    """The `substrate` sandbox's configuration: `("substrate", SubstrateSandboxConfig(...))`."""

    model_config = ConfigDict(extra="forbid")

    #: The operator profile every command of the sample runs under.
    profile: str = "default"
    #: The daemon's state dir; None: `$SUBSTRATE_STATE_DIR`, else the default state dir.
    state_dir: str | None = None
    #: A directory copied (symlinks as symlinks) into each sample's fresh checkout.
    checkout: str | None = None
    #: Files placed in the checkout before it is adopted: relative path → text.
    files: dict[str, str] = Field(default_factory=dict)
    #: Where the sample checkouts are made: one of the daemon's adopt roots (None: the
    #: first one that this process can write to).
    adopt_root: str | None = None
    #: "UID:GID" owning a checkout made by root (a root-owned checkout is refused by
    #: profiles that do not allow root); None: "1000:1000". Not used when not root.
    owner: str | None = None
