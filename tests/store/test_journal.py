"""substrate.store.journal: the hash chain, epochs, tamper detection and the canonical encoding."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from substrate.store.db import Store
from substrate.store.journal import GENESIS, Draft, Entry, Journal, canonical, entry_hash
from tests.harness import DaemonProcess, create_workspace, reuse_inode


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "substrate.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[Store]:
    s = Store(db_path)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def journal(store: Store) -> Journal:
    return Journal(store)


def fill(journal: Journal, n: int) -> list[Entry]:
    return [
        journal.append(
            "test.event", {"i": i, "path": f"r:f{i}"}, workspace="ws_1" if i % 2 else None
        )
        for i in range(n)
    ]


def recompute(e: Entry) -> str:
    return entry_hash(
        seq=e.seq,
        epoch=e.epoch,
        ts=e.ts,
        kind=e.kind,
        workspace=e.workspace,
        actor=e.actor,
        data=e.data,
        prev=e.prev,
    )


# --- the chain ------------------------------------------------------------------------------


def test_entries_form_a_chain(journal: Journal) -> None:
    entries = fill(journal, 5)
    assert [e.seq for e in entries] == [1, 2, 3, 4, 5]
    assert entries[0].prev == GENESIS
    for before, after in itertools.pairwise(entries):
        assert after.prev == before.hash
    for e in entries:
        assert e.hash == recompute(e)
        assert e.epoch == journal.epoch == 1
    assert journal.read() == entries
    assert journal.verify() is None


def test_empty_journal_verifies(journal: Journal) -> None:
    assert journal.read() == []
    assert journal.verify() is None


def test_hash_is_sha256_of_prev_and_canonical_body(journal: Journal) -> None:
    e = journal.append("k", {"b": 2, "a": [1, "x"]}, workspace="ws_9", actor="agent:1000")
    body = {
        "actor": "agent:1000",
        "data": {"a": [1, "x"], "b": 2},
        "epoch": e.epoch,
        "kind": "k",
        "prev": GENESIS,
        "seq": 1,
        "ts": e.ts,
        "workspace": "ws_9",
    }
    expected = hashlib.sha256(GENESIS.encode() + msgspec.json.encode(body, order="sorted"))
    assert e.hash == expected.hexdigest()


def test_data_structs_are_stored_as_plain_json(journal: Journal) -> None:
    class Thing(msgspec.Struct):
        x: int
        y: list[str]

    e = journal.append("k", {"thing": Thing(1, ["a"])})
    assert e.data == {"thing": {"x": 1, "y": ["a"]}}
    assert journal.read()[0].data == {"thing": {"x": 1, "y": ["a"]}}
    assert journal.verify() is None


def test_epoch_increments_across_reopen(db_path: Path) -> None:
    for expected in (1, 2, 3):
        store = Store(db_path)
        try:
            journal = Journal(store)
            assert journal.epoch == expected
            journal.append("daemon.started", {})
        finally:
            store.close()
    store = Store(db_path)
    try:
        journal = Journal(store)
        entries = journal.read()
        assert [(e.seq, e.epoch) for e in entries] == [(1, 1), (2, 2), (3, 3)]
        assert journal.verify() is None  # the chain runs across epochs
    finally:
        store.close()


def test_append_in_commits_with_the_callers_transaction(store: Store, journal: Journal) -> None:
    first = journal.append("k", {"n": 1})
    with pytest.raises(RuntimeError), store.transaction() as db:
        journal.append_in(db, "k", {"n": 2})
        raise RuntimeError("the change failed")
    assert journal.read() == [first]
    with store.transaction() as db:
        second = journal.append_in(db, "k", {"n": 3})
    assert second.seq == 2 and second.prev == first.hash
    assert journal.verify() is None


def test_append_many_in_chains_each_entry_in_one_transaction(
    store: Store, journal: Journal
) -> None:
    first = journal.append("k", {"n": 0})
    drafts = [
        Draft("changes.apply", {"path": f"r:f{i}", "n": i}, "ws_1", "agent:0") for i in range(5)
    ]
    with pytest.raises(RuntimeError), store.transaction() as db:
        journal.append_many_in(db, drafts)
        raise RuntimeError("the batch failed")
    assert journal.read() == [first]  # rolled back with the caller's transaction
    with store.transaction() as db:
        assert journal.append_many_in(db, []) == []
        batch = journal.append_many_in(db, drafts)
    assert journal.read() == [first, *batch]
    assert [e.seq for e in batch] == [2, 3, 4, 5, 6]
    assert [e.prev for e in batch] == [first.hash, *(e.hash for e in batch[:-1])]
    assert all(recompute(e) == e.hash for e in batch)
    assert [(e.kind, e.workspace, e.actor, e.data["n"]) for e in batch] == [
        ("changes.apply", "ws_1", "agent:0", i) for i in range(5)
    ]
    assert journal.append("k", {"n": 9}).prev == batch[-1].hash
    assert journal.verify() is None


def test_read_filters(journal: Journal) -> None:
    entries = fill(journal, 10)
    assert journal.read(since=7) == entries[7:]
    assert journal.read(limit=3) == entries[:3]
    assert journal.read(since=2, limit=2) == entries[2:4]
    assert journal.read(workspace="ws_1") == [e for e in entries if e.workspace == "ws_1"]
    journal.append("other.kind", {})
    assert [e.kind for e in journal.read(kinds=["other.kind"])] == ["other.kind"]
    assert journal.read(kinds=[]) == []


# --- tampering ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("data", '{"i":2,"path":"r:evil"}'),
        ("kind", "test.other"),
        ("workspace", "ws_2"),
        ("actor", "operator:0"),
        ("epoch", 7),
        ("ts", 1.0),
        ("hash", "f" * 64),
        ("prev", "e" * 64),
    ],
)
def test_verify_finds_an_edited_row(
    store: Store, journal: Journal, column: str, value: object
) -> None:
    fill(journal, 6)
    with store.transaction() as db:
        db.execute(f"UPDATE journal SET {column} = ? WHERE seq = 3", (value,))
    assert journal.verify() == 3


def test_verify_finds_a_deleted_row(store: Store, journal: Journal) -> None:
    fill(journal, 6)
    with store.transaction() as db:
        db.execute("DELETE FROM journal WHERE seq = 3")
    assert journal.verify() == 4


def test_verify_finds_a_deleted_first_row(store: Store, journal: Journal) -> None:
    fill(journal, 3)
    with store.transaction() as db:
        db.execute("DELETE FROM journal WHERE seq = 1")
    assert journal.verify() == 2


def test_rehashing_the_edited_row_is_found_at_the_next(store: Store, journal: Journal) -> None:
    """An editor who also fixes the row's own hash breaks the next row's `prev`."""
    entries = fill(journal, 6)
    e = entries[2]
    forged = Entry(
        seq=e.seq,
        epoch=e.epoch,
        ts=e.ts,
        kind=e.kind,
        workspace=e.workspace,
        actor=e.actor,
        data={"i": 2, "path": "r:evil"},
        prev=e.prev,
        hash="",
    )
    with store.transaction() as db:
        db.execute(
            "UPDATE journal SET data = ?, hash = ? WHERE seq = 3",
            (canonical(forged.data).decode(), recompute(forged)),
        )
    assert journal.verify() == 4


def test_inserted_row_is_found(store: Store, journal: Journal) -> None:
    fill(journal, 4)
    with store.transaction() as db:
        db.execute("UPDATE journal SET seq = seq + 10 WHERE seq >= 3")
        db.execute("UPDATE journal SET seq = seq - 9 WHERE seq >= 13")
    # Rows are now 1, 2, 4, 5: the gap at 3 is found at 4.
    assert journal.verify() == 4


def test_verify_pages_through_long_journals(store: Store, journal: Journal) -> None:
    with store.transaction() as db:
        for i in range(5003):
            journal.append_in(db, "bulk", {"i": i})
    assert journal.verify() is None
    with store.transaction() as db:
        db.execute("UPDATE journal SET actor = 'x' WHERE seq = 5002")
    assert journal.verify() == 5002


# --- canonical encoding ---------------------------------------------------------------------


def test_canonical_is_sorted_compact_utf8() -> None:
    assert canonical({"b": 1, "a": {"d": [3, 1], "c": None}}) == b'{"a":{"c":null,"d":[3,1]},"b":1}'
    assert canonical({"é": "ü\n"}) == '{"é":"ü\\n"}'.encode()
    assert canonical([True, 1.5, "x"]) == b'[true,1.5,"x"]'


def test_canonical_ignores_insertion_order() -> None:
    one = {"z": 1, "a": {"y": 2, "b": 3}}
    two = {"a": {"b": 3, "y": 2}, "z": 1}
    assert canonical(one) == canonical(two)


def test_entry_hash_is_stable() -> None:
    """A golden value: changing the canonical encoding would orphan every existing journal."""
    digest = entry_hash(
        seq=1,
        epoch=1,
        ts=1700000000.123456,
        kind="fs.write",
        workspace="ws_0123456789abcdef",
        actor="agent:1000",
        data={"path": "demo:a.txt", "size": 3, "new_sha256": "ab" * 32},
        prev=GENESIS,
    )
    literal = (
        b'{"actor":"agent:1000","data":{"new_sha256":"'
        + b"ab" * 32
        + b'","path":"demo:a.txt","size":3},"epoch":1,"kind":"fs.write","prev":"'
        + GENESIS.encode()
        + b'","seq":1,"ts":1700000000.123456,"workspace":"ws_0123456789abcdef"}'
    )
    assert digest == hashlib.sha256(GENESIS.encode() + literal).hexdigest()
    assert digest == "8d184a88f518d39231da19dea4988c6e847bfb980c95896a215150f9b72014ec"


def test_replay_of_a_new_directory_at_a_workspace_path_lists_none_of_the_old_writes(
    daemon: DaemonProcess, quiet_root: Path
) -> None:
    """The daemon stopped, the checkout was removed and another directory made at its path
    (with the old inode, as ext4 gives it): the persisted workspace is not re-bound to
    it, so the new checkout's replay holds none of the old one's writes."""
    workspace_dir = create_workspace(quiet_root, "proj")
    c = daemon.client()
    ws = daemon.adopt(workspace_dir)
    for i in range(5):
        c.call("fs.write", workspace=ws, path=f"w{i}.txt", content="old\n", base_sha256=None)
    assert len(c.call("journal.replay", workspace=ws)["files"]) == 5
    daemon.stop()
    fresh = reuse_inode(workspace_dir, workspace_dir.parent, "fresh")
    fresh.rename(workspace_dir)
    (workspace_dir / "w0.txt").write_text("new\n")
    daemon.start()
    c = daemon.client()
    assert c.call("workspace.list")["workspaces"] == []
    again = daemon.adopt(workspace_dir)
    assert again != ws
    replay = c.call("journal.replay", workspace=again)
    assert (replay["files"], replay["drifted"]) == ([], 0)
