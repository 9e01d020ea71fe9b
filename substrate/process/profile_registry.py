"""The profiles in force of one daemon, and their reload (docs/protocol.md §5).

`ProfileRegistry(profiles, ...)` is built by `Execution` from the set it loaded at start;
`reload` is what `profile.reload` and the daemon's SIGHUP share. The dict `by_name` is
the one the runner and the handlers look profiles up in: a reload replaces its contents
in place (`replace_in_place`), never the dict.
"""

from __future__ import annotations

import logging
from pathlib import Path

import trio

from substrate.config import Config
from substrate.errors import ProfileInvalid
from substrate.sandbox.containers import Containers
from substrate.sandbox.profiles import (
    Profile,
    ProfileError,
    find_profile,
    load_profile_set,
    profile_digest,
    replace_in_place,
)
from substrate.schema.profile import ProfileDigest, ProfileReloadResult
from substrate.store.journal import Journal

log = logging.getLogger("substrate.process.profile_registry")


class ProfileRegistry:
    """The profiles in force, each with its `profile_digest`; reloaded whole or not at all."""

    def __init__(
        self,
        profiles: dict[str, Profile],
        *,
        config: Config,
        journal: Journal,
        containers: Containers,
    ) -> None:
        """`profiles` as loaded at start: this very dict is kept, and each reload replaces
        its contents. Raises ProfileError when a seccomp file it names cannot be read
        (its digest covers the file's bytes). Costs one read per seccomp file."""
        self._profiles_dir = Path(config.profiles_dir)
        self._seccomp_dir = Path(config.seccomp_dir)
        self._journal = journal
        self._containers = containers
        #: The profiles in force by name; replaced in place by each reload.
        self.by_name = profiles
        #: `profile_digest` of each profile in force; replaced by each reload.
        self.digests: dict[str, str] = {
            name: profile_digest(prof, self._seccomp_dir) for name, prof in profiles.items()
        }
        #: One reload at a time (SIGHUP, `profile.reload`).
        self._lock = trio.Lock()

    def find(self, name: str) -> Profile:
        """The named profile. Refuses `profile_unknown`."""
        return find_profile(self.by_name, name)

    def listing(self) -> list[ProfileDigest]:
        """The profiles in force with their digests, by name."""
        return [ProfileDigest(name=n, digest=d) for n, d in sorted(self.digests.items())]

    async def reload(self, *, actor: str) -> ProfileReloadResult:
        """Load the profiles directory again and put the new set in force, or refuse
        `profile_invalid` (the message names the file and key) and keep the set in force
        whole: a reload never half-applies, and a broken file never drops a profile.

        Commands already running keep their sandbox and profile; a new command of a
        changed or removed profile gets a sandbox of the new one (or `profile_unknown`),
        and the old sandbox goes once idle (`Containers.retire`). Journals
        `profile.reloaded` (names, digests, what changed) or `profile.reload_refused`.
        One reload at a time. Costs a read of every profile and seccomp file, and an
        engine removal per idle sandbox of a changed profile.
        """
        async with self._lock:
            try:
                loaded = await trio.to_thread.run_sync(
                    load_profile_set, self._profiles_dir, self._seccomp_dir
                )
            except ProfileError as exc:
                log.error("profile reload refused, the profiles in force stay: %s", exc)
                await trio.to_thread.run_sync(
                    lambda: self._journal.append(
                        "profile.reload_refused", {"refusal": "profile_invalid"}, actor=actor
                    )
                )
                raise ProfileInvalid(f"{exc} (the profiles in force stay as they were)") from None
            added, removed, changed = loaded.changes(self.digests)
            replace_in_place(self.by_name, loaded.profiles)
            self.digests = dict(loaded.digests)
            retired = await self._containers.retire([*removed, *changed])
            data = {
                "profiles": dict(sorted(loaded.digests.items())),
                "added": added,
                "removed": removed,
                "changed": changed,
                "retired_sandboxes": retired,
            }
            await trio.to_thread.run_sync(
                lambda: self._journal.append("profile.reloaded", data, actor=actor)
            )
        log.info(
            "profiles reloaded: %d in force; added %s, removed %s, changed %s; "
            "%d sandbox(es) retired",
            len(loaded.digests),
            ", ".join(added) or "none",
            ", ".join(removed) or "none",
            ", ".join(changed) or "none",
            retired,
        )
        return ProfileReloadResult(
            profiles=self.listing(),
            added=added,
            removed=removed,
            changed=changed,
            retired_sandboxes=retired,
        )
