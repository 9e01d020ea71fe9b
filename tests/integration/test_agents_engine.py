"""The real agent CLIs in the sandbox (docs/agent-provider.md): Claude Code and Codex,
installed into the workspace's persistent home by the `setup` profile from the npm
registry (through the egress proxy), each running a turn with `substrate agent run`
against the scripted model server (tests/agents/scripted_model.py) started in the same
sandbox on its loopback.

What must hold, per CLI: its own tool calls (Claude Code's Write and Bash; Codex's patch
and shell tools) change files in the working layer; the gate applies the allowed path
only — a path outside `allowed_paths` and one the policy denies stay out of the
checkout; the envelopes stream live from the CLI's JSON lines; the journal names the
tools and paths (`agent.tool`, `agent.turn`) and holds neither the prompt, the model key
nor the file bytes; a second turn resumes the session from the home after a daemon
restart.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from substrate.config import PROJECT_ROOT
from tests.harness import DaemonProcess, daemon_env
from tests.harness.engine import TEST_LABELS

SHIPPED = PROJECT_ROOT / "profiles"
SCRIPTED = Path(__file__).parent.parent / "agents" / "scripted_model.py"
CLAUDE = "@anthropic-ai/claude-code@2.1.332"
CODEX = "@openai/codex@0.171.0"
PORT = 18091
IMAGE = f"substrate-agents-test:{TEST_LABELS['substrate.test.session'][:12]}"
POLICY = {"write_deny": [".env"]}
MARK = "prompt-marker-" + secrets.token_hex(6)
#: The test profiles' model key (the shipped profiles have the proxy inject the real one).
KEY = "sk-test-" + secrets.token_hex(16)


def offline_profile(shipped: str, **changes: str) -> str:
    """A shipped agent profile made the test's: no network (the model server is on the
    sandbox's loopback), the scripted server's interpreter allowed too."""
    text = (SHIPPED / f"{shipped}.toml").read_text()
    for old, new in changes.items():
        assert old in text, old
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="module")
def agents_image(docker_client: Any, sandbox_image: str) -> Iterator[str]:
    """The sandbox image (node and npm in it), under a tag of this module's own: the
    shipped tag may be rebuilt by another test session meanwhile."""
    image = docker_client.images.get(sandbox_image)
    image.tag(IMAGE.split(":")[0], IMAGE.split(":")[1])
    try:
        yield IMAGE
    finally:
        docker_client.images.remove(IMAGE, force=True)  # the tag only: the image stays


@pytest.fixture
def make_daemon(
    engine_daemons: Callable[..., DaemonProcess], agents_image: str, tmp_path: Path
) -> Callable[[], DaemonProcess]:
    def make() -> DaemonProcess:
        profiles = tmp_path / "profiles"
        profiles.mkdir()
        image = 'image = "substrate-sandbox:bookworm"'
        for name in ("default", "setup"):
            text = (SHIPPED / f"{name}.toml").read_text()
            (profiles / f"{name}.toml").write_text(text.replace(image, f'image = "{agents_image}"'))
        offline = {
            image: f'image = "{agents_image}"',
            'network = "egress"': 'network = "none"',
            'ca_bundle = "host"': 'ca_bundle = ""',
            "timeout_s = 1800": "timeout_s = 300",
        }
        (profiles / "claude-test.toml").write_text(
            offline_profile(
                "claude-code",
                **offline,
                **{
                    'egress_allow = ["api.anthropic.com"]': "egress_allow = []",
                    'egress_inject = { "api.anthropic.com" = { header = "x-api-key", secret = "anthropic" } }': "egress_inject = {}",
                    'argv_allow = ["claude"]': 'argv_allow = ["claude", "python3"]',
                    'ANTHROPIC_API_KEY = "set-by-the-egress-proxy"': f'ANTHROPIC_API_KEY = "{KEY}", ANTHROPIC_BASE_URL = "http://127.0.0.1:{PORT}"',
                },
            )
        )
        (profiles / "codex-test.toml").write_text(
            offline_profile(
                "codex",
                **offline,
                **{
                    'egress_allow = ["api.openai.com"]': "egress_allow = []",
                    'egress_inject = { "api.openai.com" = { header = "authorization", secret = "openai" } }': "egress_inject = {}",
                    'argv_allow = ["codex"]': 'argv_allow = ["codex", "python3"]',
                    'OPENAI_API_KEY = "set-by-the-egress-proxy"': f'OPENAI_API_KEY = "{KEY}", OPENAI_BASE_URL = "http://127.0.0.1:{PORT}/v1"',
                },
            )
        )
        return engine_daemons(start=False, profiles_dir=str(profiles))

    return make


def install(d: DaemonProcess, ws: str, package: str, program: str, profile: str) -> None:
    """`npm install -g` into the home, with `setup` (egress to the npm registry only)."""
    c = d.client(timeout=900)
    done = c.call(
        "proc.run", workspace=ws, profile="setup", argv=["npm", "install", "-g", package],
        timeout_s=600,
    )  # fmt: skip
    assert done["exit_code"] == 0, done["stderr"]
    version = c.call("proc.run", workspace=ws, profile=profile, argv=[program, "--version"])
    assert version["exit_code"] == 0, version["stderr"]


def start_model(d: DaemonProcess, ws: str, profile: str, script: str, exit_after: float = 3) -> str:
    """The scripted server, in the turn's sandbox; returns its proc once it listens."""
    c = d.client(timeout=120)
    gone = "import os; p = '/tmp/model.port'; os.path.exists(p) and os.remove(p)"
    c.call(
        "proc.run", workspace=ws, profile=profile, changes="discard", argv=["python3", "-c", gone]
    )
    argv = ["python3", "tools/scripted_model.py", "--port", str(PORT), "--script", script,
            "--log", "/tmp/model.jsonl", "--port-file", "/tmp/model.port", "--exit-after", str(exit_after)]  # fmt: skip
    proc = str(c.call("proc.start", workspace=ws, profile=profile, argv=argv)["proc"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        probe = c.call(
            "proc.run", workspace=ws, profile=profile, changes="discard",
            argv=["python3", "-c", "import os,sys; sys.exit(0 if os.path.exists('/tmp/model.port') else 1)"],
        )  # fmt: skip
        if probe["exit_code"] == 0:
            return proc
        time.sleep(0.2)
    raise AssertionError("the scripted model server never listened")


def agent_run(
    d: DaemonProcess, ws: str, provider: str, profile: str, prompt: str, *extra: str
) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    """`substrate agent run --json`: (exit code, envelopes, the turn's record)."""
    done = subprocess.run(
        [sys.executable, "-m", "substrate", "--state-dir", str(d.state_dir), "agent", "run",
         "--provider", provider, "--workspace", ws, "--profile", profile, "--prompt", prompt,
         "--allow-path", "src/**", "--json", *extra],
        capture_output=True, env=daemon_env(), timeout=600, check=False,
    )  # fmt: skip
    lines = [json.loads(line) for line in done.stdout.decode().splitlines() if line.strip()]
    assert lines and "turn" in lines[-1], done.stderr.decode()[-2000:]
    return done.returncode, lines[:-1], lines[-1]["turn"]


def model_log(d: DaemonProcess, ws: str, profile: str) -> list[dict[str, Any]]:
    c = d.client()
    out = c.call(
        "proc.run",
        workspace=ws,
        profile=profile,
        argv=["python3", "-c", "print(open('/tmp/model.jsonl').read())"],
        changes="discard",
    )
    return [json.loads(line) for line in out["stdout"]["inline"].splitlines() if line.strip()]


def journal_entries(d: DaemonProcess, kind: str) -> list[dict[str, Any]]:
    out = d.operator().call("journal.read", since=0, limit=10000)
    return [e for e in out["entries"] if e["kind"] == kind]


def check_journal(d: DaemonProcess, key: str, file_bytes: bytes) -> None:
    """The journal holds neither the key, the prompt nor a file's bytes; the state
    database (whose kept sets hold review previews of the files) neither key nor prompt."""
    entries = json.dumps(d.operator().call("journal.read", since=0, limit=10000)["entries"])
    for needle in (key, MARK, file_bytes.decode()):
        assert needle not in entries
    raw = b"".join(p.read_bytes() for p in d.state_dir.glob("substrate.db*"))
    assert key.encode() not in raw and MARK.encode() not in raw


def workspace(d: DaemonProcess, steps: dict[str, list[dict[str, Any]]]) -> tuple[Any, str]:
    files: dict[str, str | bytes] = {
        "README.md": "# demo\n",
        "src/app.py": "VALUE = 0\n",
        "src/__init__.py": "",
        "tools/scripted_model.py": SCRIPTED.read_bytes(),
    }
    for name, script in steps.items():
        files[f"tools/{name}"] = json.dumps(script)
    path = d.make_workspace(files=files)
    ws = d.adopt(path)
    d.operator().call("workspace.set_policy", workspace=ws, policy=POLICY)
    return path, ws


def test_claude_code_turns_in_the_sandbox(make_daemon: Callable[[], DaemonProcess]) -> None:
    d = make_daemon()
    d.start()
    secret_bytes = b"TOKEN=" + secrets.token_hex(8).encode()
    turn1 = [
        {"tool": "Write", "input": {"file_path": "/workspace/src/greeting.py", "content": "GREETING = 'hi'\n"}},
        {"tool": "Write", "input": {"file_path": "/workspace/.env", "content": secret_bytes.decode()}},
        {"tool": "Write", "input": {"file_path": "/workspace/docs/notes.md", "content": "# notes\n"}},
        {"tool": "Bash", "input": {"command": "cat src/greeting.py", "description": "show it"}},
        {"tool": "Read", "input": {"file_path": "/workspace/src/app.py"}},
        {"tool": "Edit", "input": {"file_path": "/workspace/src/app.py", "old_string": "VALUE = 0", "new_string": "VALUE = 1"}},
        {"text": "Added a greeting."},
    ]  # fmt: skip
    turn2 = [
        {"tool": "Write", "input": {"file_path": "/workspace/src/farewell.py", "content": "BYE = 1\n"}},
        {"text": "Added a farewell."},
    ]  # fmt: skip
    hang = [{"hang": True}]
    path, ws = workspace(d, {"turn1.json": turn1, "turn2.json": turn2, "hang.json": hang})
    install(d, ws, CLAUDE, "claude", "claude-test")

    start_model(d, ws, "claude-test", "tools/turn1.json")
    code, envelopes, record = agent_run(
        d, ws, "claude-code", "claude-test", f"{MARK}: add a greeting",
        "--allow-tool", "Bash(cat:*)",
    )  # fmt: skip
    assert code == 0, envelopes
    calls = [(e["tool"], e.get("paths", [])) for e in envelopes if e["kind"] == "tool_call"]
    assert calls == [
        ("Write", ["src/greeting.py"]), ("Write", [".env"]), ("Write", ["docs/notes.md"]),
        ("Bash", []), ("Read", ["src/app.py"]), ("Edit", ["src/app.py"]),
    ]  # fmt: skip
    assert [e["text"] for e in envelopes if e["kind"] == "text"] == ["Added a greeting."]
    assert record["session"] and record["tool_calls"] == 6
    # The gate: the allowed path applied; the rest waits for a person, none in the checkout.
    assert sorted(record["applied"]) == ["src/app.py", "src/greeting.py"]
    assert sorted(record["left"]) == [".env", "docs", "docs/notes.md"]  # the dir, too
    assert (path / "src/greeting.py").read_text() == "GREETING = 'hi'\n"
    assert (path / "src/app.py").read_text() == "VALUE = 1\n"  # the CLI's Edit tool
    assert not (path / ".env").exists() and not (path / "docs").exists()
    # The CLI's Bash tool really ran in the sandbox: the model got its result back.
    log = model_log(d, ws, "claude-test")
    assert [len(r["tool_results"]) for r in log if r["tools"]][:7] == [0, 1, 2, 3, 4, 5, 6]
    tools = journal_entries(d, "agent.tool")
    assert [(t["data"]["tool"], t["data"]["paths"]) for t in tools] == calls
    (turn_entry,) = journal_entries(d, "agent.turn")
    assert turn_entry["data"]["session"] == record["session"]
    check_journal(d, KEY, secret_bytes)

    # Turn 2, after a restart: the session is in the home, and the CLI resumes it.
    d.stop()
    d.start()
    start_model(d, ws, "claude-test", "tools/turn2.json")
    code, envelopes, record2 = agent_run(
        d, ws, "claude-code", "claude-test", "add a farewell", "--resume", record["session"]
    )
    assert code == 0, envelopes
    assert record2["applied"] == ["src/farewell.py"]
    first = next(r for r in model_log(d, ws, "claude-test") if r["tools"])
    assert len(first["tool_results"]) == 6  # turn 1's history came back with the session
    check_journal(d, KEY, secret_bytes)

    # A model that never answers, and a prompt of 1 MB: the turn's timeout kills the
    # CLI, its record finishes with the reason, nothing of the prompt is kept.
    start_model(d, ws, "claude-test", "tools/hang.json", exit_after=60)
    c = d.client(timeout=300)
    big = MARK + " " + "p" * 1_000_000
    turn = c.call(
        "agent.start", workspace=ws, provider="claude-code", profile="claude-test",
        prompt=big, timeout_s=20,
    )  # fmt: skip
    hung = c.call("agent.wait", turn=turn["turn"], timeout_s=240)
    assert hung["state"] == "finished" and hung["timed_out"] is True
    assert hung["errors"].get("timed_out") == 1
    assert hung["errors"].get("exited_mid_stream") == 1
    check_journal(d, KEY, secret_bytes)


def test_codex_turns_in_the_sandbox(make_daemon: Callable[[], DaemonProcess]) -> None:
    d = make_daemon()
    d.start()

    def patch(path: str, body: str) -> dict[str, Any]:
        text = f"*** Begin Patch\n*** Add File: {path}\n+{body}\n*** End Patch\n"
        return {
            "custom": "exec",
            "input": f"text(JSON.stringify(await tools.apply_patch({json.dumps(text)})));",
        }

    shell = {
        "custom": "exec",
        "input": 'text(JSON.stringify(await tools.exec_command({cmd: "cat src/y.py"})));',
    }
    turn1 = [patch("src/y.py", "y = 2"), patch("docs/x.md", "# x"), shell, {"text": "Made y."}]
    turn2 = [patch("src/z.py", "z = 3"), {"text": "Made z."}]
    path, ws = workspace(d, {"turn1.json": turn1, "turn2.json": turn2})
    install(d, ws, CODEX, "codex", "codex-test")

    start_model(d, ws, "codex-test", "tools/turn1.json")
    code, envelopes, record = agent_run(d, ws, "codex", "codex-test", f"{MARK}: make y")
    assert code == 0, envelopes
    calls = [(e["tool"], e.get("paths", [])) for e in envelopes if e["kind"] == "tool_call"]
    assert calls == [("apply_patch", ["src/y.py"]), ("apply_patch", ["docs/x.md"]), ("shell", [])]
    assert record["applied"] == ["src/y.py"] and sorted(record["left"]) == ["docs", "docs/x.md"]
    assert (path / "src/y.py").read_text() == "y = 2\n"
    assert not (path / "docs").exists()
    tools = journal_entries(d, "agent.tool")
    assert [(t["data"]["tool"], t["data"]["paths"]) for t in tools] == calls
    check_journal(d, KEY, b"y = 2")

    d.stop()
    d.start()
    start_model(d, ws, "codex-test", "tools/turn2.json")
    code, envelopes, record2 = agent_run(
        d, ws, "codex", "codex-test", "make z", "--resume", record["session"]
    )
    assert code == 0, envelopes
    assert record2["session"] == record["session"]
    assert record2["applied"] == ["src/z.py"]
    first = next(r for r in model_log(d, ws, "codex-test") if r["tools"])
    assert first["tool_results"]  # turn 1's calls came back with the resumed thread
