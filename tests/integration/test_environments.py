"""Environments against the real engine (docs/environments.md): operator secrets, the
persistent home, the image's Python tooling.

Daemons run as subprocesses (`daemon_factory`), so their log file can be searched for a
secret and a restart is a real one. Profiles are copies of the shipped `tiny` (busybox)
and `default` ones, plus `secret` (tiny with `secrets = { API_TOKEN = "api-token" }`)
and `missing` (naming a secret nobody set). Secrets are set with the real command line
(`substrate secret set`, the value on stdin).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from substrate.config import PROJECT_ROOT
from substrate.protocol.client import Client, RpcError
from substrate.sandbox.containers import daemon_id_for
from substrate.sandbox.spec import LABEL_DAEMON
from tests.harness import DaemonProcess, create_workspace, daemon_env, quiet_ext4, reuse_inode

SHIPPED = PROJECT_ROOT / "profiles"


@pytest.fixture
def profiles(tmp_path: Path) -> Path:
    out = tmp_path / "profiles"
    out.mkdir()
    for name in ("tiny", "default"):
        shutil.copy(SHIPPED / f"{name}.toml", out / f"{name}.toml")
    tiny = (SHIPPED / "tiny.toml").read_text()
    assert "secrets = {}\n" in tiny
    (out / "secret.toml").write_text(
        tiny.replace("secrets = {}\n", 'secrets = { API_TOKEN = "api-token" }\n')
    )
    (out / "other.toml").write_text(tiny.replace('memory = "256m"', 'memory = "200m"'))
    (out / "missing.toml").write_text(
        tiny.replace("secrets = {}\n", 'secrets = { OTHER = "never-set" }\n')
    )
    return out


@pytest.fixture
def make_daemon(
    engine_daemons: Callable[..., DaemonProcess], tiny_image: str, profiles: Path
) -> Callable[[], DaemonProcess]:
    return functools.partial(engine_daemons, start=False, profiles_dir=str(profiles))


def secret_cli(
    d: DaemonProcess, *args: str, stdin: bytes = b""
) -> subprocess.CompletedProcess[bytes]:
    """`substrate --state-dir <d's> secret ARGS`, as a person runs it."""
    return subprocess.run(
        [sys.executable, "-m", "substrate", "--state-dir", str(d.state_dir), "secret", *args],
        input=stdin,
        capture_output=True,
        env=daemon_env(),
        timeout=60,
        check=False,
    )


def run(c: Client, ws: str, script: str, profile: str = "tiny") -> dict[str, Any]:
    result: dict[str, Any] = c.call(
        "proc.run", workspace=ws, profile=profile, argv=["sh", "-c", script]
    )
    return result


def out(result: dict[str, Any]) -> str:
    assert result["exit_code"] == 0, (result["exit_code"], result["stderr"].get("inline"))
    text: str = result["stdout"]["inline"]
    return text


def files_holding(root: Path, needle: bytes, skip: Path) -> list[str]:
    """Every regular file under `root` (not under `skip`) whose bytes hold `needle`."""
    found = []
    for base, dirs, names in os.walk(root):
        if Path(base) == skip or skip in Path(base).parents:
            dirs[:] = []
            continue
        for name in names:
            path = Path(base) / name
            if path.is_symlink() or not path.is_file():
                continue
            if needle in path.read_bytes():
                found.append(str(path))
    return found


def test_a_secret_reaches_the_command_and_nothing_else(
    make_daemon: Callable[[], DaemonProcess], docker_client: Any
) -> None:
    d = make_daemon()
    value = "sk-test-" + secrets.token_hex(16)
    done = secret_cli(d, "set", "api-token", stdin=value.encode() + b"\n")
    assert done.returncode == 0, done.stderr
    assert value.encode() not in done.stdout + done.stderr
    d.start()
    ws_path = d.make_workspace()
    ws = d.adopt(ws_path)
    c = d.client()
    digest = hashlib.sha256(value.encode()).hexdigest()

    result = run(c, ws, 'printf %s "$API_TOKEN" | sha256sum', "secret")
    assert out(result).split()[0] == digest  # the exact value, trailing newline dropped
    # A profile without the secret does not see it.
    assert out(run(c, ws, 'printf "[%s]" "$API_TOKEN"')) == "[]"

    seen: list[Any] = [result, c.call("proc.status", proc=result["proc"])]
    seen.append(c.call("proc.list", workspace=ws))
    seen.append(profile := c.call("profile.get", name="secret"))
    assert profile["secrets"] == {"API_TOKEN": "api-token"}
    seen.append(c.call("facts.probe", workspace=ws, profile="secret"))
    seen.append(d.journal())
    assert value not in json.dumps(seen)

    # The container's configuration holds the profile's env only: no secret in inspect.
    label = f"{LABEL_DAEMON}={daemon_id_for(d.state_dir)}"
    (ctr,) = [
        c2
        for c2 in docker_client.api.containers(filters={"label": label})
        if c2["Labels"].get("substrate.profile") == "secret"
    ]
    inspect = docker_client.api.inspect_container(ctr["Id"])
    assert value not in json.dumps(inspect)
    assert not any(e.startswith("API_TOKEN=") for e in inspect["Config"]["Env"])
    d.stop()

    # Nothing the daemon wrote holds it: the database (and its WAL), artifacts, the
    # log; only the secret's own file does.
    assert value.encode() not in d.log_path.read_bytes()
    secrets_dir = d.state_dir / "secrets"
    assert files_holding(d.state_dir, value.encode(), secrets_dir) == []
    assert (secrets_dir / "api-token").read_bytes() == value.encode()


def test_a_missing_secret_refuses_until_it_is_set_and_a_new_value_is_used_at_once(
    make_daemon: Callable[[], DaemonProcess],
) -> None:
    d = make_daemon().start()
    ws = d.adopt(d.make_workspace())
    c = d.client()
    with pytest.raises(RpcError) as caught:
        run(c, ws, "true", "missing")
    assert caught.value.refusal == "secret_unknown"
    assert caught.value.data["secrets"] == ["never-set"]

    # Set while the daemon runs: the next command has it, no restart.
    assert secret_cli(d, "set", "never-set", stdin=b"first").returncode == 0
    assert out(run(c, ws, 'printf %s "$OTHER"', "missing")) == "first"
    assert secret_cli(d, "set", "never-set", stdin=b"second\n").returncode == 0
    assert out(run(c, ws, 'printf %s "$OTHER"', "missing")) == "second"
    listed = secret_cli(d, "list")
    assert listed.stdout.decode().split() == ["never-set"]
    assert secret_cli(d, "rm", "never-set").returncode == 0
    with pytest.raises(RpcError) as again:
        run(c, ws, "true", "missing")
    assert again.value.refusal == "secret_unknown"


def test_home_survives_release_restart_and_readoption(
    make_daemon: Callable[[], DaemonProcess],
) -> None:
    d = make_daemon().start()
    ws_path = d.make_workspace(files={"keep.txt": "kept in the checkout\n"})
    ws = d.adopt(ws_path)
    c = d.client()
    assert out(run(c, ws, 'echo "$HOME"; id -u')).split() == ["/home/agent", "1000"]
    run(c, ws, 'echo "written before the release" > "$HOME/note"; mkdir -p "$HOME/.cache/x"')
    info = c.call("workspace.info", workspace=ws)
    assert info["home"]["files"] == 1
    assert info["home"]["bytes"] == len("written before the release\n")
    facts = {
        f["name"]: f["value"] for f in c.call("facts.probe", workspace=ws, profile="tiny")["facts"]
    }
    home_dirs = list((d.state_dir / "homes").iterdir())
    assert len(home_dirs) == 1
    st = os.stat(home_dirs[0] / "1000")
    assert facts["home_identity"] == f"{st.st_dev}:{st.st_ino}"
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (1000, 1000, 0o700)

    assert c.call("workspace.release", workspace=ws)["home"] == "kept"
    d.restart()
    c = d.client()
    ws2 = d.adopt(ws_path)
    assert ws2 != ws
    assert out(run(c, ws2, 'cat "$HOME/note"')) == "written before the release\n"
    # The same home for another profile of the workspace running as the same user.
    assert out(run(c, ws2, 'cat "$HOME/note"', "other")) == "written before the release\n"

    # A symlink the sandbox leaves in its home is removed, never followed.
    run(c, ws2, 'ln -s /workspace "$HOME/ws-link"; ln -s /workspace/keep.txt "$HOME/file-link"')
    released = c.call("workspace.release", workspace=ws2, keep_home=False)
    assert released["home"] == "removed"
    assert list((d.state_dir / "homes").iterdir()) == []
    assert (ws_path / "keep.txt").read_text() == "kept in the checkout\n"
    kinds = [e["kind"] for e in d.journal()]
    assert "workspace.home_removed" in kinds
    ws3 = d.adopt(ws_path)
    assert out(run(c, ws3, 'ls -A "$HOME"; echo end')) == "end\n"
    assert c.call("workspace.release", workspace=ws3, keep_home=False)["home"] == "removed"


def test_the_default_image_can_set_up_a_python_project(
    make_daemon: Callable[[], DaemonProcess], sandbox_image: str
) -> None:
    d = make_daemon().start()
    project = {
        "pyproject.toml": (
            '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
            '[project]\nname = "tinypkg"\nversion = "0.1"\n'
        ),
        "tinypkg/__init__.py": "VALUE = 42\n",
    }
    ws = d.adopt(d.make_workspace(files=project))
    c = d.client()
    assert out(run(c, ws, "python3 -m pip --version", "default")).startswith("pip ")
    script = (
        # The Debian setuptools and wheel build it, offline; the venv lives in the home.
        'python3 -m venv --system-site-packages "$HOME/venv"'
        ' && "$HOME/venv/bin/python" -m pip --version'
        ' && "$HOME/venv/bin/python" -m pip install -q --no-index --no-build-isolation'
        ' --no-deps --no-cache-dir . && cd / && "$HOME/venv/bin/python" -c'
        " 'import tinypkg; print(tinypkg.VALUE)'"
    )
    result = c.call(
        "proc.run", workspace=ws, profile="default", argv=["sh", "-c", script], timeout_s=300
    )
    lines = out(result).splitlines()
    assert lines[0].startswith("pip ") and "/home/agent/venv" in lines[0]
    assert lines[-1] == "42"
    # The venv lives in the persistent home, not in the checkout.
    assert c.call("workspace.info", workspace=ws)["home"]["files"] > 100


def test_a_reused_inode_gets_a_home_of_its_own(make_daemon: Callable[[], DaemonProcess]) -> None:
    """`rm -rf old/` and a new directory that got its inode: the new checkout's sandbox
    finds an empty home, never the old one's (sessions, credentials, a venv)."""
    d = make_daemon().start()
    with quiet_ext4(d.adopt_root / "quiet") as quiet:
        reused_inode_gets_its_own_home(d, quiet)


def reused_inode_gets_its_own_home(d: DaemonProcess, quiet: Path) -> None:
    c = d.client()
    old_path = create_workspace(quiet, "old")
    old = d.adopt(old_path)
    run(c, old, 'echo "the old checkout\'s session" > "$HOME/session"')
    assert c.call("workspace.release", workspace=old)["home"] == "kept"
    new_path = reuse_inode(old_path, old_path.parent)
    new = d.adopt(new_path)
    assert out(run(c, new, 'ls -A "$HOME"; echo end')) == "end\n"
    assert "home" in c.call("workspace.info", workspace=new)
    assert c.call("workspace.info", workspace=new)["home"]["files"] == 0
    # The old home is kept (never handed to a new checkout), beside the new one.
    kept = [p for p in (d.state_dir / "homes").iterdir() if (p / "1000" / "session").exists()]
    assert len(kept) == 1
    assert c.call("workspace.release", workspace=new, keep_home=False)["home"] == "removed"
    assert kept[0].exists()


PLANT = r"""
import os, site
target = site.getusersitepackages()
os.makedirs(target, exist_ok=True)
with open(os.path.join(target, "usercustomize.py"), "w") as f:
    f.write(
        "import os\n"
        "key = os.environ.get('API_KEY')\n"
        "if key:\n"
        "    open(os.path.expanduser('~/leak'), 'w').write(key)\n"
        "    open(os.path.expanduser('~/ran-with-key'), 'w').write('ran')\n"
    )
print(target)
"""


def test_a_secrets_profile_never_runs_or_shares_what_a_profile_without_them_plants(
    engine_daemons: Callable[..., DaemonProcess], sandbox_image: str, profiles: Path
) -> None:
    """`default` (no secrets) plants `usercustomize.py` in its home; `pipkey` (holding
    API_KEY, argv_allow = ["pip3"]) runs `pip3 --version`. The planted code never runs
    there and the key never reaches anything `default` can read: a profile's home is per
    secret set (docs/environments.md)."""
    default = (profiles / "default.toml").read_text()
    (profiles / "pipkey.toml").write_text(
        default.replace("secrets = {}\n", 'secrets = { API_KEY = "api-key" }\n').replace(
            "argv_allow = []\n", 'argv_allow = ["pip3"]\n'
        )
    )
    d = engine_daemons(start=False, profiles_dir=str(profiles))
    value = "sk-test-" + secrets.token_hex(16)
    assert secret_cli(d, "set", "api-key", stdin=value.encode()).returncode == 0
    d.start()
    c = d.client()
    ws = d.adopt(d.make_workspace())
    planted = c.call("proc.run", workspace=ws, profile="default", argv=["python3", "-c", PLANT])
    assert out(planted).strip() == "/home/agent/.local/lib/python3.11/site-packages"
    version = c.call("proc.run", workspace=ws, profile="pipkey", argv=["pip3", "--version"])
    assert out(version).startswith("pip ")
    after = c.call("proc.run", workspace=ws, profile="default", argv=["ls", "-A", "/home/agent"])
    assert "leak" not in out(after).split() and "ran-with-key" not in out(after).split()
    # Two homes of the checkout: default's and the secret set's; nothing in either (or
    # anywhere in the state dir but the secret's own file) holds the key.
    (checkout,) = (d.state_dir / "homes").iterdir()
    names = sorted(p.name for p in checkout.iterdir())
    assert names[0] == "1000" and names[1].startswith("1000-") and len(names) == 2
    assert not any(p.name in ("leak", "ran-with-key") for p in checkout.rglob("*"))
    facts = c.call("facts.probe", workspace=ws, profile="pipkey")["facts"]
    (identity,) = [f["value"] for f in facts if f["name"] == "home_identity"]
    st = os.stat(checkout / names[1])
    assert identity == f"{st.st_dev}:{st.st_ino}"
    assert files_holding(d.state_dir, value.encode(), d.state_dir / "secrets") == []
    usage = c.call("workspace.info", workspace=ws)["home"]
    assert usage["files"] >= 1  # both homes, measured together
    assert c.call("workspace.release", workspace=ws, keep_home=False)["home"] == "removed"
    assert list((d.state_dir / "homes").iterdir()) == []


def test_a_home_over_its_quota_refuses_commands_until_it_shrinks_or_goes(
    engine_daemons: Callable[..., DaemonProcess], tiny_image: str, profiles: Path
) -> None:
    d = engine_daemons(profiles_dir=str(profiles), home_quota_bytes=1 << 20)
    c = d.client()
    ws_path = d.make_workspace()
    ws = d.adopt(ws_path)
    fill = 'dd if=/dev/zero of="$HOME/big" bs=1024 count=2048 2>/dev/null; echo done'
    assert out(run(c, ws, fill)) == "done\n"  # a command may pass it: the next is refused
    with pytest.raises(RpcError) as info:
        run(c, ws, "echo hi")
    assert info.value.data["refusal"] == "limit_exceeded"
    assert info.value.data["scope"] == "home"
    assert info.value.data["quota_bytes"] == 1 << 20
    assert info.value.data["bytes"] >= 2 << 20
    (checkout,) = (d.state_dir / "homes").iterdir()
    (checkout / "1000" / "big").unlink()  # the operator makes room
    assert out(run(c, ws, "echo hi")) == "hi\n"
    assert out(run(c, ws, fill)) == "done\n"
    with pytest.raises(RpcError):
        run(c, ws, "echo hi")
    assert c.call("workspace.release", workspace=ws, keep_home=False)["home"] == "removed"
    ws = d.adopt(ws_path)
    assert out(run(c, ws, "echo hi")) == "hi\n"
