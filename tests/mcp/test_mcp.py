"""`substrate mcp` end to end: the SDK's stdio client spawns the server against a real
daemon (tests/harness/mcp.py). Files, writes bound to a base, refusals as tool errors,
bounded results, resources, reconnecting. Commands: tests/integration/test_mcp_engine.py.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from mcp.shared.exceptions import MCPError

from substrate.mcp.tools import TOOLS, struct_schema
from substrate.schema.fs import WriteParams
from tests.harness.daemon import daemon_env
from tests.harness.mcp import call_ok, call_refused, open_mcp

if TYPE_CHECKING:
    from tests.harness import DaemonProcess


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def checkout(module_daemon: DaemonProcess) -> tuple[Path, str]:
    """A workspace of `module_daemon` with a small tree: its path and handle."""
    files: dict[str, str | bytes] = {
        "README.md": "# demo\n\nhello\n",
        "src/main.py": "def main() -> None:\n    print('hello')\n",
        "src/util.py": "VALUE = 1\n",
    }
    path = module_daemon.make_workspace(files=files)
    return path, module_daemon.adopt(path)


async def test_tools_are_listed_with_hints_and_schemas_from_the_structs(
    module_daemon: DaemonProcess, checkout: tuple[Path, str]
) -> None:
    _, ws = checkout
    async with open_mcp(module_daemon) as session:
        listed = {tool.name: tool for tool in (await session.list_tools()).tools}
        templates = (await session.list_resource_templates()).resource_templates
    async with open_mcp(module_daemon, "--workspace", ws) as session:
        defaulted = {tool.name: tool for tool in (await session.list_tools()).tools}

    assert set(listed) == {tool.name for tool in TOOLS}
    for name in ("fs_read", "fs_stat", "fs_search", "artifact_grep", "workspace_list"):
        hints = listed[name].annotations
        assert hints is not None and hints.read_only_hint is True, name
    for name in ("fs_write", "fs_patch", "fs_delete", "proc_signal", "changes_discard"):
        hints = listed[name].annotations
        assert hints is not None, name
        assert hints.read_only_hint is False and hints.destructive_hint is True, name
    fs_write = listed["fs_write"].annotations
    assert fs_write is not None and fs_write.idempotent_hint is True  # bound to a base

    # The schema is the Struct's, as msgspec generates it (plus descriptions).
    assert listed["fs_write"].input_schema == struct_schema(WriteParams)
    assert listed["fs_write"].input_schema["required"] == ["workspace", "path", "base_sha256"]
    assert listed["fs_write"].input_schema["additionalProperties"] is False
    # With a default workspace, `workspace` may be left out.
    assert defaulted["fs_write"].input_schema["required"] == ["path", "base_sha256"]
    assert [t.uri_template for t in templates] == [
        "substrate://artifact/{artifact}{?offset,length}"
    ]


async def test_read_write_with_base_and_stale_base_refused(
    module_daemon: DaemonProcess, checkout: tuple[Path, str]
) -> None:
    path, ws = checkout
    async with open_mcp(module_daemon, "--workspace", ws) as session:
        read = await call_ok(session, "fs_read", path="README.md")
        assert read["data"] == "# demo\n\nhello\n"
        base = read["sha256"]
        assert base == sha(b"# demo\n\nhello\n")

        # A dry run shows the plan and changes nothing; its digest applies exactly it.
        plan = await call_ok(
            session, "fs_write", path="README.md", base_sha256=base, content="v2\n", dry_run=True
        )
        assert plan["applied"] is False and "+v2" in plan["diff"]
        assert (path / "README.md").read_text() == "# demo\n\nhello\n"
        done = await call_ok(
            session,
            "fs_write",
            path="README.md",
            base_sha256=base,
            content="v2\n",
            plan_digest=plan["plan_digest"],
        )
        assert done["applied"] is True and done["new_sha256"] == sha(b"v2\n")
        assert (path / "README.md").read_text() == "v2\n"

        # The same base again is stale now: a tool error naming the refusal, no write.
        refused = await call_refused(
            session, "fs_write", path="README.md", base_sha256=base, content="v3\n"
        )
        assert refused["refusal"] == "stale_base"
        assert refused["data"]["current_sha256"] == sha(b"v2\n")
        assert (path / "README.md").read_text() == "v2\n"

        # Patch and delete bind to the base the same way.
        patched = await call_ok(
            session,
            "fs_patch",
            path="src/util.py",
            base_sha256=sha(b"VALUE = 1\n"),
            edits=[{"old": "1", "new": "2"}],
        )
        assert patched["applied"] is True
        assert (path / "src/util.py").read_text() == "VALUE = 2\n"
        refused = await call_refused(
            session, "fs_delete", path="src/util.py", base_sha256=sha(b"VALUE = 1\n")
        )
        assert refused["refusal"] == "stale_base"
        await call_ok(session, "fs_delete", path="src/util.py", base_sha256=sha(b"VALUE = 2\n"))
        assert not (path / "src/util.py").exists()


async def test_search_walk_stat_and_explicit_workspace(
    module_daemon: DaemonProcess, checkout: tuple[Path, str]
) -> None:
    _, ws = checkout
    async with open_mcp(module_daemon) as session:
        found = await call_ok(session, "fs_search", workspace=ws, pattern=r"print\(")
        assert [(m["path"], m["line"]) for m in found["matches"]] == [("src/main.py", 2)]
        walked = await call_ok(session, "fs_walk", workspace=ws)
        assert {p["path"] for p in walked["paths"]} >= {"README.md", "src", "src/main.py"}
        stat = await call_ok(session, "fs_stat", workspace=ws, path="src/util.py")
        assert stat["kind"] == "file" and stat["sha256"] == sha(b"VALUE = 1\n")
        listed = await call_ok(session, "workspace_list")
        assert ws in {w["workspace"] for w in listed["workspaces"]}
        # Without --workspace there is no default: the daemon says which field is missing.
        refused = await call_refused(session, "fs_stat", path="README.md")
        assert refused["refusal"] == "invalid_params"


async def test_refusals_are_tool_errors_and_the_server_carries_on(
    module_daemon: DaemonProcess, checkout: tuple[Path, str]
) -> None:
    _, ws = checkout
    async with open_mcp(module_daemon, "--workspace", ws) as session:
        escape = await call_refused(session, "fs_read", path="../outside")
        assert escape["refusal"] in {"path_invalid", "path_escape"}
        wrong = await call_refused(session, "fs_read", path="README.md", offset="zero")
        assert wrong["refusal"] == "invalid_params"
        assert wrong["data"]["path"] == "$.offset"
        # An unknown argument, even one named like the client's own keywords.
        for name in ("method", "self", "colour"):
            odd = await call_refused(session, "fs_stat", path="README.md", **{name: 1})
            assert odd["refusal"] == "invalid_params" and odd["data"]["path"] == f"$.{name}"
        since = await call_refused(session, "proc_output", proc="p", stdout_since=-1)
        assert since["refusal"] == "invalid_params" and since["data"]["path"] == "$.stdout_since"
        missing = await call_refused(session, "artifact_read", artifact="art_nothing")
        assert missing["refusal"] == "artifact_unknown"
        proc = await call_refused(session, "proc_output", proc="proc_nothing")
        assert proc["refusal"] == "process_unknown"
        with pytest.raises(MCPError) as unknown:
            await session.read_resource("substrate://artifact/art_nothing")
        assert unknown.value.error.data["refusal"] == "artifact_unknown"
        with pytest.raises(MCPError):
            await session.read_resource("substrate://elsewhere/x")
        # Still serving.
        assert (await call_ok(session, "fs_stat", path="README.md"))["kind"] == "file"


async def test_results_are_bounded_and_say_where_the_rest_is(
    module_daemon: DaemonProcess,
) -> None:
    text = "".join(f'line {i}: "quoted" and \\ escaped\n' for i in range(2000))
    files: dict[str, str | bytes] = {"big.txt": text, "bin.dat": bytes(range(256)) * 64}
    files.update({f"many/f{i:03}.txt": "needle\n" for i in range(300)})
    ws = module_daemon.adopt(module_daemon.make_workspace(files=files))
    limit = 4096
    async with open_mcp(module_daemon, "--workspace", ws, "--max-result-bytes", str(limit)) as s:
        # Page through a text file: every answer fits, and the pages join to the file.
        got, offset = b"", 0
        while True:
            result = await s.call_tool("fs_read", {"path": "big.txt", "offset": offset})
            assert len(result.content[0].text.encode()) <= limit  # type: ignore[union-attr]
            part: dict[str, Any] = result.structured_content or {}
            chunk = part["data"].encode()
            got += chunk
            offset += len(chunk)
            if part["eof"]:
                break
            assert chunk
        assert got == text.encode()

        # Binary pages (base64) join up too.
        raw, offset = b"", 0
        while True:
            part = await call_ok(s, "fs_read", path="bin.dat", offset=offset)
            chunk = base64.b64decode(part["data"])
            raw += chunk
            offset += len(chunk)
            if part["eof"]:
                break
        assert raw == bytes(range(256)) * 64

        found = await s.call_tool("fs_search", {"pattern": "needle", "max_matches": 300})
        value: dict[str, Any] = found.structured_content or {}
        assert len(found.content[0].text.encode()) <= limit  # type: ignore[union-attr]
        assert value["truncated"] is True and 0 < len(value["matches"]) < 300
        assert "matches" in value["elided"]


async def test_link_reopens_after_the_daemon_restarts(daemon_factory: Any, tmp_path: Path) -> None:
    d: DaemonProcess = daemon_factory()
    ws_path = d.make_workspace(files={"a.txt": "a\n"})
    d.adopt(ws_path)
    async with open_mcp(d) as session:
        before = await call_ok(session, "workspace_list")
        d.restart()
        after = await call_ok(session, "workspace_list")
    assert [w["root_id"] for w in after["workspaces"]] == [
        w["root_id"] for w in before["workspaces"]
    ]


def test_no_daemon_is_a_clear_exit(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "substrate", "mcp", "--state-dir", str(tmp_path / "nothing")],
        env=daemon_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert b"cannot reach the daemon" in done.stderr
    assert done.stdout == b""


class StdioPeer:
    """`substrate mcp` on raw pipes: lines in, JSON messages out (what a host's bytes get)."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "substrate", "mcp", "--state-dir", str(daemon.state_dir)],
            env=daemon_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.buf = b""

    def send(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()

    def message(self) -> dict[str, Any]:
        """The next message, failing (not hanging) when none comes within 60 s."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + 60
        while b"\n" not in self.buf:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, "no reply from substrate mcp"
            chunk = os.read(fd, 65536)
            assert chunk, "substrate mcp closed its stdout"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        value: dict[str, Any] = json.loads(line)
        return value

    def close(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        code = self.proc.wait(timeout=60)
        self.proc.stdout.close()
        return code


def test_malformed_deep_and_invalid_lines_are_answered_and_the_server_goes_on(
    module_daemon: DaemonProcess,
) -> None:
    peer = StdioPeer(module_daemon)
    try:
        peer.send(b'{"jsonrpc": "2.0", "id": 1, "method": ')  # cut short
        first = peer.message()
        peer.send(b'{"jsonrpc": "2.0", "id": 2, "params": ' + b"[" * 5000 + b"]" * 5000 + b"}")
        deep = peer.message()
        peer.send(b'{"jsonrpc": "2.0", "id": 3}')  # JSON, but no message
        invalid = peer.message()
        peer.send(b"\xff\xfe not utf-8")
        binary = peer.message()
        initialize = {
            "jsonrpc": "2.0",
            "id": 4,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "raw", "version": "0"},
            },
        }
        peer.send(json.dumps(initialize).encode())
        served = peer.message()
    finally:
        code = peer.close()
    for reply in (first, deep, binary):
        assert reply["id"] is None and reply["error"]["code"] == -32700, reply
    assert invalid["error"]["code"] == -32600 and invalid["id"] == 3
    assert served["id"] == 4 and served["result"]["serverInfo"]["name"] == "substrate"
    assert code == 0
