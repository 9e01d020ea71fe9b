"""What an agent backend's developer meets first, against real daemons (no engine needed):
the start-up banner and the debug line per refusal, `daemon.info` and `substrate doctor`
reading the running daemon, the CLI's `--state-dir` after the command and its ISO 8601
times, `fs.walk`/`fs.search` with `gitignore`, `fs.patch` with `count: "all"`, and
profile reloads (`profile.reload`, SIGHUP) that keep the set in force when a file is bad.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from substrate.config import PROJECT_ROOT
from substrate.protocol.client import RpcError
from tests.harness import wait_until
from tests.harness.daemon import daemon_env

if TYPE_CHECKING:
    from tests.harness import DaemonProcess


def cli(d: DaemonProcess, *argv: str) -> subprocess.CompletedProcess[str]:
    """`python -m substrate ARGV` as a person would run it, against `d`'s daemon."""
    return subprocess.run(
        [sys.executable, "-m", "substrate", *argv],
        env=daemon_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def profiles_dir(tmp_path: Path) -> Path:
    """Two of the shipped profiles only: a daemon using it lists exactly these."""
    out = tmp_path / "profiles"
    out.mkdir()
    for name in ("tiny", "readonly"):
        shutil.copy(PROJECT_ROOT / "profiles" / f"{name}.toml", out / f"{name}.toml")
    return out


# --- the daemon says what it is doing ---------------------------------------------------------


def test_the_start_up_banner_names_sockets_url_state_profiles_and_engine(
    daemon_factory: Callable[..., DaemonProcess], profiles_dir: Path
) -> None:
    d = daemon_factory(profiles_dir=str(profiles_dir))
    wait_until(lambda: " engine " in d.stderr(), 60, message="no engine line in the banner")
    log = d.stderr()
    listen = d.client().call("daemon.status")["listen"]
    assert f"state dir {d.state_dir}" in log
    assert f"agent socket {d.agent_path} (0660), operator socket {d.operator_path} (0600)" in log
    assert f"terminals http://{listen}/" in log
    assert f"profiles {profiles_dir}: 2 loaded: readonly, tiny" in log
    assert "engine reachable: Docker" in log or "engine not reachable" in log
    # Every line the daemon wrote (not the harness's `--- start` mark) starts with an
    # ISO 8601 time.
    lines = [line for line in log.splitlines() if not line.startswith("--- start ")]
    assert len(lines) >= 5
    for line in lines:
        stamp = line.split(" ", 1)[0]
        assert datetime.datetime.fromisoformat(stamp).tzinfo is not None, line


def test_debug_logs_one_line_per_refusal_and_never_the_params(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(log_level="debug")
    quiet = daemon_factory()
    for daemon in (d, quiet):
        ws = daemon.adopt(daemon.make_workspace())
        c = daemon.client()
        with pytest.raises(RpcError):
            c.call("fs.read", workspace=ws, path="hidden-name-1234.txt")
        with pytest.raises(RpcError):
            c.call("fs.nope")
        with pytest.raises(RpcError):
            c.call("fs.read", workspace=ws, path="x", length="bytes-not-a-number")
        with pytest.raises(RpcError):
            c.call("grant.list")  # operator only
    wait_until(lambda: "refused grant.list" in d.stderr(), 30, message="no refusal line")
    log = d.stderr()
    assert "refused fs.read: not_found (agent socket" in log
    assert "refused (request): method_not_found" in log
    assert "refused fs.read: invalid_params" in log
    assert "refused grant.list: unauthorized" in log
    assert "hidden-name-1234" not in log and "bytes-not-a-number" not in log
    assert "refused" not in quiet.stderr()  # at info, no refusal lines


# --- daemon.info and doctor ---------------------------------------------------------------------


def test_daemon_info_gives_the_effective_config_on_the_operator_socket_only(
    daemon_factory: Callable[..., DaemonProcess], profiles_dir: Path
) -> None:
    d = daemon_factory(profiles_dir=str(profiles_dir), max_uploads=3)
    info = d.operator().call("daemon.info")
    assert info["config"]["profiles_dir"] == str(profiles_dir)
    assert info["config"]["max_uploads"] == 3
    assert info["config"]["log_level"] == "info"
    assert info["state_dir"] == str(d.state_dir)
    assert info["operator_socket"] == str(d.operator_path)
    assert [p["name"] for p in info["profiles"]] == ["readonly", "tiny"]
    assert all(len(p["digest"]) == 64 for p in info["profiles"])
    with pytest.raises(RpcError) as agent:
        d.client().call("daemon.info")
    assert agent.value.refusal == "unauthorized"


def test_doctor_reports_the_running_daemons_profiles_not_the_defaults(
    daemon_factory: Callable[..., DaemonProcess], profiles_dir: Path
) -> None:
    d = daemon_factory(profiles_dir=str(profiles_dir))
    out = cli(d, "doctor", "--state-dir", str(d.state_dir)).stdout
    assert out.startswith("daemon: running (pid ")
    (line,) = [x for x in out.splitlines() if x.startswith("profiles ")]
    assert line.endswith(f"{profiles_dir}: readonly, tiny (in force)")
    d.stop()
    out = cli(d, "--state-dir", str(d.state_dir), "doctor").stdout
    assert out.startswith("daemon: no daemon answers at ")
    (line,) = [x for x in out.splitlines() if x.startswith("profiles ")]
    assert "default" in line  # the shipped profiles: what the defaults name


# --- the CLI ------------------------------------------------------------------------------------


def test_state_dir_after_the_command_and_iso_times(daemon: DaemonProcess) -> None:
    ws_path = daemon.make_workspace(files={"a.txt": "hello\n"})
    adopted = cli(daemon, "adopt", str(ws_path), "--state-dir", str(daemon.state_dir))
    assert adopted.returncode == 0, adopted.stderr
    assert datetime.datetime.fromisoformat(json.loads(adopted.stdout)["adopted"]).tzinfo
    read = cli(daemon, "journal", "read", "--limit", "2", "--state-dir", str(daemon.state_dir))
    assert read.returncode == 0, read.stderr
    entries = [json.loads(line) for line in read.stdout.splitlines()]
    assert [e["kind"] for e in entries] == ["daemon.started", "workspace.adopted"]
    for entry in entries:
        stamp = datetime.datetime.fromisoformat(entry["ts"])
        assert stamp.tzinfo is not None and stamp.year >= 2024
    # Before the command, as before.
    before = cli(daemon, "--state-dir", str(daemon.state_dir), "journal", "verify")
    assert before.returncode == 0 and json.loads(before.stdout)["ok"] is True


def test_every_option_has_help() -> None:
    import argparse

    from substrate.cli.main import build_parser

    missing: list[str] = []

    def visit(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    visit(child, f"{path} {name}")
            elif not action.help:
                missing.append(f"{path}: {action.option_strings or action.dest}")

    visit(build_parser(), "substrate")
    assert missing == []


# --- walk, search and patch over the socket -------------------------------------------------


def test_gitignore_walk_search_and_patch_count_all(daemon: DaemonProcess) -> None:
    files = {
        ".gitignore": "__pycache__/\n",
        "pkg/mod.py": "x = 1\nx = 2\nx = 3\n",
        "pkg/__pycache__/mod.cpython-311.pyc": "x = cached",
    }
    ws = daemon.adopt(daemon.make_workspace(files=files))
    c = daemon.client()
    walked = c.call("fs.walk", workspace=ws, gitignore=True)["paths"]
    assert [p["path"] for p in walked] == [".gitignore", "pkg", "pkg/mod.py"]
    found = c.call("fs.search", workspace=ws, pattern="x = ", exclude=["*.py"], gitignore=False)
    assert [m["path"] for m in found["matches"]] == ["pkg/__pycache__/mod.cpython-311.pyc"]
    base = hashlib.sha256(files["pkg/mod.py"].encode()).hexdigest()
    plan = c.call(
        "fs.patch",
        workspace=ws,
        path="pkg/mod.py",
        base_sha256=base,
        edits=[{"old": "x =", "new": "y =", "count": "all"}],
    )
    assert plan["applied"] is True
    assert c.call("fs.read", workspace=ws, path="pkg/mod.py")["data"] == "y = 1\ny = 2\ny = 3\n"


# --- profile reloads ---------------------------------------------------------------------------


def names(d: DaemonProcess) -> list[str]:
    return [p["name"] for p in d.client().call("profile.list")["profiles"]]


def test_profile_reload_adds_changes_removes_and_journals_digests(
    daemon_factory: Callable[..., DaemonProcess], profiles_dir: Path
) -> None:
    d = daemon_factory(profiles_dir=str(profiles_dir))
    before = {p["name"]: p["digest"] for p in d.operator().call("daemon.info")["profiles"]}
    tiny = profiles_dir / "tiny.toml"
    tiny.write_text(tiny.read_text().replace("pids = 128", "pids = 64"))
    (profiles_dir / "readonly.toml").unlink()
    shutil.copy(PROJECT_ROOT / "profiles" / "default.toml", profiles_dir / "default.toml")
    result = d.operator().call("profile.reload")
    assert (result["added"], result["removed"], result["changed"]) == (
        ["default"],
        ["readonly"],
        ["tiny"],
    )
    assert result["retired_sandboxes"] == 0
    assert names(d) == ["default", "tiny"]
    assert d.client().call("profile.get", name="tiny")["pids"] == 64
    digests = {p["name"]: p["digest"] for p in result["profiles"]}
    assert digests["tiny"] != before["tiny"]
    (entry,) = d.journal({"profile.reloaded"})
    assert entry["data"]["profiles"] == digests and entry["data"]["changed"] == ["tiny"]
    assert entry["actor"].startswith("operator:")
    with pytest.raises(RpcError) as agent:
        d.client().call("profile.reload")
    assert agent.value.refusal == "unauthorized"


def test_a_reload_with_a_bad_file_keeps_the_set_in_force(
    daemon_factory: Callable[..., DaemonProcess], profiles_dir: Path
) -> None:
    d = daemon_factory(profiles_dir=str(profiles_dir))
    tiny = profiles_dir / "tiny.toml"
    tiny.write_text(tiny.read_text().replace("pids = 128", "pids = 64"))
    (profiles_dir / "broken.toml").write_text('memory = "lots"\n')
    with pytest.raises(RpcError) as refused:
        d.operator().call("profile.reload")
    assert refused.value.refusal == "profile_invalid"
    assert "broken.toml" in refused.value.message and "$.memory" in refused.value.message
    # Nothing of the failed load is in force: not the good change either.
    assert names(d) == ["readonly", "tiny"]
    assert d.client().call("profile.get", name="tiny")["pids"] == 128
    assert d.journal({"profile.reloaded"}) == []
    assert [e["data"] for e in d.journal({"profile.reload_refused"})] == [
        {"refusal": "profile_invalid"}
    ]


def test_sighup_reloads_the_profiles(
    daemon_factory: Callable[..., DaemonProcess], profiles_dir: Path
) -> None:
    d = daemon_factory(profiles_dir=str(profiles_dir))
    (profiles_dir / "readonly.toml").unlink()
    os.kill(d.pid, signal.SIGHUP)
    wait_until(lambda: d.journal({"profile.reloaded"}), 30, message="SIGHUP did not reload")
    (entry,) = d.journal({"profile.reloaded"})
    assert entry["actor"] == "operator:signal" and entry["data"]["removed"] == ["readonly"]
    assert names(d) == ["tiny"]
    assert d.running  # a HUP never stops the daemon


def test_the_config_rejects_an_unknown_log_level(tmp_path: Path) -> None:
    from substrate.config import ConfigError, load_config

    path = tmp_path / "substrate.toml"
    path.write_text('log_level = "chatty"\n')
    with pytest.raises(ConfigError) as bad:
        load_config(path, {})
    assert "log_level" in str(bad.value)
    assert load_config(None, {"log_level": "debug"}).log_level == "debug"


def test_cli_serve_log_level_flag_wins_over_the_config() -> None:
    from substrate.cli.main import build_parser

    args: Any = build_parser().parse_args(["serve", "--log-level", "debug"])
    assert args.log_level == "debug"


def test_human_times_converts_time_fields_only() -> None:
    from substrate.cli.common import human_times, iso_time

    value = {"ts": 1.7e9, "size": 1.7e9, "ended": None, "adopted": 0.0, "x": [{"expires": 2e9}]}
    shown = human_times(value)
    assert shown["ts"] == iso_time(1.7e9) and shown["x"][0]["expires"] == iso_time(2e9)
    assert (shown["size"], shown["ended"], shown["adopted"]) == (1.7e9, None, 0.0)
    assert datetime.datetime.fromisoformat(shown["ts"]).timestamp() == pytest.approx(1.7e9)
