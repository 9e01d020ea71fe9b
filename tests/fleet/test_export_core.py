"""substrate.export against a real PostgreSQL: batches in order, exactly once, resumable,
conflicts and an altered table named, bounded batches, the chain verified from SQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.export import (
    ChainCheck,
    Cursors,
    Exporter,
    ExportError,
    ExportSettings,
    JournalSource,
    open_target,
)
from substrate.store import Journal, Store
from tests.harness.postgres import PostgresServer


class Node:
    """A state database with a journal, and an exporter of it under `name`."""

    def __init__(self, base: Path, pg: PostgresServer, name: str, batch: int = 100) -> None:
        self.path = base / "substrate.db"
        self.store = Store(self.path)
        self.journal = Journal(self.store)
        self.source = JournalSource(self.path, name)
        self.settings = ExportSettings(
            dsn=pg.dsn, node=name, password=lambda: pg.password, batch_entries=batch
        )
        self.exporter = Exporter(self.settings, self.source, Cursors(self.store.transaction))

    def fill(self, n: int) -> None:
        for i in range(n):
            self.journal.append(
                "test.event", {"i": i, "f": i / 7, "path": f"d/é{i}"}, workspace="w"
            )

    def close(self) -> None:
        self.exporter.close()
        self.source.close()
        self.store.close()


@pytest.fixture
def node(
    tmp_path: Path, postgres: PostgresServer, request: pytest.FixtureRequest
) -> Iterator[Node]:
    made = Node(tmp_path, postgres, request.node.name[:60])
    yield made
    made.close()


def rows_of(pg: PostgresServer, node: str) -> list[tuple[int, str]]:
    return [(int(s), str(h)) for s, h in pg.query(
        "SELECT seq, hash FROM substrate_journal WHERE node = %s ORDER BY seq", (node,)
    )]  # fmt: skip


def local_rows(n: Node) -> list[tuple[int, str]]:
    return [(e.seq, e.hash) for e in n.journal.read(limit=1_000_000)]


def verify_pg(pg: PostgresServer, node: str) -> int | None:
    target = open_target(pg.dsn, password=pg.password, create=False)
    try:
        check, after = ChainCheck(), 0
        while rows := target.chain(node, after, 97):
            if check.feed(rows) is not None:
                break
            after = rows[-1][1]
        return check.first_bad
    finally:
        target.close()


def test_entries_land_in_order_once_and_the_chain_verifies(
    node: Node, postgres: PostgresServer
) -> None:
    node.fill(450)
    assert node.exporter.ship_all() == 450
    assert rows_of(postgres, node.settings.node) == local_rows(node)
    assert verify_pg(postgres, node.settings.node) is None
    # The cursor was kept: a new exporter resumes after the last seq and ships nothing.
    again = Exporter(node.settings, node.source, Cursors(node.store.transaction))
    assert again.ship_all() == 0
    node.fill(5)
    assert again.ship_all() == 5
    assert rows_of(postgres, node.settings.node) == local_rows(node)


def test_a_batch_shipped_again_is_inserted_once(node: Node, postgres: PostgresServer) -> None:
    """A crash between PostgreSQL's commit and the cursor's: the cursor is behind."""
    node.fill(250)
    node.exporter.ship_all()
    node.exporter.cursors.save(node.settings.target(), 0, 0.0)
    node.fill(3)
    assert node.exporter.ship_all() == 253  # read again from 0: every batch resent
    ((count, distinct),) = postgres.query(
        "SELECT count(*), count(DISTINCT seq) FROM substrate_journal WHERE node = %s",
        (node.settings.node,),
    )
    assert count == distinct == 253
    assert verify_pg(postgres, node.settings.node) is None


def test_rows_postgres_lost_are_shipped_again(node: Node, postgres: PostgresServer) -> None:
    node.fill(120)
    node.exporter.ship_all()
    postgres.query(
        "DELETE FROM substrate_journal WHERE node = %s AND seq > 40", (node.settings.node,)
    )
    node.exporter.ship_all()
    assert rows_of(postgres, node.settings.node) == local_rows(node)


def test_a_different_row_at_our_seq_is_a_conflict_and_nothing_of_the_batch_lands(
    node: Node, postgres: PostgresServer
) -> None:
    node.fill(30)
    node.exporter.ship_all()
    postgres.query(
        "UPDATE substrate_journal SET data = jsonb_set(data, '{i}', '1000') WHERE node = %s"
        " AND seq = 17", (node.settings.node,),
    )  # fmt: skip
    postgres.query(
        "DELETE FROM substrate_journal WHERE node = %s AND seq > 20", (node.settings.node,)
    )
    node.exporter.cursors.save(node.settings.target(), 0, 0.0)
    with pytest.raises(ExportError) as caught:
        node.exporter.ship_all()
    assert caught.value.kind == "conflict" and caught.value.seq == 17
    assert len(rows_of(postgres, node.settings.node)) == 20  # the batch rolled back whole


def test_verify_finds_the_first_altered_row(node: Node, postgres: PostgresServer) -> None:
    node.fill(300)
    node.exporter.ship_all()
    name = node.settings.node
    postgres.query(
        "UPDATE substrate_journal SET ts = ts + 1 WHERE node = %s AND seq = 211", (name,)
    )
    assert verify_pg(postgres, name) == 211
    postgres.query("UPDATE substrate_journal SET kind = 'x' WHERE node = %s AND seq = 150", (name,))
    assert verify_pg(postgres, name) == 150
    postgres.query("DELETE FROM substrate_journal WHERE node = %s AND seq = 99", (name,))
    assert verify_pg(postgres, name) == 99


def test_batches_are_bounded_in_entries_and_bytes(tmp_path: Path) -> None:
    store = Store(tmp_path / "substrate.db")
    journal = Journal(store)
    for i in range(50):
        journal.append("big", {"blob": "x" * 100_000, "i": i})
    source = JournalSource(tmp_path / "substrate.db", "n")
    try:
        assert len(source.batch(0, 1000, max_bytes=1 << 20)) == 11  # past 1 MiB, then stop
        assert len(source.batch(0, 7)) == 7
        assert [r[2] for r in source.batch(48, 1000)] == [49, 50]
        assert source.head() == 50
    finally:
        source.close()
        store.close()


def test_a_table_someone_altered_is_named(postgres: PostgresServer, tmp_path: Path) -> None:
    """Its own database, so the shared table is not disturbed."""
    postgres.query("DROP DATABASE IF EXISTS altered")
    postgres.query("CREATE DATABASE altered")
    dsn = postgres.dsn.replace("dbname=postgres", "dbname=altered")
    open_target(dsn, password=postgres.password).close()  # made by us
    with postgres.connect(dbname="altered") as conn:
        conn.execute("ALTER TABLE substrate_journal ALTER COLUMN data TYPE text")
    with pytest.raises(ExportError) as caught:
        open_target(dsn, password=postgres.password)
    assert caught.value.kind == "schema_mismatch"
    assert "substrate_journal.data is text, expected jsonb" in str(caught.value)
    with postgres.connect(dbname="altered") as conn:
        conn.execute("UPDATE substrate_schema SET version = 7")
    with pytest.raises(ExportError, match="version 7"):
        open_target(dsn, password=postgres.password)


def test_a_wrong_password_is_unreachable_and_never_quoted(postgres: PostgresServer) -> None:
    with pytest.raises(ExportError) as caught:
        open_target(postgres.dsn, password="not-the-password-4711", timeout_s=3)
    assert caught.value.kind == "unreachable"
    assert "not-the-password-4711" not in str(caught.value)
    assert "password authentication failed" in str(caught.value)


def test_the_dsns_own_options_are_kept(postgres: PostgresServer, tmp_path: Path) -> None:
    postgres.query("CREATE SCHEMA IF NOT EXISTS fleet_options")
    dsn = postgres.dsn + " options='-c search_path=fleet_options'"
    store = Store(tmp_path / "substrate.db")
    Journal(store).append("k", {"i": 1})
    source = JournalSource(tmp_path / "substrate.db", "node-options")
    settings = ExportSettings(dsn=dsn, node="node-options", password=lambda: postgres.password)
    try:
        assert Exporter(settings, source, Cursors(store.transaction)).ship_all() == 1
    finally:
        source.close()
        store.close()
    assert postgres.query("SELECT node FROM fleet_options.substrate_journal") == [("node-options",)]


def test_an_entry_postgres_cannot_hold_stops_the_export_there(
    node: Node, postgres: PostgresServer
) -> None:
    node.fill(3)
    node.journal.append("test.event", {"text": "a\x00b"})
    node.fill(2)
    with pytest.raises(ExportError) as caught:
        node.exporter.ship_all()
    assert caught.value.kind == "unstorable"
    assert rows_of(postgres, node.settings.node) == []  # its batch: nothing skipped past it
    node.settings = ExportSettings(
        dsn=postgres.dsn, node=node.settings.node, password=lambda: postgres.password,
        batch_entries=1,
    )  # fmt: skip
    exporter = Exporter(node.settings, node.source, Cursors(node.store.transaction))
    with pytest.raises(ExportError):
        exporter.ship_all()
    assert [s for s, _ in rows_of(postgres, node.settings.node)] == [1, 2, 3]


def test_a_role_with_select_and_insert_only_ships_to_tables_made_for_it(
    node: Node, postgres: PostgresServer
) -> None:
    open_target(postgres.dsn, password=postgres.password).close()  # an administrator's
    postgres.query("DROP ROLE IF EXISTS shipper_only")
    postgres.query("CREATE ROLE shipper_only LOGIN PASSWORD 'pw-shipper-only'")
    postgres.query("GRANT SELECT, INSERT ON substrate_journal TO shipper_only")
    postgres.query("GRANT SELECT ON substrate_schema TO shipper_only")
    node.settings = ExportSettings(
        dsn=postgres.dsn.replace("user=postgres", "user=shipper_only"),
        node=node.settings.node,
        password=lambda: "pw-shipper-only",
    )
    exporter = Exporter(node.settings, node.source, Cursors(node.store.transaction))
    node.fill(5)
    assert exporter.ship_all() == 5
    assert len(rows_of(postgres, node.settings.node)) == 5
