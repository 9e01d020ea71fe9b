"""An agent CLI turn inside substrate, end to end on the real engine (docs/agent-provider.md).

The CLI is `docs/examples/stand_in_claude.py`, baked into an image made for this module
(`FROM substrate-sandbox:bookworm`, the script at `/usr/local/bin/claude`): a read-only
place the operator's profile fixes (`image`, `argv_allow = ["claude"]`), as a real
`claude` would be installed. The backend is `docs/examples/agent_turn.py` (`run_turn`,
`settle`), imported from its file so the documented code is the tested code. The API
key is an operator secret set with `substrate secret set`; the checkout's policy is the
operator's (`workspace.set_policy`).

What must hold: the stream is parsed live into events; nothing the CLI wrote is in the
checkout before the backend applies it; only the accepted path lands, a path the policy
denies never does (even when the backend asks), the rest is discarded with the set;
turn 2 resumes the session the CLI left in `$HOME`, after a daemon restart; the key
reaches the CLI (its digest) and nothing else (results, journal, log, state files); with
`network = "egress"` and the model API as the only allowed host, any other host is
refused by the proxy and reported.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import secrets
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from substrate.config import PROJECT_ROOT
from substrate.protocol.client import RpcError
from tests.harness import DaemonProcess, daemon_env
from tests.harness.engine import TEST_LABELS

EXAMPLES = PROJECT_ROOT / "docs" / "examples"
SHIPPED = PROJECT_ROOT / "profiles"
IMAGE = f"substrate-agent-stand-in:{TEST_LABELS['substrate.test.session'][:12]}"
POLICY = {"write_allow": ["src/**"], "write_deny": ["src/secrets/**"]}
PROMPT_1 = (
    "read README.md\n"
    "write src/greeting.py\n"
    "write src/secrets/token.txt\n"
    "write ci/deploy.yml\n"
    "Added a greeting.\n"
)
PROMPT_2 = "write src/farewell.py\nAdded a farewell.\n"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


agent_turn = load_example("agent_turn")


@pytest.fixture(scope="module")
def stand_in_image(docker_client: Any, sandbox_image: str) -> Iterator[str]:
    """The sandbox image plus the stand-in CLI at /usr/local/bin/claude (root's, 0755)."""
    dockerfile = f"FROM {sandbox_image}\nCOPY claude /usr/local/bin/claude\n".encode()
    script = (EXAMPLES / "stand_in_claude.py").read_bytes()
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for name, data, mode in (("Dockerfile", dockerfile, 0o644), ("claude", script, 0o755)):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    context.seek(0)
    for _ in docker_client.api.build(
        fileobj=context,
        custom_context=True,
        tag=IMAGE,
        labels=dict(TEST_LABELS),
        rm=True,
        forcerm=True,
        pull=False,
        network_mode="none",
        decode=True,
    ):
        pass
    try:
        yield IMAGE
    finally:
        docker_client.api.remove_image(IMAGE, force=True)


def agent_profile(**changes: str) -> str:
    """The shipped `default` profile made the operator's agent CLI profile."""
    text = (SHIPPED / "default.toml").read_text()
    base = {
        'image = "substrate-sandbox:bookworm"': f'image = "{IMAGE}"',
        "argv_allow = []": 'argv_allow = ["claude"]',
        "secrets = {}": 'secrets = { ANTHROPIC_API_KEY = "anthropic" }',
        "timeout_s = 600": "timeout_s = 120",
        **changes,
    }
    for old, new in base.items():
        assert old in text, old
        text = text.replace(old, new)
    return text


@pytest.fixture
def make_daemon(
    engine_daemons: Callable[..., DaemonProcess], stand_in_image: str, tmp_path: Path
) -> Callable[..., DaemonProcess]:
    """`make(**profiles)`: a daemon (not started) whose profiles are `default` and
    `agent-cli`, plus any given as name → TOML text."""
    made: list[DaemonProcess] = []

    def make(**extra: str) -> DaemonProcess:
        profiles = tmp_path / f"profiles-{len(made)}"
        profiles.mkdir()
        shutil.copy(SHIPPED / "default.toml", profiles / "default.toml")
        (profiles / "agent-cli.toml").write_text(agent_profile())
        for name, text in extra.items():
            (profiles / f"{name}.toml").write_text(text)
        made.append(engine_daemons(start=False, profiles_dir=str(profiles)))
        return made[-1]

    return make


def set_secret(d: DaemonProcess, name: str, value: str) -> None:
    """`substrate secret set NAME` with the value on stdin, as the operator runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "substrate", "--state-dir", str(d.state_dir), "secret", "set", name],
        input=value.encode(),
        capture_output=True,
        env=daemon_env(),
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert value.encode() not in done.stdout + done.stderr


def tool_uses(events: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [
        (block["name"], block["input"])
        for e in events
        if e["type"] == "assistant"
        for block in e["message"]["content"]
        if block["type"] == "tool_use"
    ]


def texts(events: list[dict[str, Any]]) -> list[str]:
    return [
        block["text"]
        for e in events
        if e["type"] == "assistant"
        for block in e["message"]["content"]
        if block["type"] == "text"
    ]


def files_holding(root: Path, needle: bytes, skip: Path) -> list[str]:
    """Every regular file under `root` (not under `skip`) whose bytes hold `needle`."""
    found = []
    for base, dirs, names in os.walk(root):
        if Path(base) == skip or skip in Path(base).parents:
            dirs[:] = []
            continue
        for name in names:
            path = Path(base) / name
            if not path.is_symlink() and path.is_file() and needle in path.read_bytes():
                found.append(str(path))
    return found


def test_a_turn_is_streamed_reviewed_gated_and_resumed_from_home(
    make_daemon: Callable[..., DaemonProcess],
) -> None:
    d = make_daemon()
    key = "sk-ant-test-" + secrets.token_hex(24)
    set_secret(d, "anthropic", key)
    d.start()
    path = d.make_workspace(files={"README.md": "# demo project\n", "src/app.py": "pass\n"})
    ws = d.adopt(path)
    d.operator().call("workspace.set_policy", workspace=ws, policy=POLICY)
    c = d.client(timeout=120)
    seen: list[Any] = []  # every answer the daemon gave, searched for the key at the end

    # The profile fixes the program: anything else is refused before a sandbox exists.
    for argv in (["sh", "-c", "env"], ["/usr/local/bin/claude", "-p"]):
        with pytest.raises(RpcError) as caught:
            c.call("proc.run", workspace=ws, profile="agent-cli", argv=argv)
        assert caught.value.refusal == "argv_denied"

    live: list[str] = []
    turn = agent_turn.run_turn(
        c, ws, "agent-cli", PROMPT_1, on_event=lambda e: live.append(e["type"])
    )
    seen.append(turn.final)
    assert turn.exit_code == 0, turn.stderr
    assert turn.bad_lines == []
    assert live == [e["type"] for e in turn.events]  # handed over as they were parsed
    init = turn.events[0]
    assert (init["type"], init["subtype"], init["cwd"]) == ("system", "init", "/workspace")
    assert init["api_key_sha256"] == hashlib.sha256(key.encode()).hexdigest()
    assert [name for name, _ in tool_uses(turn.events)] == ["Read", "Write", "Write", "Write"]
    results = [
        block["content"]
        for e in turn.events
        if e["type"] == "user"
        for block in e["message"]["content"]
    ]
    assert results[0] == "# demo project"  # it read the checkout through the layer
    assert turn.result is not None and turn.result["is_error"] is False
    assert turn.result["result"] == "Added a greeting."
    session = turn.session_id
    assert session is not None and session == init["session_id"]

    # Review: everything the CLI wrote is proposed, nothing of it is in the checkout.
    changes = turn.changes
    assert changes["mode"] == "review" and changes["changeset"].startswith("cs_")
    proposed = {(e["path"], e["op"]) for e in changes["review"]}
    assert proposed == {
        ("ci", "mkdir"),
        ("ci/deploy.yml", "create"),
        ("src/greeting.py", "create"),
        ("src/secrets", "mkdir"),
        ("src/secrets/token.txt", "create"),
    }
    assert sorted(p.name for p in path.iterdir()) == ["README.md", "src"]
    assert sorted(p.name for p in (path / "src").iterdir()) == ["app.py"]
    kept = c.call("changes.get", changeset=changes["changeset"])
    seen.append(kept)
    assert kept["state"] == "pending" and kept["total_changes"] == 5

    # The backend accepts src/ only; the operator's policy still refuses src/secrets/.
    done = agent_turn.settle(c, turn, accept=["src"])
    assert [(e["path"], e["op"]) for e in done.applied] == [("src/greeting.py", "create")]
    assert sorted((e["path"], e["rule"]) for e in done.blocked) == [
        ("src/secrets", "src/secrets/**"),
        ("src/secrets/token.txt", "src/secrets/**"),
    ]
    assert done.not_accepted == ["ci", "ci/deploy.yml"]
    assert done.conflicts == [] and done.pending == [] and done.discarded
    greeting = path / "src" / "greeting.py"
    assert greeting.read_text() == "# written by the stand-in agent for src/greeting.py\n"
    assert (greeting.stat().st_uid, greeting.stat().st_gid) == (1000, 1000)
    assert not (path / "ci").exists() and not (path / "src" / "secrets").exists()
    with pytest.raises(RpcError) as gone:
        c.call("changes.apply", changeset=changes["changeset"])
    assert gone.value.refusal == "changeset_unknown" and gone.value.data["discarded"] is True

    # Turn 2, after a restart (the sandbox is made again): the session is in the home.
    d.restart()
    c = d.client(timeout=120)
    turn2 = agent_turn.run_turn(c, ws, "agent-cli", PROMPT_2, resume=session)
    seen.append(turn2.final)
    assert turn2.exit_code == 0, turn2.stderr
    assert turn2.session_id == session
    assert texts(turn2.events)[0] == (
        f"Resumed session {session}: 1 earlier prompt(s), the last: {PROMPT_1.strip()!r}."
    )
    done2 = agent_turn.settle(c, turn2, accept=["src"])
    assert [e["path"] for e in done2.applied] == ["src/farewell.py"]
    assert done2.not_accepted == []
    assert (path / "src" / "farewell.py").exists() and greeting.exists()
    (stored,) = d.state_dir.glob(f"homes/*/1000-*/.claude/projects/-workspace/{session}.jsonl")
    history = [json.loads(line) for line in stored.read_text().splitlines()]
    assert [h.get("prompt") for h in history if h["type"] == "user"] == [
        PROMPT_1.strip(),
        PROMPT_2.strip(),
    ]
    assert stored.stat().st_uid == 1000

    # An unknown session is the CLI's own error; nothing is proposed.
    lost = agent_turn.run_turn(c, ws, "agent-cli", "hello", resume="no-such-session")
    seen.append(lost.final)
    assert lost.exit_code == 1 and lost.result is not None and lost.result["is_error"]
    assert lost.result["result"] == "No conversation found with session ID: no-such-session"
    assert agent_turn.settle(c, lost, accept=["src"]).applied == []

    # The key reached the CLI and nothing else: answers, journal, log, state files.
    for proc in (turn.proc, turn2.proc, lost.proc):
        seen.append(c.call("proc.status", proc=proc))
    seen.append(c.call("proc.list", workspace=ws))
    seen.append(c.call("profile.get", name="agent-cli"))
    journal = d.journal()
    seen.append(journal)
    assert key not in json.dumps(seen)
    # The prompt went on stdin: neither it nor the answers are journaled.
    assert "Added a" not in json.dumps(journal)
    d.stop()
    assert key.encode() not in d.log_path.read_bytes()
    secrets_dir = d.state_dir / "secrets"
    assert files_holding(d.state_dir, key.encode(), secrets_dir) == []


def test_without_the_operator_secret_no_turn_runs(
    make_daemon: Callable[..., DaemonProcess],
) -> None:
    d = make_daemon().start()
    ws = d.adopt(d.make_workspace())
    c = d.client(timeout=120)
    with pytest.raises(RpcError) as caught:
        agent_turn.run_turn(c, ws, "agent-cli", "write src/x.py\n")
    assert caught.value.refusal == "secret_unknown"
    assert caught.value.data["secrets"] == ["anthropic"]
    assert c.call("proc.list", workspace=ws)["processes"] == []


def egress_profile() -> str:
    """`agent-cli` with egress to the model API only (docs/agent-provider.md)."""
    lines = agent_profile().splitlines(keepends=True)
    text = "".join(line for line in lines if not line.startswith("egress_allow ="))
    egress = 'network = "egress"\negress_allow = ["api.anthropic.com"]'
    assert 'network = "none"' in text
    return text.replace('network = "none"', egress)


def test_egress_reaches_only_the_model_api(make_daemon: Callable[..., DaemonProcess]) -> None:
    d = make_daemon(**{"agent-egress": egress_profile()})
    set_secret(d, "anthropic", "sk-ant-test-" + secrets.token_hex(8))
    d.start()
    ws = d.adopt(d.make_workspace())
    c = d.client(timeout=120)
    turn = agent_turn.run_turn(c, ws, "agent-egress", "fetch https://example.invalid/x?q=1\n")
    assert turn.exit_code == 0, turn.stderr
    (result,) = [
        block["content"]
        for e in turn.events
        if e["type"] == "user"
        for block in e["message"]["content"]
    ]
    assert result.startswith("proxy answered: HTTP/1.1 403")
    assert turn.final["egress_blocked"]["hosts"] == ["example.invalid:443"]
    denied = d.journal({"egress.denied"}, workspace=ws)
    assert [(e["data"]["host"], e["data"]["port"]) for e in denied] == [("example.invalid", 443)]
    assert "q=1" not in json.dumps(d.journal())
    agent_turn.settle(c, turn, accept=[])
