"""Restart recovery: a daemon killed with SIGKILL while 5 processes run, restarted.

Nothing may leak: no container with its labels, no record still `running` (they are
`lost`, journalled `proc.lost`), artifact files and rows agree, the journal verifies,
and a reconnecting client reads what was recorded (status, wait, subscribe replay).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from substrate.sandbox.containers import LABEL_DAEMON, daemon_id_for
from tests.harness import wait_until

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

LOOP = "echo started; while true; do echo tick; sleep 0.1; done"


def labelled(docker_client: Any, daemon_id: str) -> list[str]:
    found = docker_client.api.containers(all=True, filters={"label": f"{LABEL_DAEMON}={daemon_id}"})
    return [str(c["Id"]) for c in found]


def artifact_files(root: Any) -> set[str]:
    out = set()
    for top in os.listdir(root):
        if len(top) == 2 and os.path.isdir(root / top):
            out.update(os.listdir(root / top))
    return out


def test_kill_9_with_five_running_leaks_nothing(
    daemon_factory: Callable[..., DaemonProcess], docker_client: Any, tiny_image: str
) -> None:
    d = daemon_factory()
    daemon_id = daemon_id_for(d.state_dir)
    try:
        ws = d.adopt(d.make_workspace())
        c = d.client()
        procs = [
            c.call("proc.start", workspace=ws, profile="tiny", argv=["sh", "-c", LOOP])["proc"]
            for _ in range(5)
        ]
        wait_until(
            lambda: all(c.call("proc.status", proc=p)["stdout_bytes"] > 0 for p in procs),
            60,
            interval=0.1,
            message="processes produced no output",
        )
        assert labelled(docker_client, daemon_id)

        d.kill()
        d.start()

        wait_until(
            lambda: not labelled(docker_client, daemon_id),
            60,
            interval=0.2,
            message="the dead daemon's containers were not reaped",
        )

        c = d.client()
        for p in procs:
            status = c.call("proc.status", proc=p)
            assert status["state"] == "lost"
            assert status["stdout_bytes"] >= len("started\n")
            assert c.call("proc.wait", proc=p) == {"proc": p, "state": "lost"}
        listed = {p["proc"]: p["state"] for p in c.call("proc.list")["processes"]}
        assert all(listed[p] == "lost" for p in procs)

        lost = {e["data"]["proc"] for e in d.journal({"proc.lost"})}
        assert set(procs) <= lost
        assert d.verify_journal()["ok"] is True

        # What the dead daemon spooled is readable: replayed to a new subscriber.
        c.call("proc.subscribe", proc=procs[0])
        got = b""
        while True:
            message = c.notifications.pop(0) if c.notifications else c.read_message()
            if message["method"] == "proc.exit":
                assert message["params"] == {"proc": procs[0], "state": "lost"}
                break
            if message["params"]["stream"] == "stdout":
                got += message["params"]["data"].encode()
        assert got.startswith(b"started\n")

        # Files and rows agree; no spool is left (nothing runs).
        root = d.state_dir / "artifacts"
        db = sqlite3.connect(f"file:{d.state_dir / 'substrate.db'}?mode=ro", uri=True)
        try:
            rows = db.execute("SELECT sha256, proc, lost FROM artifacts").fetchall()
            running = db.execute("SELECT count(*) FROM processes WHERE state = 'running'")
            assert running.fetchone()[0] == 0
        finally:
            db.close()
        assert {r[0] for r in rows} == artifact_files(root)
        assert {r[1] for r in rows if r[2]} >= set(procs)
        assert os.listdir(root / "spool") == []
    finally:
        d.close()
        for ident in labelled(docker_client, daemon_id):
            docker_client.api.remove_container(ident, force=True, v=True)
