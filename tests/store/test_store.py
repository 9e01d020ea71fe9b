"""The state database's tables: each one's SQL lives in exactly one module (its owner),
and the approvals table's accessor behaves as guarded writes rely on."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.store.approvals import Approvals
from substrate.store.db import Store
from tests.harness import PACKAGE_ROOT

PACKAGE = PACKAGE_ROOT / "substrate"
_CREATES = re.compile(r"CREATE TABLE IF NOT EXISTS (\w+)")
_USES = re.compile(r"\b(?:FROM|INTO|UPDATE|JOIN|TABLE)\s+(\w+)")


def test_each_table_is_created_and_used_by_one_module() -> None:
    sources = {path: path.read_text() for path in PACKAGE.rglob("*.py")}
    owners: dict[str, list[Path]] = {}
    for path, text in sources.items():
        for table in _CREATES.findall(text):
            owners.setdefault(table, []).append(path)
    assert {"journal", "approvals", "workspaces", "grants", "artifacts"} <= set(owners)
    strays = []
    for table, where in owners.items():
        assert len(where) == 1, (table, where)
        for path, text in sources.items():
            if path != where[0] and table in _USES.findall(text):
                strays.append((table, str(path.relative_to(PACKAGE))))
    assert strays == []


@pytest.fixture
def approvals(tmp_path: Path) -> Iterator[tuple[Store, Approvals]]:
    store = Store(tmp_path / "db")
    yield store, Approvals(store)
    store.close()


def test_an_approval_is_found_until_consumed(approvals: tuple[Store, Approvals]) -> None:
    store, table = approvals
    with store.transaction() as db:
        first = table.grant_in(db, "ws_a", "d" * 64, expires=200.0)
        second = table.grant_in(db, "ws_a", "d" * 64, expires=100.0)
    # The soonest to expire is used first.
    assert table.find("ws_a", "d" * 64, now=50.0) == second
    with store.transaction() as db:
        table.consume_in(db, second, now=60.0)
    assert table.find("ws_a", "d" * 64, now=60.0) == first
    with store.transaction() as db:
        table.consume_in(db, first, now=61.0)
    assert table.find("ws_a", "d" * 64, now=61.0) is None


def test_an_approval_binds_its_workspace_digest_and_time(
    approvals: tuple[Store, Approvals],
) -> None:
    store, table = approvals
    with store.transaction() as db:
        approval = table.grant_in(db, "ws_a", "d" * 64, expires=100.0)
    assert approval.startswith("apr_")
    assert table.find("ws_b", "d" * 64, now=0.0) is None
    assert table.find("ws_a", "e" * 64, now=0.0) is None
    assert table.find("ws_a", "d" * 64, now=100.0) is None  # expired
    assert table.find("ws_a", "d" * 64, now=99.0) == approval
