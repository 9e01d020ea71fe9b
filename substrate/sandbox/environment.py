"""What a sandbox gets besides its profile's confinement: operator secrets and the
workspace's persistent home (docs/protocol.md §12, docs/environments.md).

`SandboxEnvironment` is used by `substrate.sandbox.containers`: `load_secrets` reads the
values a profile names (before a sandbox is made, so a missing one refuses
`secret_unknown` with nothing created; and again whenever `secrets_changed` says their
files changed, one lstat each, so a value set with `substrate secret set` reaches the
next command); `prepare_home` makes or finds the home bound at /home/agent: the one of
the workspace's checkout for the uid that runs and the profile's *secret set*
(`homes.secret_set`), so a profile holding secrets never runs code, or leaves data, in a
home that a profile without them (or with others) can write or read; `check_home`
refuses a command while its home is over `home_quota_bytes`.

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
from substrate.workspace.homes import Home, Homes, secret_set
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

    async def prepare_home(self, ws: Workspace, who: RunAs, profile: Profile) -> Home | None:
        """The workspace's persistent home for `who` and `profile`'s secret set, made if
        missing (`Homes.prepare`). Refuses `runtime_unavailable` when it cannot be made
        (the log says why)."""
        if self.homes is None:
            return None
        secrets = secret_set(profile.secrets)
        try:
            return await trio.to_thread.run_sync(
                self.homes.prepare,
                ws.checkout,
                who.uid,
                who.gid,
                secrets,
                limiter=self._fs_limiter,
            )
        except OSError as exc:
            # The reason names a host path: the log has it, the client does not.
            log.error("workspace %s: its home cannot be prepared: %s", ws.id, exc)
            raise RuntimeUnavailable(
                "the workspace's persistent home cannot be prepared (see the log)"
            ) from None

    async def check_home(self, home: Home | None) -> None:
        """Before a command or terminal in a sandbox with `home`: refuses `limit_exceeded`
        (`scope: "home"`) while the home is over its quota (`HomeQuota.check`: a bounded
        walk when one is due, in a worker thread, or on the event loop for a small home:
        `HomeQuota.check_here`; else a lookup)."""
        if self.homes is None or home is None:
            return
        quota = self.homes.quota
        if quota.check_here(home.checkout, home.name):  # the last figure, or a small walk
            return
        await trio.to_thread.run_sync(
            quota.check, home.checkout, home.name, limiter=self._fs_limiter
        )
