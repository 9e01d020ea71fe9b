"""`substrate.process.records` without Docker: what the journal keeps of an argv, a
finished record that reads back as its first reply (facts, policy_blocked), and the
records of runs over the fake engine (started, exited, lost)."""

from __future__ import annotations

import dataclasses
import hashlib
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from fake_execution import Layer, fake_layer

from substrate.errors import RuntimeUnavailable
from substrate.process.records import Outcome, ProcessRecords, argv_summary
from substrate.sandbox.engine import ContainerGone
from substrate.sandbox.facts import make_fact
from substrate.schema.artifact import OutputRef
from substrate.schema.proc import EgressBlocked, PolicyBlocked
from substrate.store.db import Store
from substrate.store.journal import Journal

SECRET = "sk-live-0f9e8d7c6b5a4938"
FACTS = [
    make_fact("uid", 1000, source="kernel:proc-status", observed_at=1.0),
    make_fact("readonly_dirs", [".git"], source="kernel:mountinfo", observed_at=1.0),
]
BLOCKED = [PolicyBlocked(path="p:x.lock", change="create", reverted=True)]
OUTCOME = Outcome(
    exit_code=0,
    signal=None,
    timed_out=False,
    oom_killed=False,
    duration_ms=1.0,
    reaped=0,
    killed=0,
)


def output(text: str) -> OutputRef:
    return OutputRef(
        bytes=len(text),
        sha256=hashlib.sha256(text.encode()).hexdigest(),
        truncated=False,
        encoding="utf-8",
        inline=text,
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    made = Store(tmp_path / "substrate.db")
    try:
        yield made
    finally:
        made.close()


def run_one(records: ProcessRecords, proc: str, argv: list[str]) -> None:
    records.started(
        workspace="w",
        proc=proc,
        profile="tiny",
        argv=argv,
        cwd=".",
        container="c" * 64,
        actor="test",
        facts=FACTS,
    )
    records.exited(
        workspace="w",
        proc=proc,
        outcome=OUTCOME,
        stdout=output("hi\n"),
        stderr=output(""),
        blocked=BLOCKED,
        actor="test",
    )


def test_argv_summary_keeps_no_argument_text() -> None:
    argv = ["python3", "-c", f"print('{SECRET}')"]
    summary = argv_summary(argv)
    assert summary == {
        "argv0": "python3",
        "argc": 3,
        "argv_sha256": hashlib.sha256(msgspec.json.encode(argv)).hexdigest(),
    }
    assert len(argv_summary(["x" * 10_000])["argv0"]) == 256


def test_a_finished_record_reads_back_as_its_first_reply(store: Store) -> None:
    journal = Journal(store)
    records = ProcessRecords(store, journal)
    run_one(records, "p_1", ["sh", "-c", f"echo {SECRET}"])
    run_one(records, "p_2", ["true"])
    row = records.get("p_1")
    assert row is not None
    assert (row.argv, row.facts, row.policy_blocked) == (
        ["sh", "-c", f"echo {SECRET}"],
        FACTS,
        BLOCKED,
    )
    assert [r.facts for r in records.recent("w", 10)] == [FACTS, FACTS]
    with sqlite3.connect(store.path) as db:
        assert db.execute("SELECT count(*) FROM fact_sets").fetchone() == (1,)  # shared
        journal_text = [data for (data,) in db.execute("SELECT data FROM journal")]
    assert journal_text and not [d for d in journal_text if SECRET in d]
    (started,) = [e for e in journal.read() if e.kind == "proc.started" and e.data["proc"] == "p_1"]
    assert (started.data["argv0"], started.data["argc"]) == ("sh", 3)


def test_a_database_of_the_first_release_gains_the_new_columns(
    store: Store, tmp_path: Path
) -> None:
    # The `processes` table as the first release made it: no facts, no policy_blocked.
    store.ensure_schema(
        """CREATE TABLE processes (id TEXT PRIMARY KEY, workspace TEXT NOT NULL,
        profile TEXT NOT NULL, argv TEXT NOT NULL, cwd TEXT NOT NULL, container TEXT,
        state TEXT NOT NULL, exit_code INTEGER, signal TEXT, timed_out INTEGER,
        oom_killed INTEGER, started REAL NOT NULL, ended REAL, duration_ms REAL,
        stdout TEXT, stderr TEXT, artifacts TEXT, epoch INTEGER NOT NULL);
        INSERT INTO processes(id, workspace, profile, argv, cwd, state, started, epoch)
        VALUES ('p_old', 'w', 'tiny', '["true"]', '.', 'exited', 1.0, 1);"""
    )
    records = ProcessRecords(store, Journal(store))
    old = records.get("p_old")
    assert old is not None and (old.facts, old.policy_blocked) == ([], [])
    run_one(records, "p_new", ["true"])
    new = records.get("p_new")
    assert new is not None and (new.facts, new.policy_blocked) == (FACTS, BLOCKED)


def test_an_egress_commands_refusals_are_kept_and_counted_in_the_journal(store: Store) -> None:
    journal = Journal(store)
    records = ProcessRecords(store, journal)
    run_one(records, "p_plain", ["true"])
    records.started(
        workspace="w",
        proc="p_eg",
        profile="setup",
        argv=["true"],
        cwd=".",
        container="c",
        actor="test",
        facts=FACTS,
    )
    blocked = EgressBlocked(count=3, hosts=["blocked.invalid:80", "other.invalid:443"])
    records.exited(
        workspace="w",
        proc="p_eg",
        outcome=dataclasses.replace(OUTCOME, egress_blocked=blocked),
        stdout=output(""),
        stderr=output(""),
        blocked=[],
        actor="test",
    )
    row, plain = records.get("p_eg"), records.get("p_plain")
    assert row is not None and row.egress_blocked == blocked
    assert plain is not None and plain.egress_blocked is None
    exited = {e.data["proc"]: e.data for e in journal.read() if e.kind == "proc.exited"}
    assert exited["p_eg"]["egress_blocked"] == 3
    assert "egress_blocked" not in exited["p_plain"]


# -- records of runs over the fake engine ---------------------------------------------------


@pytest.fixture
def layer(adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]) -> Iterator[Layer]:
    root = make_workspace("records", {"a.txt": "a\n"})
    with fake_layer(root, tmp_path / "state", adopt_root) as made:
        yield made


async def test_a_run_commits_its_start_and_its_outcome(layer: Layer) -> None:
    argv = ["echo", SECRET]
    result = await layer.processes.run(layer.request(argv, "box", actor="agent:t"))
    row = layer.records.get(result.proc)
    assert row is not None
    assert (row.state, row.argv, row.exit_code, row.stdout, row.facts) == (
        "exited",
        argv,
        0,
        result.stdout,
        result.facts,
    )
    (started,) = layer.kinds("proc.started")
    (exited,) = layer.kinds("proc.exited")
    assert started["argv_sha256"] == argv_summary(argv)["argv_sha256"]
    assert exited["stdout"] == {
        "bytes": len(SECRET) + 1,
        "sha256": result.stdout.sha256,
        "truncated": False,
    }
    assert not [e for e in layer.journal.read(limit=1000) if SECRET in str(e.data)]
    actors = {e.kind: e.actor for e in layer.journal.read(limit=1000)}
    assert (actors["proc.facts"], actors["proc.started"], actors["proc.exited"]) == (
        "daemon",
        "agent:t",
        "agent:t",
    )


async def test_an_exec_that_never_started_is_recorded_lost(layer: Layer) -> None:
    layer.engine.fail_next("exec_start", ContainerGone("gone"))
    with pytest.raises(RuntimeUnavailable):
        await layer.processes.run(layer.request(["true"], "box"))
    (row,) = layer.records.recent(layer.ws.id, 10)
    assert (row.state, row.exit_code, row.stdout) == ("lost", None, None)
    assert [d["proc"] for d in layer.kinds("proc.lost")] == [row.id]


def test_running_records_of_an_earlier_run_become_lost_at_start(store: Store) -> None:
    journal = Journal(store)
    records = ProcessRecords(store, journal)
    records.started(
        workspace="w",
        proc="p_1",
        profile="tiny",
        argv=["sleep"],
        cwd=".",
        container="c" * 64,
        actor="test",
    )
    run_one(records, "p_2", ["true"])
    assert records.mark_lost(journal.epoch) == 0  # this run's own are left alone
    assert records.mark_lost(journal.epoch + 1) == 1
    lost, done = records.get("p_1"), records.get("p_2")
    assert lost is not None and done is not None
    assert (lost.state, lost.ended, done.state) == ("lost", None, "exited")
    assert [e.data for e in journal.read() if e.kind == "proc.lost"] == [{"proc": "p_1"}]
