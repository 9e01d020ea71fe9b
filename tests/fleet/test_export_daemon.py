"""The journal export in a real daemon: every entry in PostgreSQL in order and once across
a server stop/start and a kill -9, verified from SQL alone; a server that is away or a
table someone altered shows in `daemon.status` and never holds a request; the password
(an operator secret) is nowhere but in the secret's file; the metrics page of the same
daemon moves with a refusal and keeps answering through a storm of idle connections."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from substrate.protocol.client import RpcError
from substrate.secrets import SecretStore
from substrate.store.journal import JournalReader
from tests.harness import DaemonProcess, daemon_env, wait_until
from tests.harness.postgres import PostgresServer

SECRET = "pg-password"


def exporting(
    factory: Callable[..., DaemonProcess], pg: PostgresServer, node: str, dsn: str | None = None,
    **config: Any,
) -> DaemonProcess:  # fmt: skip
    """A started daemon shipping to `dsn` (default `pg`'s) as `node`, its password a secret."""
    d = factory(
        start=False,
        journal_export={
            "postgres_dsn": dsn or pg.dsn,
            "node": node,
            "password_secret": SECRET,
            "poll_s": 0.1,
            "max_backoff_s": 1.0,
            "timeout_s": 3.0,
        },
        **config,
    )
    SecretStore(d.state_dir).set(SECRET, pg.password.encode())
    return d.start()


def export_status(d: DaemonProcess) -> dict[str, Any]:
    with d.client() as c:
        status: dict[str, Any] = c.call("daemon.status")["journal_export"]
        return status


def caught_up(d: DaemonProcess) -> dict[str, Any]:
    """Wait until every committed entry is in PostgreSQL; the status then."""
    seen: dict[str, Any] = {}

    def done() -> bool:
        seen.update(export_status(d))
        head = d.journal()[-1]["seq"]
        return (
            seen["state"] == "caught_up" and seen["last_seq"] >= head and seen["lag_entries"] == 0
        )

    wait_until(done, 60)
    return seen


def write_files(d: DaemonProcess, ws: str, names: list[str]) -> None:
    with d.client() as c:
        for name in names:
            c.call(
                "fs.write",
                workspace=ws,
                path=name,
                content_b64=base64.b64encode(b"file bytes never shipped " + name.encode()).decode(),
                base_sha256=None,
            )


def shipped(pg: PostgresServer, node: str) -> list[tuple[int, str]]:
    return [(int(s), str(h)) for s, h in pg.query(
        "SELECT seq, hash FROM substrate_journal WHERE node = %s ORDER BY seq", (node,)
    )]  # fmt: skip


def verify_cli(pg: PostgresServer, node: str) -> tuple[int, dict[str, Any]]:
    env = {**daemon_env(), "PGPASSWORD": pg.password}
    done = subprocess.run(
        [sys.executable, "-m", "substrate", "journal", "verify", "--postgres", pg.dsn,
         "--node", node],
        capture_output=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def test_every_entry_lands_once_in_order_across_a_server_restart_and_a_kill9(
    daemon_factory: Callable[..., DaemonProcess], postgres: PostgresServer
) -> None:
    node = "node-restarts"
    d = exporting(daemon_factory, postgres, node)
    ws = d.adopt(d.make_workspace())
    write_files(d, ws, [f"a{i}.txt" for i in range(5)])
    caught_up(d)

    postgres.stop()
    try:
        write_files(d, ws, [f"b{i}.txt" for i in range(5)])  # requests go on meanwhile
        wait_until(lambda: export_status(d)["state"] == "retrying", 30)
        away = export_status(d)
        assert away["last_error"].startswith("unreachable: ")
        wait_until(lambda: export_status(d)["lag_entries"] > 0, 30)
    finally:
        postgres.start()
    caught_up(d)

    write_files(d, ws, [f"c{i}.txt" for i in range(20)])
    d.kill()  # -9, probably mid-batch or before its cursor was written
    d.start()
    write_files(d, ws, ["d.txt"])
    caught_up(d)

    local = [(e["seq"], e["hash"]) for e in d.journal()]
    assert shipped(postgres, node) == local
    (count, distinct, low, high), = postgres.query(
        "SELECT count(*), count(DISTINCT seq), min(seq), max(seq) FROM substrate_journal"
        " WHERE node = %s", (node,),
    )  # fmt: skip
    assert count == distinct == high == len(local) and low == 1
    epochs = {e for (e,) in postgres.query(
        "SELECT DISTINCT epoch FROM substrate_journal WHERE node = %s", (node,)
    )}  # fmt: skip
    assert epochs == {1, 2}

    # Nothing of the files' bytes, and never the password, in PostgreSQL or the log.
    (leaks,) = postgres.query(
        "SELECT count(*) FROM substrate_journal WHERE data::text LIKE %s OR data::text LIKE %s",
        ("%never shipped%", f"%{postgres.password}%"),
    )[0]
    assert leaks == 0
    assert postgres.password not in d.stderr(tail=100_000)

    assert verify_cli(postgres, node) == (0, {"ok": True, "checked": len(local)})
    postgres.query(
        "UPDATE substrate_journal SET data = data || '{\"size\": 1}' WHERE node = %s AND seq = %s",
        (node, local[7][0]),
    )
    assert verify_cli(postgres, node) == (1, {"ok": False, "checked": 7, "first_bad_seq": 8})


def test_a_graceful_stop_ships_its_last_entries(
    daemon_factory: Callable[..., DaemonProcess], postgres: PostgresServer
) -> None:
    node = "node-stops"
    d = exporting(daemon_factory, postgres, node)
    ws = d.adopt(d.make_workspace())
    caught_up(d)
    write_files(d, ws, [f"s{i}.txt" for i in range(3)])
    assert d.stop() == 0
    reader = JournalReader(d.state_dir / "substrate.db")
    try:
        local = [(row[1], row[8]) for row in reader.rows(0, 100_000, 1 << 30)]
        last_kind = reader.rows(len(local) - 1, 1, 1 << 30)[0][3]
    finally:
        reader.close()
    assert last_kind == "daemon.stopped"
    assert shipped(postgres, node) == local


def export_cli(d: DaemonProcess, pg: PostgresServer, node: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "substrate", "--state-dir", str(d.state_dir), "journal", "export",
         "--postgres", pg.dsn, "--node", node, "--password-secret", SECRET],
        capture_output=True, env=daemon_env(), timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert pg.password.encode() not in done.stdout + done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_journal_export_ships_once_and_exits(
    daemon_factory: Callable[..., DaemonProcess], postgres: PostgresServer
) -> None:
    node = "node-cli"
    d = daemon_factory()  # no [journal_export]: the command line alone ships
    SecretStore(d.state_dir).set(SECRET, postgres.password.encode())
    ws = d.adopt(d.make_workspace())
    write_files(d, ws, [f"cli{i}.txt" for i in range(4)])
    local = [(e["seq"], e["hash"]) for e in d.journal()]
    with d.client() as c:
        assert c.call("daemon.status")["journal_export"]["state"] == "off"
    first = export_cli(d, postgres, node)  # the daemon still running: fine
    assert first["shipped"] >= len(local) and first["last_seq"] >= local[-1][0]
    assert export_cli(d, postgres, node)["shipped"] == 0  # resumed from its cursor
    assert shipped(postgres, node)[: len(local)] == local
    assert verify_cli(postgres, node)[0] == 0


def test_a_server_that_does_not_answer_shows_in_status_and_holds_no_request(
    daemon_factory: Callable[..., DaemonProcess], postgres: PostgresServer, tmp_path: Any
) -> None:
    nowhere = f"host={tmp_path}/no-server dbname=postgres user=postgres"
    d = exporting(daemon_factory, postgres, "node-away", dsn=nowhere)
    ws = d.adopt(d.make_workspace())
    wait_until(lambda: export_status(d)["state"] == "retrying", 30)
    write_files(d, ws, [f"f{i}.txt" for i in range(10)])  # answered as ever
    status = export_status(d)
    assert status["last_error"].startswith("unreachable: ")
    assert postgres.password not in status["last_error"]
    assert status["last_seq"] == 0
    wait_until(lambda: export_status(d)["lag_entries"] >= 10, 30)
    assert d.verify_journal()["ok"] is True


def test_a_server_too_slow_to_answer_times_out_and_is_caught_up_after(
    daemon_factory: Callable[..., DaemonProcess], postgres: PostgresServer
) -> None:
    """A lock someone holds on the table: each batch waits `timeout_s`, then backs off."""
    node = "node-slow"
    d = exporting(daemon_factory, postgres, node)
    ws = d.adopt(d.make_workspace())
    caught_up(d)
    with postgres.connect(autocommit=False) as blocker:
        blocker.execute("LOCK TABLE substrate_journal IN ACCESS EXCLUSIVE MODE")
        write_files(d, ws, [f"slow{i}.txt" for i in range(5)])  # answered meanwhile
        wait_until(lambda: export_status(d)["state"] == "retrying", 30)
        assert "due to statement timeout" in export_status(d)["last_error"]
        with d.client() as c:
            assert c.call("daemon.status")["journal_export"]["lag_entries"] > 0
        blocker.rollback()
    caught_up(d)
    assert shipped(postgres, node) == [(e["seq"], e["hash"]) for e in d.journal()]


def test_a_table_someone_altered_is_named_in_status(
    daemon_factory: Callable[..., DaemonProcess], postgres: PostgresServer
) -> None:
    postgres.query("DROP DATABASE IF EXISTS altered_daemon")
    postgres.query("CREATE DATABASE altered_daemon")
    with postgres.connect(dbname="altered_daemon") as conn:
        conn.execute("CREATE TABLE substrate_journal (node text, seq bigint, data text)")
    dsn = postgres.dsn.replace("dbname=postgres", "dbname=altered_daemon")
    d = exporting(daemon_factory, postgres, "node-altered", dsn=dsn)
    wait_until(lambda: export_status(d)["state"] == "retrying", 30)
    error = export_status(d)["last_error"]
    assert error.startswith("schema_mismatch: substrate_journal has no column epoch"), error
    with d.client() as c:
        assert c.call("daemon.status")["epoch"] == 1  # the daemon answers as ever


def metric_samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    body = data.partition(b"\r\n\r\n")[2].decode()
    return {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for family in text_string_to_metric_families(body)
        for x in family.samples
    }


def test_the_metrics_page_moves_and_survives_a_storm(
    daemon_factory: Callable[..., DaemonProcess], postgres: PostgresServer
) -> None:
    d = exporting(daemon_factory, postgres, "node-metrics", metrics_listen="127.0.0.1:0")
    with d.client() as c:
        port = int(c.call("daemon.status")["metrics_listen"].rpartition(":")[2])
    caught_up(d)
    before = metric_samples(port)
    assert before[("substrate_journal_export_lag_entries", ())] == 0
    assert before[("substrate_sandboxes", ())] == 0
    ws = d.adopt(d.make_workspace())
    with d.client() as c, pytest.raises(RpcError) as refused:
        c.call("fs.read", workspace=ws, path="../outside")
    key = ("substrate_refusals_total", (("refusal", str(refused.value.refusal)),))
    wait_until(lambda: metric_samples(port).get(key, 0) >= before.get(key, 0) + 1, 10)
    # A storm of connections that never ask: requests are answered meanwhile.
    storm = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(200)]
    try:
        write_files(d, ws, ["during-storm.txt"])
        with d.client() as c:
            assert c.call("daemon.status")["journal_export"]["state"] in ("shipping", "caught_up")
        open_fds = len(os.listdir(f"/proc/{d.pid}/fd"))
    finally:
        for s in storm:
            s.close()
    assert open_fds < 200  # the ones over the cap were closed, not held
    caught_up(d)
    lag = ("substrate_journal_export_lag_entries", ())
    wait_until(lambda: metric_samples(port)[lag] == 0, 10)  # a page is cached up to 1 s
