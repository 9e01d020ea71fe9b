"""substrate.store.group: concurrent units share a commit, each keeps its own outcome,
and every other transaction comes after what was submitted before it."""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from substrate.schema.fs import WriteParams, write_request
from substrate.store.db import Store
from substrate.store.group import Ticket
from substrate.workspace.writes import Writer
from tests.harness.state import DaemonState

PATIENCE_S = 30.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "db")
    s.ensure_schema("CREATE TABLE IF NOT EXISTS t (v TEXT NOT NULL);")
    commits: list[str] = []
    s._db.set_trace_callback(lambda sql: sql == "COMMIT" and commits.append(sql))
    s.commits = commits  # type: ignore[attr-defined]
    yield s
    s.close()


def insert(value: str) -> Callable[[sqlite3.Connection], str]:
    def work(db: sqlite3.Connection) -> str:
        db.execute("INSERT INTO t(v) VALUES (?)", (value,))
        return value

    return work


def values(store: Store) -> list[str]:
    return [r["v"] for r in store.query("SELECT v FROM t ORDER BY rowid")]


def test_units_submitted_while_a_batch_commits_share_the_next_commit(store: Store) -> None:
    inside, release = threading.Event(), threading.Event()

    def first(db: sqlite3.Connection) -> str:
        db.execute("INSERT INTO t(v) VALUES ('first')")
        inside.set()
        assert release.wait(PATIENCE_S)
        return "first"

    results: dict[str, str] = {}
    leader = threading.Thread(target=lambda: results.update(a=store.group.run(first)))
    leader.start()
    assert inside.wait(PATIENCE_S)  # the first batch is being committed
    tickets: list[Ticket[str]] = [store.group.submit(insert(f"u{i}")) for i in range(5)]
    waiters = [
        threading.Thread(target=lambda t=t: results.update({t.result or "?": store.group.wait(t)}))
        for t in tickets
    ]
    for w in waiters:
        w.start()
    release.set()
    leader.join(PATIENCE_S)
    for w in waiters:
        w.join(PATIENCE_S)
    assert results["a"] == "first" and [t.result for t in tickets] == [f"u{i}" for i in range(5)]
    assert values(store) == ["first", "u0", "u1", "u2", "u3", "u4"]
    assert len(store.commits) == 2  # type: ignore[attr-defined]


def test_a_failing_unit_rolls_back_alone(store: Store) -> None:
    def bad(db: sqlite3.Connection) -> None:
        db.execute("INSERT INTO t(v) VALUES ('bad')")
        raise ValueError("this unit fails")

    ok1 = store.group.submit(insert("ok1"))
    failing = store.group.submit(bad)
    ok2 = store.group.submit(insert("ok2"))
    assert store.group.wait(ok2) == "ok2"  # leads the batch of three
    with pytest.raises(ValueError, match="this unit fails"):
        store.group.wait(failing)
    assert store.group.wait(ok1) == "ok1"
    assert values(store) == ["ok1", "ok2"]
    assert len(store.commits) == 1  # type: ignore[attr-defined]


def test_a_transaction_commits_what_was_submitted_before_it_first(store: Store) -> None:
    ticket = store.group.submit(insert("queued"))
    with store.transaction() as db:
        assert ticket.done  # committed before this transaction began
        db.execute("INSERT INTO t(v) VALUES ('later')")
    assert store.group.wait(ticket) == "queued"
    assert values(store) == ["queued", "later"]


def test_a_write_journaled_in_a_group_stays_before_a_later_entry(
    daemon_state: DaemonState, make_workspace: Callable[..., Path]
) -> None:
    """A write renamed under the commit lock, still waiting for its group commit, when
    another entry is journaled: the write's entry comes first (a checkpoint taken then
    must see the write before it)."""
    store, journal, registry = daemon_state.store, daemon_state.journal, daemon_state.registry
    ws = registry.adopt(str(make_workspace("demo", {"a.txt": "alpha\n"})), None, None, "t")
    writer = Writer(store, journal)
    group = store.group

    class LateWaits:
        def reserve(self) -> Ticket[Any]:
            return group.reserve()

        def drop(self, ticket: Ticket[Any], error: BaseException) -> None:
            group.drop(ticket, error)

        def fill(self, ticket: Ticket[Any], work: Callable[[sqlite3.Connection], Any]) -> None:
            group.fill(ticket, work)

        def wait(self, ticket: Ticket[Any]) -> Any:
            # Another caller journals while this write's unit is still queued.
            assert not ticket.done
            other = threading.Thread(target=journal.append, args=("test.later", {}))
            other.start()
            other.join(PATIENCE_S)
            assert ticket.done  # the other transaction committed it first
            return group.wait(ticket)

    writer._group = LateWaits()  # type: ignore[assignment]
    base = hashlib.sha256(b"alpha\n").hexdigest()
    req = WriteParams(workspace=ws.id, path="a.txt", content="beta\n", base_sha256=base)
    writer.write(ws, write_request(req), "agent:0")
    kinds = [e.kind for e in journal.read()]
    assert kinds[-2:] == ["fs.write", "test.later"]
    assert journal.verify() is None


def test_a_nested_transaction_fails_as_before_and_leaves_the_queue_alone(store: Store) -> None:
    with store.transaction() as db:
        db.execute("INSERT INTO t(v) VALUES ('outer')")
        ticket = store.group.submit(insert("queued"))
        with pytest.raises(sqlite3.OperationalError), store.transaction():
            pass  # never waits for a batch that needs the lock this thread holds
        assert not ticket.done
    assert store.group.wait(ticket) == "queued"
    assert values(store) == ["outer", "queued"]


def test_a_transaction_waits_for_a_place_reserved_before_it_to_be_filled(store: Store) -> None:
    """A write's place taken under its lock, its entry given only after its directory
    fsync: a unit submitted after the place, and a transaction begun meanwhile, commit
    after it; a unit not `ordered` (an intent) goes past it."""
    place = store.group.reserve()
    after = store.group.submit(insert("after"))
    aside = store.group.submit(insert("aside"), ordered=False)
    assert store.group.wait(aside) == "aside" and not after.done and not place.done

    def later() -> None:
        with store.transaction() as db:
            db.execute("INSERT INTO t(v) VALUES ('later')")

    results: list[str] = []
    waiter = threading.Thread(target=lambda: results.append(store.group.wait(after)))
    other = threading.Thread(target=later)
    waiter.start()
    other.start()
    waiter.join(0.2)
    assert waiter.is_alive() and other.is_alive()  # both wait for the place
    assert values(store) == ["aside"]
    store.group.fill(place, insert("place"))
    waiter.join(PATIENCE_S)
    other.join(PATIENCE_S)
    assert results == ["after"] and store.group.wait(place) == "place"
    assert values(store) == ["aside", "place", "after", "later"]


def test_a_dropped_place_fails_its_waiter_and_frees_those_behind_it(store: Store) -> None:
    place = store.group.reserve()
    after = store.group.submit(insert("after"))
    store.group.drop(place, OSError("the directory fsync failed"))
    assert store.group.wait(after) == "after"
    with pytest.raises(OSError, match="directory fsync failed"):
        store.group.wait(place)
    store.group.flush()
    assert values(store) == ["after"]


def test_many_threads_reserving_filling_and_submitting_all_finish_in_lock_order(
    store: Store,
) -> None:
    """Each waiter is woken alone (its batch done, or its turn to lead): 16 threads
    taking places under one lock, filling them later and waiting, with intents going
    past them, all return, and the entries keep the lock's order."""
    lock = threading.Lock()
    order: list[str] = []
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            for i in range(20):
                name = f"w{k}-{i}"
                intent = store.group.submit(insert(f"intent {name}"), ordered=False)
                store.group.wait(intent)
                with lock:
                    place = store.group.reserve()
                    order.append(name)
                store.group.fill(place, insert(name))
                assert store.group.wait(place) == name
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PATIENCE_S * 4)
    assert not any(t.is_alive() for t in threads) and errors == []
    entries = [v for v in values(store) if not v.startswith("intent ")]
    assert entries == order and len(entries) == 16 * 20
    # Shared: fewer commits than units.
    assert len(store.commits) < 2 * 16 * 20  # type: ignore[attr-defined]
