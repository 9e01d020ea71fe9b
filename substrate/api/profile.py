"""Handlers of `profile.*` and `facts.probe` (docs/protocol.md §5), and the profile
reload that `profile.reload` and the daemon's SIGHUP share (`reload_profiles`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from substrate.api.base import Caller, handles
from substrate.api.proc import execution_of
from substrate.errors import ProfileInvalid
from substrate.sandbox.profiles import Profile, ProfileError, load_profile_set, replace_in_place
from substrate.schema.common import Empty
from substrate.schema.profile import (
    ProbeParams,
    ProbeResult,
    ProfileDigest,
    ProfileGetParams,
    ProfileListResult,
    ProfileReloadResult,
    ProfileSummary,
)

if TYPE_CHECKING:
    from substrate.daemon import Daemon

log = logging.getLogger("substrate.api.profile")


@handles("profile.list")
async def list_(daemon: Daemon, caller: Caller, p: Empty) -> ProfileListResult:
    profiles = execution_of(daemon).profiles
    return ProfileListResult(
        profiles=[
            ProfileSummary(name=name, description=prof.description, interactive=prof.interactive)
            for name, prof in sorted(profiles.items())
        ]
    )


@handles("profile.get")
async def get(daemon: Daemon, caller: Caller, p: ProfileGetParams) -> Profile:
    return execution_of(daemon).profile(p.name)


@handles("facts.probe")
async def probe(daemon: Daemon, caller: Caller, p: ProbeParams) -> ProbeResult:
    execution = execution_of(daemon)
    ws = daemon.workspaces.get(p.workspace)
    sandbox = await execution.containers.ensure(ws, execution.profile(p.profile))
    return ProbeResult(
        workspace=ws.id, profile=p.profile, container=sandbox.id[:12], facts=sandbox.facts
    )


@handles("profile.reload")
async def reload(daemon: Daemon, caller: Caller, p: Empty) -> ProfileReloadResult:
    return await reload_profiles(daemon, actor=caller.name)


async def reload_profiles(daemon: Daemon, *, actor: str) -> ProfileReloadResult:
    """Load the profiles directory again and put the new set in force, or refuse
    `profile_invalid` (the message names the file and key) and keep the set in force
    whole: a reload never half-applies, and a broken file never drops a profile.

    Commands already running keep their sandbox and profile; a new command of a changed
    or removed profile gets a sandbox of the new one (or `profile_unknown`), and the old
    sandbox goes once idle (`Containers.retire`). Journals `profile.reloaded` (names,
    digests, what changed) or `profile.reload_refused`. One reload at a time. Costs a
    read of every profile and seccomp file, and an engine removal per idle sandbox of a
    changed profile.
    """
    execution = execution_of(daemon)
    config = daemon.config
    async with daemon.profile_lock:
        try:
            loaded = await trio.to_thread.run_sync(
                load_profile_set, Path(config.profiles_dir), Path(config.seccomp_dir)
            )
        except ProfileError as exc:
            log.error("profile reload refused, the profiles in force stay: %s", exc)
            await trio.to_thread.run_sync(
                lambda: daemon.journal.append(
                    "profile.reload_refused", {"refusal": "profile_invalid"}, actor=actor
                )
            )
            raise ProfileInvalid(f"{exc} (the profiles in force stay as they were)") from None
        added, removed, changed = loaded.changes(daemon.profile_digests)
        replace_in_place(execution.profiles, loaded.profiles)
        daemon.profile_digests = dict(loaded.digests)
        retired = await execution.containers.retire([*removed, *changed])
        data = {
            "profiles": dict(sorted(loaded.digests.items())),
            "added": added,
            "removed": removed,
            "changed": changed,
            "retired_sandboxes": retired,
        }
        await trio.to_thread.run_sync(
            lambda: daemon.journal.append("profile.reloaded", data, actor=actor)
        )
    log.info(
        "profiles reloaded: %d in force; added %s, removed %s, changed %s; %d sandbox(es) retired",
        len(loaded.digests),
        ", ".join(added) or "none",
        ", ".join(removed) or "none",
        ", ".join(changed) or "none",
        retired,
    )
    return ProfileReloadResult(
        profiles=profile_digests(daemon),
        added=added,
        removed=removed,
        changed=changed,
        retired_sandboxes=retired,
    )


def profile_digests(daemon: Daemon) -> list[ProfileDigest]:
    """The profiles in force with their digests, by name."""
    return [ProfileDigest(name=n, digest=d) for n, d in sorted(daemon.profile_digests.items())]
