"""What a sandbox gets besides its profile's confinement: operator secrets and the
workspace's persistent home (docs/protocol.md §12, docs/environments.md).

`SandboxEnvironment` is used by `substrate.sandbox.containers`: `load_secrets` reads the
values a profile names (before a sandbox is made, so a missing one refuses
`secret_unknown` with nothing created; and again whenever `secrets_changed` says their
files changed, one lstat each, so a value set with `substrate secret set` reaches the
next command); `prepare_home` makes or finds the home bound at /home/agent.

The values end up in `Sandbox.profile.env` (`profiles.with_secrets`), which
`process.argv.exec_env` gives each exec; the container itself is created from the
loaded profile, so its configuration (`docker inspect`) never holds one.
"""

from __future__ import annotations

import logging

import trio

from substrate.errors import RuntimeUnavailable, SecretUnknown
from substrate.sandbox import profiles
from substrate.sandbox.profiles import Profile
from substrate.sandbox.spec import RunAs
from substrate.secrets import SecretStore
from substrate.workspace.homes import Home, Homes
from substrate.workspace.registry import Workspace

log = logging.getLogger("substrate.sandbox.environment")

#: `SecretStore.version` of a profile's secrets, as a sandbox remembers it.
SecretsVersion = tuple[object, ...]


class SandboxEnvironment:
    """Secrets and homes for sandboxes. Either may be None: a daemon without a secret
    store refuses a profile naming a secret (`secret_unknown`); one without homes binds
    none (`HOME` is then whatever the image has there)."""

    def __init__(
        self,
        homes: Homes | None,
        secrets: SecretStore | None,
        fs_limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self.homes = homes
        self.secrets = secrets
        self._fs_limiter = fs_limiter

    async def load_secrets(self, profile: Profile) -> tuple[Profile, SecretsVersion]:
        """(the profile with its secrets' values in `env`, their version). Refuses
        `secret_unknown` naming every secret that is not set. The version is read first:
        a change racing the read is seen by the next `secrets_changed`. Costs one lstat,
        open and read per secret (in a worker thread)."""
        if not profile.secrets:
            return profile, ()
        names = list(profile.secrets.values())
        if self.secrets is None:
            raise SecretUnknown("this daemon keeps no secrets", secrets=sorted(set(names)))
        store = self.secrets
        version = store.version(names)
        values = await trio.to_thread.run_sync(store.load, names, limiter=self._fs_limiter)
        return profiles.with_secrets(profile, values), version

    def secrets_changed(self, profile: Profile, version: SecretsVersion) -> bool:
        """Did a secret of `profile` change (set again, removed) since `version`? One
        lstat per secret, on the event loop (metadata of the daemon's own directory)."""
        if not profile.secrets or self.secrets is None:
            return False
        return self.secrets.version(profile.secrets.values()) != version

    async def prepare_home(self, ws: Workspace, who: RunAs) -> Home | None:
        """The workspace's persistent home for `who`, made if missing (`Homes.prepare`).
        Refuses `runtime_unavailable` when it cannot be made (the log says why)."""
        if self.homes is None:
            return None
        try:
            return await trio.to_thread.run_sync(
                self.homes.prepare, ws.dev_ino, who.uid, who.gid, limiter=self._fs_limiter
            )
        except OSError as exc:
            # The reason names a host path: the log has it, the client does not.
            log.error("workspace %s: its home cannot be prepared: %s", ws.id, exc)
            raise RuntimeUnavailable(
                "the workspace's persistent home cannot be prepared (see the log)"
            ) from None
