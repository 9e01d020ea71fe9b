"""The journal export and the metrics with real commands (docs/fleet.md): a command run
with an operator secret and argv text of its own lands in PostgreSQL as the journal's
summary only (no argv text, output, or secret anywhere in the table), and the metrics
page counts it by profile, way of starting and outcome."""

from __future__ import annotations

import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from substrate.config import PROJECT_ROOT
from substrate.secrets import SecretStore
from tests.harness import DaemonProcess, wait_until
from tests.harness.postgres import PostgresServer, postgres_server


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server


@pytest.fixture
def profiles(tmp_path: Path) -> Path:
    out = tmp_path / "profiles"
    out.mkdir()
    tiny = (PROJECT_ROOT / "profiles" / "tiny.toml").read_text()
    shutil.copy(PROJECT_ROOT / "profiles" / "tiny.toml", out / "tiny.toml")
    (out / "secret.toml").write_text(
        tiny.replace("secrets = {}\n", 'secrets = { API_TOKEN = "api-token" }\n')
    )
    return out


def page(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for family in text_string_to_metric_families(data.partition(b"\r\n\r\n")[2].decode())
        for x in family.samples
    }


def test_a_command_lands_as_its_summary_and_is_counted(
    engine_daemons: Callable[..., DaemonProcess],
    tiny_image: str,
    profiles: Path,
    postgres: PostgresServer,
) -> None:
    node = "node-engine"
    d = engine_daemons(
        start=False,
        profiles_dir=str(profiles),
        metrics_listen="127.0.0.1:0",
        journal_export={
            "postgres_dsn": postgres.dsn,
            "node": node,
            "password_secret": "pg",
            "poll_s": 0.1,
        },
    )
    store = SecretStore(d.state_dir)
    store.set("pg", postgres.password.encode())
    token = "sk-fleet-" + secrets.token_hex(12)
    store.set("api-token", token.encode())
    d.start()
    ws = d.adopt(d.make_workspace())
    marker = "argv-text-" + secrets.token_hex(6)
    c = d.client()
    port = int(c.call("daemon.status")["metrics_listen"].rpartition(":")[2])
    before = page(port)
    script = f'echo "{marker}" >/dev/null; printf %s "$API_TOKEN" | wc -c; echo output-{marker}'
    result: dict[str, Any] = c.call(
        "proc.run", workspace=ws, profile="secret", argv=["sh", "-c", script]
    )
    assert result["exit_code"] == 0
    via = result["via"]  # busybox has no python: the engine's exec (docs/fast-exec.md)
    key = ("substrate_commands_total", (("outcome", "ok"), ("profile", "secret"), ("via", via)))
    failed = c.call("proc.run", workspace=ws, profile="secret", argv=["sh", "-c", "exit 3"])
    assert failed["exit_code"] == 3

    def caught_up() -> bool:
        status = c.call("daemon.status")["journal_export"]
        return bool(status["state"] == "caught_up" and status["lag_entries"] == 0)

    wait_until(caught_up, 60)
    kinds = {k for (k,) in postgres.query(
        "SELECT DISTINCT kind FROM substrate_journal WHERE node = %s", (node,)
    )}  # fmt: skip
    assert {"proc.started", "proc.exited"} <= kinds
    (started,) = postgres.query(
        "SELECT data FROM substrate_journal WHERE node = %s AND kind = 'proc.started'"
        " AND data->>'proc' = %s", (node, result["proc"]),
    )[0]  # fmt: skip
    assert started["argv0"] == "sh" and started["argc"] == 3 and len(started["argv_sha256"]) == 64
    for needle in (marker, token, postgres.password, "output-"):
        (n,) = postgres.query(
            "SELECT count(*) FROM substrate_journal WHERE data::text LIKE %s"
            " OR coalesce(workspace, '') LIKE %s OR actor LIKE %s",
            (f"%{needle}%",) * 3,
        )[0]
        assert n == 0, needle

    def counted() -> bool:
        now = page(port)
        failed_key = ("substrate_commands_total", (("outcome", "failed"), ("profile", "secret"),
                                                   ("via", via)))  # fmt: skip
        return (
            now.get(key, 0) == before.get(key, 0) + 1
            and now.get(failed_key, 0) >= 1
            and now[("substrate_command_seconds_count", (("profile", "secret"),))] >= 2
            and now[("substrate_sandboxes", ())] >= 1
            and ("substrate_artifact_store_bytes", ()) in now
        )

    wait_until(counted, 10)  # a page is cached up to 1 s
    assert token.encode() not in d.log_path.read_bytes()


def test_a_working_layer_command_counts_its_changes_and_apply_time(
    engine_daemons: Callable[..., DaemonProcess], sandbox_image: str
) -> None:
    d = engine_daemons(metrics_listen="127.0.0.1:0")
    ws = d.adopt(d.make_workspace())
    c = d.client()
    port = int(c.call("daemon.status")["metrics_listen"].rpartition(":")[2])
    result = c.call(
        "proc.run",
        workspace=ws,
        profile="default",
        argv=["sh", "-c", "echo one > new1.txt; echo two > new2.txt"],
    )
    assert result["exit_code"] == 0 and result["changes"]["counts"]["applied"] == 2, result
    key = ("substrate_commands_total", (("outcome", "ok"), ("profile", "default"),
                                        ("via", result["via"])))  # fmt: skip

    def counted() -> bool:
        now = page(port)
        return (
            now.get(("substrate_changes_total", (("outcome", "applied"),)), 0) == 2
            and now.get(("substrate_layer_apply_seconds_count", ()), 0) >= 1
            and now.get(key, 0) == 1
        )

    wait_until(counted, 10)  # a page is cached up to 1 s
