"""deploy/systemd/substrate.service (docs/deployment.md): the unit says what the CLI takes and
keeps what the daemon needs.

The ExecStart line is parsed by the CLI's own parser and its flags are checked against
`substrate --help` / `substrate serve --help` as a person would run them; the paths
systemd makes (StateDirectory, ConfigurationDirectory) are the ones ExecStart names; no
option that gives the service a mount namespace of its own is set (the working layers
would not reach the containers); the capabilities kept are the ones the page explains;
and `systemd-analyze verify` accepts the file.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from substrate.cli.main import build_parser
from substrate.config import PROJECT_ROOT
from tests.harness import daemon_env

UNIT = PROJECT_ROOT / "deploy" / "systemd" / "substrate.service"
DOC = PROJECT_ROOT / "docs" / "deployment.md"

#: Options that make systemd set up a private mount namespace (or another root), so the
#: daemon's overlay mounts would stay invisible to dockerd; and the ones that take away
#: the host network or root.
NAMESPACING = {
    "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts",
    "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
    "ProtectControlGroups", "ProtectProc", "ProcSubset", "ProtectHostname", "ProtectClock",
    "ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths", "ExecPaths", "NoExecPaths",
    "TemporaryFileSystem", "BindPaths", "BindReadOnlyPaths", "RootDirectory", "RootImage",
    "MountAPIVFS", "MountFlags", "PrivateNetwork", "PrivateUsers", "PrivateIPC",
    "DynamicUser", "NetworkNamespacePath", "IPCNamespacePath", "LogNamespace",
}  # fmt: skip


def read_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """Sections → (key, value) in order (keys may repeat); `#`/`;` comments, `\\` joins."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"not a unit line: {raw!r}"
        current.append((key.strip(), value.strip()))
    return sections


def values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit[section] if k == key]


UNIT_SECTIONS = read_unit(UNIT.read_text())
(EXEC_START,) = values(UNIT_SECTIONS, "Service", "ExecStart")
ARGV = shlex.split(EXEC_START)


def cli_help(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "substrate", *args, "--help"],
        capture_output=True,
        text=True,
        env=daemon_env(),
        timeout=60,
        check=True,
    )
    return done.stdout


def test_exec_start_is_a_serve_command_the_cli_parses() -> None:
    assert ARGV[0] == "/usr/local/bin/substrate"  # where scripts/setup's pip puts it
    args = build_parser().parse_args(ARGV[1:])
    assert args.command == "serve"
    assert args.state_dir == "/var/lib/substrate"
    assert args.config == "/etc/substrate/substrate.toml"


def test_every_flag_of_exec_start_is_in_the_real_help() -> None:
    top, serve = cli_help(), cli_help("serve")
    at = ARGV.index("serve")
    flags = [a.split("=")[0] for a in ARGV[1:] if a.startswith("-")]
    assert flags == ["--state-dir", "--config"]
    for i, arg in enumerate(ARGV):
        if arg.startswith("-"):
            help_text = top if i < at else serve
            assert re.search(rf"(^|\s|\[){re.escape(arg)}\b", help_text), arg


def test_systemd_makes_the_directories_exec_start_names() -> None:
    assert values(UNIT_SECTIONS, "Service", "StateDirectory") == ["substrate"]
    assert values(UNIT_SECTIONS, "Service", "StateDirectoryMode") == ["0700"]
    assert ARGV[ARGV.index("--state-dir") + 1] == "/var/lib/substrate"
    assert values(UNIT_SECTIONS, "Service", "ConfigurationDirectory") == ["substrate"]
    assert ARGV[ARGV.index("--config") + 1].startswith("/etc/substrate/")


def test_it_runs_as_root_in_the_hosts_mount_namespace() -> None:
    service = dict(UNIT_SECTIONS["Service"])
    assert service["User"] == "root"
    assert sorted(NAMESPACING & service.keys()) == []
    assert set(service["RestrictNamespaces"].split()) == {"net", "pid"}  # setns into both


def test_the_capabilities_kept_are_the_ones_the_page_explains() -> None:
    (caps,) = values(UNIT_SECTIONS, "Service", "CapabilityBoundingSet")
    kept = sorted(caps.split())
    explained = sorted(re.findall(r"^\| `(CAP_[A-Z_]+)` \|", DOC.read_text(), re.MULTILINE))
    assert kept == explained
    assert "CAP_SYS_ADMIN" in kept and "CAP_SETUID" not in kept


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    # The program need not be installed here: verify checks that it exists, so point
    # ExecStart at one that does (its arguments are checked by the tests above).
    unit = tmp_path / "substrate.service"
    unit.write_text(UNIT.read_text().replace(f"ExecStart={ARGV[0]} ", "ExecStart=/bin/true "))
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr.strip() == ""
