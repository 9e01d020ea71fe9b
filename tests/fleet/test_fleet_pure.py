"""The pure parts of the export and the metrics: the chain check, the table's layout
check, backoff, redaction, the config's refusals, the outcome label."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from substrate.config import ConfigError, load_config
from substrate.export import COLUMNS, ExportSettings, backoff_s, verify_rows
from substrate.export.postgres import describe_dsn, redact, schema_problem
from substrate.metrics import command_outcome, parse_metrics_listen
from substrate.store import Journal, Store

KEYS = [(True, ["node", "epoch", "seq"]), (False, ["node", "seq"])]
GOOD = [(name, kind, name != "workspace") for name, kind in COLUMNS]


def chain(tmp_path: Path, n: int) -> list[tuple[object, ...]]:
    store = Store(tmp_path / "s.db")
    journal = Journal(store)
    for i in range(n):
        journal.append("k", {"i": i, "x": [1.5, None, "é"], "tiny": 1e-7}, workspace="w")
    rows = [
        # As jsonb gives data back: its own spacing and key order.
        (e.epoch, e.seq, e.ts, e.kind, e.workspace, e.actor,
         msgspec.json.encode(dict(reversed(list(e.data.items())))).decode().replace(",", ", "),
         e.prev, e.hash)
        for e in journal.read(limit=n)
    ]  # fmt: skip
    store.close()
    return rows


def test_the_chain_check_takes_jsonb_text_and_finds_the_first_bad_row(tmp_path: Path) -> None:
    rows = chain(tmp_path, 20)
    assert verify_rows(rows) is None
    altered = list(rows)
    assert '"i":12' in str(rows[12][6])
    altered[12] = (*rows[12][:6], rows[12][6].replace('"i":12', '"i":13'), *rows[12][7:])
    assert verify_rows(altered) == 13
    assert verify_rows(rows[:5] + rows[6:]) == 6  # a missing row: its seq
    assert verify_rows(rows[1:]) == 1  # a chain must start at seq 1
    assert verify_rows([(*rows[0][:6], "not json", *rows[0][7:])]) == 1


def test_the_layout_check_names_each_difference() -> None:
    assert schema_problem(GOOD, KEYS) is None
    assert "no column hash" in str(schema_problem(GOOD[:-1], KEYS))
    typed = [(n, "text" if n == "data" else k, nn) for n, k, nn in GOOD]
    assert schema_problem(typed, KEYS) == "substrate_journal.data is text, expected jsonb"
    assert "column extra" in str(schema_problem([*GOOD, ("extra", "text", False)], KEYS))
    nullable = [(n, k, False) for n, k, _ in GOOD]
    assert "allows NULL" in str(schema_problem(nullable, KEYS))
    assert "primary key" in str(schema_problem(GOOD, KEYS[1:]))
    assert "(node, seq)" in str(schema_problem(GOOD, KEYS[:1]))


def test_backoff_doubles_to_its_cap_with_bounded_jitter() -> None:
    assert [backoff_s(n, 30.0, lambda: 0.0) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff_s(50, 30.0, lambda: 0.0) == 30.0
    assert backoff_s(10_000, 30.0, lambda: 1.0) == 22.5


def test_passwords_never_show() -> None:
    assert redact("auth for s3cret failed", ["s3cret", None, ""]) == "auth for *** failed"
    shown = describe_dsn("postgresql://u:hunter2@db.example:5433/fleet?sslmode=require")
    assert "hunter2" not in shown and "host=db.example" in shown and "port=5433" in shown


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "substrate.toml"
    path.write_text(text)
    return path


def test_config_refuses_a_password_in_the_dsn_and_a_public_metrics_address(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="password_secret"):
        load_config(write(tmp_path, '[journal_export]\npostgres_dsn = "host=db password=x"\n'), {})
    with pytest.raises(ConfigError, match="not a libpq DSN"):
        load_config(write(tmp_path, '[journal_export]\npostgres_dsn = "host=db port"\n'), {})
    with pytest.raises(ConfigError, match="batch_entries"):
        load_config(
            write(tmp_path, '[journal_export]\npostgres_dsn = "host=db"\nbatch_entries = 0\n'), {}
        )
    with pytest.raises(ConfigError, match="metrics_allow_remote"):
        load_config(write(tmp_path, 'metrics_listen = "0.0.0.0:9464"\n'), {})
    config = load_config(
        write(tmp_path, 'metrics_listen = "0.0.0.0:9464"\nmetrics_allow_remote = true\n'), {}
    )
    assert config.metrics_listen == "0.0.0.0:9464"
    assert load_config(None, {}).journal_export.postgres_dsn == ""  # off by default
    assert load_config(None, {}).metrics_listen == ""


def test_metrics_listen_parses_loopback_forms() -> None:
    assert parse_metrics_listen("127.0.0.1:9464", allow_remote=False) == ("127.0.0.1", 9464)
    assert parse_metrics_listen("[::1]:0", allow_remote=False) == ("::1", 0)
    assert parse_metrics_listen("localhost:1", allow_remote=False) == ("localhost", 1)
    for bad in ("9464", "host:9464", "127.0.0.1:x", "127.0.0.1:70000"):
        with pytest.raises(ValueError):
            parse_metrics_listen(bad, allow_remote=True)


def test_the_outcome_label() -> None:
    base = {"exit_code": 0, "signal": None, "timed_out": False, "oom_killed": False,
            "cancelled": False}  # fmt: skip
    assert command_outcome(**base) == "ok"
    assert command_outcome(**{**base, "exit_code": 3}) == "failed"
    assert command_outcome(**{**base, "exit_code": 137, "signal": "SIGKILL"}) == "signal"
    assert command_outcome(**{**base, "timed_out": True, "signal": "SIGKILL"}) == "timeout"
    assert command_outcome(**{**base, "oom_killed": True}) == "oom"
    assert command_outcome(**{**base, "exit_code": None}) == "unknown"


def test_the_cursor_is_kept_per_node_and_database_only() -> None:
    def key(dsn: str, node: str = "n1") -> str:
        return ExportSettings(dsn=dsn, node=node).target()

    base = key("host=db port=5432 dbname=fleet user=a")
    assert key("host=db port=5432 dbname=fleet user=b sslmode=require") == base
    assert key("postgresql://c@db:5432/fleet?application_name=x") == base
    assert key("host=db port=5432 dbname=other user=a") != base
    assert key("host=db port=5432 dbname=fleet user=a", node="n2") != base
