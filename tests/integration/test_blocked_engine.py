"""Blocked paths named where operators and agents look, against the real engine
(docs/working-layer.md, "Journal"): the shipped `default` profile (the Debian image, a
working layer) with an operator secret `API_KEY`, a uid-1000 checkout adopted with
`write_deny = [".env"]` and `require_approval = ["deploy/**"]`.

A command that writes the secret into `.env` beside an allowed file: the journal names
`.env` (`changes.blocked`, reason and rule) in the transaction of the set's summary, and
neither the journal nor the state database's bytes hold the secret or its digest. A
pending path and a host edit meanwhile are named too, and named again (or not) by a
later `changes.apply`. `substrate exec` prints the blocked path after the output; the
MCP `proc_run` text starts with the exit code and names it, its structured content the
whole result.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from substrate.config import PROJECT_ROOT
from tests.harness import DaemonProcess
from tests.harness.daemon import daemon_env
from tests.harness.mcp import open_mcp

SCRIPT = 'printf %s "$API_KEY" > .env && echo ok > allowed.txt && echo done'
POLICY = {"write_deny": [".env"], "require_approval": ["deploy/**"]}


def cli(d: DaemonProcess) -> list[str]:
    """`substrate --state-dir <d's>`, as a person runs it."""
    return [sys.executable, "-m", "substrate", "--state-dir", str(d.state_dir)]


@pytest.fixture
def profiles(tmp_path: Path) -> Path:
    out = tmp_path / "profiles"
    out.mkdir()
    text = (PROJECT_ROOT / "profiles" / "default.toml").read_text()
    assert "secrets = {}\n" in text
    (out / "default.toml").write_text(
        text.replace("secrets = {}\n", 'secrets = { API_KEY = "api-key" }\n')
    )
    shutil.copy(PROJECT_ROOT / "profiles" / "tiny.toml", out / "tiny.toml")
    return out


@pytest.fixture
def secret() -> str:
    return "sk-blocked-" + secrets.token_hex(16)


@pytest.fixture
def d(
    engine_daemons: Callable[..., DaemonProcess],
    sandbox_image: str,
    profiles: Path,
    secret: str,
) -> DaemonProcess:
    daemon = engine_daemons(start=False, profiles_dir=str(profiles))
    done = subprocess.run(
        [*cli(daemon), "secret", "set", "api-key"],
        input=secret.encode() + b"\n",
        capture_output=True,
        env=daemon_env(),
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return daemon.start()


def adopt(d: DaemonProcess, files: dict[str, str] | None = None) -> tuple[str, Path]:
    path = d.make_workspace(
        files=files or {"README": "hi\n", "old.txt": "old\n", "deploy/keep": "x\n"}
    )
    return d.adopt(path, policy=POLICY), path


def run(d: DaemonProcess, ws: str, script: str) -> dict[str, Any]:
    with d.client(timeout=300) as c:
        result: dict[str, Any] = c.call(
            "proc.run", workspace=ws, profile="default", argv=["sh", "-c", script]
        )
    return result


def named(d: DaemonProcess, ws: str) -> dict[str, dict[str, Any]]:
    """The `changes.blocked` entries of `ws`, by workspace-relative path."""
    entries = d.journal({"changes.blocked"}, workspace=ws)
    return {e["data"]["path"].split(":", 1)[1]: e for e in entries if "path" in e["data"]}


def test_a_denied_secret_file_is_named_and_its_bytes_are_nowhere(
    d: DaemonProcess, secret: str
) -> None:
    ws, path = adopt(d)
    result = run(d, ws, SCRIPT)
    assert result["exit_code"] == 0 and result["stdout"]["inline"] == "done\n"
    changes = result["changes"]
    assert [e["path"] for e in changes["blocked"]] == [".env"]
    assert [e["path"] for e in changes["applied"]] == ["allowed.txt"]
    assert not (path / ".env").exists() and (path / "allowed.txt").read_text() == "ok\n"

    entry = named(d, ws)[".env"]
    root_id = entry["data"]["path"].split(":", 1)[0]
    assert entry["data"] == {
        "changeset": changes["changeset"],
        "generation": changes["generation"],
        "path": f"{root_id}:.env",
        "op": "create",
        "kind": "file",
        "outcome": "blocked",
        "reason": "path_denied",
        "rule": ".env",
        "plan_digest": None,
    }
    assert entry["actor"].startswith("agent:")
    # One transaction: the set's summary and its blocked entries were appended together
    # (one append: consecutive seqs, one timestamp), after the allowed file's entry.
    journal = d.journal(workspace=ws)
    summary = next(e for e in journal if e["kind"] == "changes.applied")
    assert summary["data"]["changeset"] == changes["changeset"]
    assert (entry["seq"], entry["ts"]) == (summary["seq"] + 1, summary["ts"])
    applied = [e for e in journal if e["kind"] == "changes.apply"]
    assert [e["data"]["path"] for e in applied] == [f"{root_id}:allowed.txt"]
    assert applied[0]["seq"] < summary["seq"]

    # Neither the secret nor its digest anywhere in the journal; not the secret in the
    # database (its kept set keeps the digest, beside the layer that holds the bytes).
    digest = hashlib.sha256(secret.encode()).hexdigest()
    everything = json.dumps(d.journal())
    assert secret not in everything and digest not in everything
    with d.client() as c:
        kept = c.call("changes.get", changeset=changes["changeset"])
    assert secret not in json.dumps(kept)
    d.stop()  # the WAL checkpointed into the file; both read as bytes
    db = d.state_dir / "substrate.db"
    for file in (db, db.with_name("substrate.db-wal")):
        if file.exists():
            raw = file.read_bytes()
            assert secret.encode() not in raw, file


def _marker(d: DaemonProcess, name: str) -> None:
    deadline = time.monotonic() + 120
    while not list(d.state_dir.glob(f"layers/*/upper/*/{name}")):
        assert time.monotonic() < deadline, f"the command never made {name}"
        time.sleep(0.05)


def test_pending_and_conflicting_paths_are_named_and_named_again(d: DaemonProcess) -> None:
    ws, path = adopt(d)
    with d.client(timeout=300) as c:
        started = c.call(
            "proc.start",
            workspace=ws,
            profile="default",
            argv=[
                "sh",
                "-c",
                "echo v1 > deploy/conf && echo sandbox > old.txt && touch m && sleep 60",
            ],
        )
        _marker(d, "m")
        (path / "old.txt").write_text("person\n")  # the host edits it meanwhile
        c.call("proc.signal", proc=started["proc"], signal="TERM")
        result = c.call("proc.wait", proc=started["proc"])
    changes = result["changes"]
    (pending,) = changes["pending"]
    assert pending["path"] == "deploy/conf"
    assert [e["path"] for e in changes["conflicts"]] == ["old.txt"]
    assert (path / "old.txt").read_text() == "person\n"

    first = named(d, ws)
    assert first["deploy/conf"]["data"]["outcome"] == "pending"
    assert first["deploy/conf"]["data"]["reason"] == "approval_required"
    assert first["deploy/conf"]["data"]["plan_digest"] == pending["plan_digest"]
    assert first["old.txt"]["data"]["outcome"] == "conflict"
    assert first["old.txt"]["data"]["reason"] == "host_changed"
    seqs = sorted(e["seq"] for e in first.values())
    summary = next(e for e in d.journal({"changes.applied"}, workspace=ws))
    assert seqs == list(range(summary["seq"] + 1, summary["seq"] + 1 + len(seqs)))

    # Approved, a later apply lands the pending file and names what still did not land.
    with d.operator() as op:
        op.call("approval.grant", workspace=ws, plan_digest=pending["plan_digest"])
    since = d.journal()[-1]["seq"]
    with d.client() as c:
        again = c.call("changes.apply", changeset=changes["changeset"])
    assert [e["path"] for e in again["applied"]] == ["deploy/conf"]
    assert (path / "deploy" / "conf").read_text() == "v1\n"
    later = [e for e in d.journal(workspace=ws) if e["seq"] > since]
    landed = [e["data"]["path"].split(":", 1)[1] for e in later if e["kind"] == "changes.apply"]
    assert landed == ["deploy/conf"]
    renamed = [e["data"]["path"].split(":", 1)[1] for e in later if e["kind"] == "changes.blocked"]
    assert renamed == ["old.txt"]


def test_substrate_exec_prints_the_blocked_path_after_the_output(d: DaemonProcess) -> None:
    ws, path = adopt(d)
    done = subprocess.run(
        [*cli(d), "exec", "--workspace", ws, "--", "sh", "-c", SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream: the order is what a person sees
        env=daemon_env(),
        timeout=300,
        check=False,
    )
    text = done.stdout.decode()
    assert done.returncode == 0, text
    lines = text.splitlines()
    assert lines[0] == "done"
    blocked = [line for line in lines if ".env" in line]
    assert blocked == ["substrate: blocked .env (create): path_denied, rule .env"]
    assert lines.index(blocked[0]) > 0
    assert not (path / ".env").exists()


async def test_mcp_proc_run_reads_as_text_and_keeps_the_json(d: DaemonProcess) -> None:
    ws, _ = adopt(d)
    async with open_mcp(d, "--workspace", ws) as session:
        result = await session.call_tool("proc_run", {"argv": ["sh", "-c", SCRIPT]})
    assert not result.is_error
    (block,) = result.content
    text = getattr(block, "text", "")
    lines = text.splitlines()
    assert lines[0] == "exit code 0"
    assert "done" in lines
    assert "blocked .env (create): path_denied, rule .env" in lines
    assert lines.index("blocked .env (create): path_denied, rule .env") > lines.index("done")
    value = result.structured_content
    assert value is not None and value["exit_code"] == 0
    assert [e["path"] for e in value["changes"]["blocked"]] == [".env"]
    assert value["stdout"]["inline"] == "done\n"
