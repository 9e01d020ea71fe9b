"""A profile reload against the real engine: a running command is never killed by it.

A daemon (tests/harness/daemon.py) runs `proc.start` under `tiny`; the operator edits
`tiny.toml` and reloads (the operator method, then SIGHUP). The command keeps running
and ends normally; a new command runs in a fresh sandbox verified against the new
profile; the old sandbox goes once its command ended. Every container is removed at
the end.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from substrate.config import PROJECT_ROOT
from tests.harness import wait_until
from tests.harness.engine import remove_daemon_containers

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

#: Waits (polling its own workspace, inside the sandbox) until the test says stop.
WAIT_FOR_STOP = "echo started; while [ ! -e /workspace/stop ]; do sleep 0.05; done; echo done"


@pytest.fixture
def reloading(
    daemon_factory: Callable[..., DaemonProcess],
    tmp_path: Path,
    docker_client: Any,
    tiny_image: str,
) -> Iterator[tuple[DaemonProcess, Path]]:
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    shutil.copy(PROJECT_ROOT / "profiles" / "tiny.toml", profiles / "tiny.toml")
    # A short idle period makes the idle sweep run every second.
    d = daemon_factory(profiles_dir=str(profiles), container_idle_s=4.0)
    try:
        yield d, profiles
    finally:
        d.stop()
        remove_daemon_containers(docker_client, d.state_dir)


def containers_of(docker_client: Any, state_dir: Path) -> set[str]:
    from substrate.sandbox.containers import LABEL_DAEMON, daemon_id_for

    label = f"{LABEL_DAEMON}={daemon_id_for(state_dir)}"
    return {str(c["Id"]) for c in docker_client.api.containers(all=True, filters={"label": label})}


def edit_tiny(profiles: Path, old: str, new: str) -> None:
    path = profiles / "tiny.toml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_a_running_command_survives_reloads_and_new_ones_get_the_new_profile(
    reloading: tuple[DaemonProcess, Path], docker_client: Any
) -> None:
    d, profiles = reloading
    ws_path = d.make_workspace()
    ws = d.adopt(ws_path)
    c = d.client()
    before = c.call("facts.probe", workspace=ws, profile="tiny")["container"]
    proc = c.call("proc.start", workspace=ws, profile="tiny", argv=["sh", "-c", WAIT_FOR_STOP])[
        "proc"
    ]
    wait_until(
        lambda: c.call("proc.status", proc=proc)["stdout_bytes"] > 0,
        60,
        interval=0.05,
        message="the command did not start",
    )

    edit_tiny(profiles, "pids = 128", "pids = 96")
    result = d.operator().call("profile.reload")
    assert result["changed"] == ["tiny"] and result["retired_sandboxes"] == 1
    assert c.call("proc.status", proc=proc)["state"] == "running"

    # A new command runs in a new sandbox made from the new profile.
    ran = c.call("proc.run", workspace=ws, profile="tiny", argv=["echo", "new"])
    assert ran["exit_code"] == 0 and ran["stdout"]["inline"] == "new\n"
    probe = c.call("facts.probe", workspace=ws, profile="tiny")
    assert probe["container"] != before
    observed = {f["name"]: f["value"] for f in probe["facts"]}
    assert observed["pids_limit"] == 96  # read from the new sandbox's cgroup

    # A second reload by signal, while the same command still runs.
    edit_tiny(profiles, "pids = 96", "pids = 80")
    os.kill(d.pid, signal.SIGHUP)
    wait_until(lambda: len(d.journal({"profile.reloaded"})) == 2, 30, message="no SIGHUP reload")
    assert c.call("proc.status", proc=proc)["state"] == "running"

    (ws_path / "stop").write_text("")
    done = c.call("proc.wait", proc=proc, timeout_s=60)
    assert done["exit_code"] == 0 and done["stdout"]["inline"] == "started\ndone\n"
    # The sandbox of the first profile goes once its command ended (idle sweep: ~1 s).
    wait_until(
        lambda: (
            not any(cid.startswith(before) for cid in containers_of(docker_client, d.state_dir))
        ),
        60,
        interval=0.2,
        message="the retired sandbox was not removed once idle",
    )
    reasons = [e["data"]["reason"] for e in d.journal({"container.removed"})]
    assert reasons.count("profile_changed") >= 2
    entries = d.journal({"profile.reloaded"})
    assert [e["data"]["changed"] for e in entries] == [["tiny"], ["tiny"]]
    assert entries[1]["actor"] == "operator:signal"
