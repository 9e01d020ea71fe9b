"""The real Docker engine in tests: connecting, and removing what a test session left.

Containers a test creates carry `TEST_LABELS` (`substrate.test=1` and this session's
id); `remove_test_containers` removes those, and `substrate.test=1` containers without
a session id created during this session. Another session's are left alone (several
test sessions may share one engine).
"""

from __future__ import annotations

import calendar
import os
import time
import uuid
from pathlib import Path
from typing import Any

import docker
import docker.errors

from substrate.layer.mounts.overlay import mounted_under, unmount_under
from substrate.sandbox.containers import LABEL_DAEMON, daemon_id_for

#: Labels every container made by a test carries; `remove_test_containers` finds them.
TEST_LABELS = {"substrate.test": "1", "substrate.test.session": uuid.uuid4().hex}
SESSION_STARTED = time.time()


def connect() -> tuple[Any, str]:
    """(client, "") when an engine answers, else (None, why)."""
    try:
        client = docker.from_env()
    except docker.errors.DockerException as exc:
        return None, str(exc)
    try:
        client.ping()
    except docker.errors.DockerException as exc:
        client.close()
        return None, str(exc)
    return client, ""


def remove_daemon_containers(client: Any, state_dir: str | os.PathLike[str]) -> int:
    """Force-remove every container labelled as the daemon's of `state_dir` (what a test's
    daemon made, running or not); return how many. One list call, one remove each."""
    label = f"{LABEL_DAEMON}={daemon_id_for(state_dir)}"
    found = client.api.containers(all=True, filters={"label": label})
    for ctr in found:
        client.api.remove_container(ctr["Id"], force=True, v=True)
    return len(found)


def remove_test_containers(client: Any) -> list[str]:
    """Force-remove this session's test containers (see module doc); return short ids.

    Costs one list call and one remove per container found.
    """
    removed = []
    session = TEST_LABELS["substrate.test.session"]
    for container in client.containers.list(all=True, filters={"label": "substrate.test=1"}):
        labels = container.labels or {}
        ours = labels.get("substrate.test.session") == session
        unclaimed = "substrate.test.session" not in labels and _created_after(
            container, SESSION_STARTED
        )
        if not (ours or unclaimed):
            continue
        try:
            container.remove(force=True, v=True)
        except docker.errors.NotFound:
            continue  # gone already (auto-remove)
        removed.append(container.short_id)
    return removed


def _created_after(container: Any, started: float) -> bool:
    created = container.attrs.get("Created")
    if isinstance(created, int):  # the list endpoint's form
        return created >= int(started) - 1
    # The inspect form is RFC 3339 UTC with nanoseconds; seconds are precise enough here.
    try:
        stamp = calendar.timegm(time.strptime(str(created)[:19], "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return False
    return stamp >= int(started) - 1


def sweep_mounts(state_dir: Path) -> list[str]:
    """The mount points a test's daemon left under its state dir (working layers),
    unmounted now so nothing outlives the test; the caller fails the test when any."""
    left = [m.mount_point for m in mounted_under(str(state_dir))]
    if left:
        unmount_under(str(state_dir), keep_base=False)
    return left
