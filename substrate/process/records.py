"""Durable records of commands: the `processes` table and their journal entries.

One row per command (`running` → `exited`, or `lost` when its daemon died or the run
broke), written in the same transaction as its `proc.started` / `proc.exited` /
`proc.lost` journal entry, so the table and the journal never disagree. Neither holds
output bytes: only outcomes, sizes, digests and artifact ids. The full argv (which can
hold a prompt or an inline script) is in the row only; the journal gets `argv0`, `argc`
and `argv_sha256` (docs/protocol.md §8).

A finished row also keeps what its first reply carried, so a result reads the same
whenever it is read: the `policy_blocked` list, its `usage`, and the confinement facts
of the sandbox it ran in. Facts are the same for every command of one container, so they are
stored once per distinct set (`fact_sets`, keyed by the SHA-256 of their encoding) and
the row names the set.

Blocking (SQLite): async callers use `trio.to_thread.run_sync`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from substrate.sandbox.facts import Fact
from substrate.schema.artifact import OutputRef
from substrate.schema.proc import EgressBlocked, PolicyBlocked, ProcChanges, Usage
from substrate.store.db import Store
from substrate.store.journal import Journal

SCHEMA = """
CREATE TABLE IF NOT EXISTS processes (
    id TEXT PRIMARY KEY,
    workspace TEXT NOT NULL,
    profile TEXT NOT NULL,
    argv TEXT NOT NULL,
    cwd TEXT NOT NULL,
    container TEXT,
    state TEXT NOT NULL,
    exit_code INTEGER,
    signal TEXT,
    timed_out INTEGER,
    oom_killed INTEGER,
    started REAL NOT NULL,
    ended REAL,
    duration_ms REAL,
    stdout TEXT,
    stderr TEXT,
    artifacts TEXT,
    epoch INTEGER NOT NULL,
    facts TEXT,
    policy_blocked TEXT,
    changes TEXT,
    egress_blocked TEXT,
    via TEXT,
    exec_facts TEXT,
    usage TEXT
);
CREATE INDEX IF NOT EXISTS processes_workspace ON processes(workspace, started);
CREATE TABLE IF NOT EXISTS fact_sets (
    digest TEXT PRIMARY KEY,
    facts TEXT NOT NULL
);
"""
#: Columns added after the first release (`Store.ensure_columns` adds them to old files).
ADDED_COLUMNS = {
    "facts": "TEXT",
    "policy_blocked": "TEXT",
    "changes": "TEXT",
    "egress_blocked": "TEXT",
    "via": "TEXT",
    "exec_facts": "TEXT",
    "usage": "TEXT",
}
#: The longest argv[0] the journal keeps (the rest is in the digest).
MAX_ARGV0_CHARS = 256


@dataclass(frozen=True)
class ProcRow:
    """One `processes` row as stored (output refs decoded; None while running or lost)."""

    id: str
    workspace: str
    profile: str
    argv: list[str]
    cwd: str
    state: str  # running | exited | lost
    started: float
    ended: float | None
    exit_code: int | None
    signal: str | None
    timed_out: bool
    oom_killed: bool
    duration_ms: float | None
    stdout: OutputRef | None
    stderr: OutputRef | None
    epoch: int
    facts: list[Fact]  # of the sandbox it ran in ([] for rows older than this column)
    policy_blocked: list[PolicyBlocked]
    changes: ProcChanges | None = None  # a "layer" profile's applied change set
    egress_blocked: EgressBlocked | None = None  # an "egress" profile's refused connections
    via: Literal["supervisor", "engine"] | None = None  # None: rows older than this column
    exec_facts: list[Fact] = field(default_factory=list)  # its own process's (fast exec)
    usage: Usage | None = None  # its CPU and memory (None: not measured, or an older row)


def _ref(raw: object) -> OutputRef | None:
    if not isinstance(raw, str) or not raw:
        return None
    return msgspec.json.decode(raw, type=OutputRef)


def _decoded(raw: object, kind: type[list[Fact]] | type[list[PolicyBlocked]]) -> Any:
    if not isinstance(raw, str) or not raw:
        return []
    return msgspec.json.decode(raw, type=kind)


def _row(r: Any) -> ProcRow:
    return ProcRow(
        id=str(r["id"]),
        workspace=str(r["workspace"]),
        profile=str(r["profile"]),
        argv=msgspec.json.decode(r["argv"], type=list[str]),
        cwd=str(r["cwd"]),
        state=str(r["state"]),
        started=float(r["started"]),
        ended=None if r["ended"] is None else float(r["ended"]),
        exit_code=None if r["exit_code"] is None else int(r["exit_code"]),
        signal=None if r["signal"] is None else str(r["signal"]),
        timed_out=bool(r["timed_out"]),
        oom_killed=bool(r["oom_killed"]),
        duration_ms=None if r["duration_ms"] is None else float(r["duration_ms"]),
        stdout=_ref(r["stdout"]),
        stderr=_ref(r["stderr"]),
        epoch=int(r["epoch"]),
        facts=_decoded(r["fact_list"], list[Fact]),
        policy_blocked=_decoded(r["policy_blocked"], list[PolicyBlocked]),
        changes=msgspec.json.decode(r["changes"], type=ProcChanges) if r["changes"] else None,
        egress_blocked=(
            msgspec.json.decode(r["egress_blocked"], type=EgressBlocked)
            if r["egress_blocked"]
            else None
        ),
        via="supervisor" if r["via"] == "supervisor" else "engine" if r["via"] else None,
        exec_facts=_decoded(r["exec_facts"], list[Fact]),
        usage=msgspec.json.decode(r["usage"], type=Usage) if r["usage"] else None,
    )


_ROW_SELECT = (
    "SELECT p.id, p.workspace, p.profile, p.argv, p.cwd, p.state, p.started, p.ended,"
    " p.exit_code, p.signal, p.timed_out, p.oom_killed, p.duration_ms, p.stdout, p.stderr,"
    " p.epoch, p.policy_blocked, p.changes, p.egress_blocked, p.via, p.exec_facts,"
    " p.usage, f.facts AS fact_list"
    " FROM processes p LEFT JOIN fact_sets f ON f.digest = p.facts"
)


def argv_summary(argv: Sequence[str]) -> dict[str, Any]:
    """What the journal keeps of an argv: `argv0` (at most 256 characters), `argc`, and
    `argv_sha256`, the SHA-256 of the argv as a compact JSON array in UTF-8 (msgspec's
    encoding: non-ASCII characters as themselves). Pure."""
    return {
        "argv0": argv[0][:MAX_ARGV0_CHARS] if argv else "",
        "argc": len(argv),
        "argv_sha256": hashlib.sha256(msgspec.json.encode(list(argv))).hexdigest(),
    }


@dataclass(frozen=True)
class Outcome:
    """How a command ended, as recorded."""

    exit_code: int | None
    signal: str | None
    timed_out: bool
    oom_killed: bool
    duration_ms: float
    reaped: int  # processes of the command signalled after it ended or timed out
    killed: int  # of those, how many needed KILL
    cancelled: bool = False  # its run was cut off (caller gone, daemon stopping): killed
    egress_blocked: EgressBlocked | None = None  # an egress sandbox's refused connections
    via: Literal["supervisor", "engine"] | None = None  # how it was started (docs/fast-exec.md)
    #: Its own process's confinement as the host saw it before it ran (fast exec only).
    exec_facts: Sequence[Fact] = ()
    usage: Usage | None = None  # its CPU and memory (`process.usage`)


def ref_summary(ref: OutputRef) -> dict[str, Any]:
    """What the journal keeps of an output: size, digest, artifact id; never bytes."""
    out: dict[str, Any] = {"bytes": ref.bytes, "sha256": ref.sha256, "truncated": ref.truncated}
    if ref.artifact is not None:
        out["artifact"] = ref.artifact
    return out


class ProcessRecords:
    """The `processes` table and the `proc.*` journal entries."""

    def __init__(self, store: Store, journal: Journal) -> None:
        self._store = store
        self._journal = journal
        store.ensure_schema(SCHEMA)
        store.ensure_columns("processes", ADDED_COLUMNS)

    def mark_lost(self, epoch: int) -> int:
        """At start: rows still `running` from an earlier daemon run become `lost`."""
        with self._store.transaction() as db:
            rows = db.execute(
                "SELECT id, workspace FROM processes WHERE state = 'running' AND epoch < ?",
                (epoch,),
            ).fetchall()
            for row in rows:
                # `ended` stays unknown: the daemon died, nobody saw the command end.
                db.execute("UPDATE processes SET state = 'lost' WHERE id = ?", (row["id"],))
                self._journal.append_in(
                    db, "proc.lost", {"proc": row["id"]}, workspace=row["workspace"]
                )
        return len(rows)

    def get(self, proc: str) -> ProcRow | None:
        """The record of `proc`, or None. One indexed query."""
        rows = self._store.query(f"{_ROW_SELECT} WHERE p.id = ?", (proc,))
        return _row(rows[0]) if rows else None

    def recent(self, workspace: str | None, limit: int) -> list[ProcRow]:
        """The newest `limit` records, of one workspace or all; newest first."""
        if workspace is None:
            rows = self._store.query(
                f"{_ROW_SELECT} ORDER BY p.started DESC, p.id LIMIT ?",
                (limit,),
            )
        else:
            rows = self._store.query(
                f"{_ROW_SELECT} WHERE p.workspace = ? ORDER BY p.started DESC, p.id LIMIT ?",
                (workspace, limit),
            )
        return [_row(r) for r in rows]

    def started(
        self,
        *,
        workspace: str,
        proc: str,
        profile: str,
        argv: Sequence[str],
        cwd: str,
        container: str,
        actor: str,
        facts: Sequence[Fact] = (),
    ) -> None:
        encoded_facts = msgspec.json.encode(list(facts))
        fact_set = hashlib.sha256(encoded_facts).hexdigest()
        with self._store.transaction() as db:
            db.execute(
                "INSERT OR IGNORE INTO fact_sets(digest, facts) VALUES (?, ?)",
                (fact_set, encoded_facts.decode()),
            )
            db.execute(
                "INSERT INTO processes(id, workspace, profile, argv, cwd, container, state,"
                " started, epoch, facts) VALUES (?, ?, ?, ?, ?, ?, 'running', ?, ?, ?)",
                (
                    proc,
                    workspace,
                    profile,
                    msgspec.json.encode(list(argv)).decode(),
                    cwd,
                    container,
                    time.time(),
                    self._journal.epoch,
                    fact_set,
                ),
            )
            self._journal.append_in(
                db,
                "proc.started",
                {
                    "proc": proc,
                    "profile": profile,
                    **argv_summary(argv),
                    "cwd": cwd,
                    "container": container[:12],
                },
                workspace=workspace,
                actor=actor,
            )

    def lost(self, *, workspace: str, proc: str) -> None:
        """The run broke (the engine failed, the daemon is stopping): no outcome known."""
        with self._store.transaction() as db:
            db.execute(
                "UPDATE processes SET state = 'lost', ended = ? WHERE id = ?", (time.time(), proc)
            )
            self._journal.append_in(db, "proc.lost", {"proc": proc}, workspace=workspace)

    def exited(
        self,
        *,
        workspace: str,
        proc: str,
        outcome: Outcome,
        stdout: OutputRef,
        stderr: OutputRef,
        blocked: Sequence[PolicyBlocked],
        actor: str,
        changes: ProcChanges | None = None,
    ) -> None:
        egress_blocked = outcome.egress_blocked
        artifacts = [r.artifact for r in (stdout, stderr) if r.artifact is not None]
        with self._store.transaction() as db:
            db.execute(
                "UPDATE processes SET state = 'exited', exit_code = ?, signal = ?,"
                " timed_out = ?, oom_killed = ?, ended = ?, duration_ms = ?, stdout = ?,"
                " stderr = ?, artifacts = ?, policy_blocked = ?, changes = ?,"
                " egress_blocked = ?, via = ?, exec_facts = ?, usage = ? WHERE id = ?",
                (
                    outcome.exit_code,
                    outcome.signal,
                    int(outcome.timed_out),
                    int(outcome.oom_killed),
                    time.time(),
                    outcome.duration_ms,
                    msgspec.json.encode(stdout).decode(),
                    msgspec.json.encode(stderr).decode(),
                    msgspec.json.encode(artifacts).decode(),
                    msgspec.json.encode(list(blocked)).decode(),
                    None if changes is None else msgspec.json.encode(changes).decode(),
                    None
                    if egress_blocked is None
                    else msgspec.json.encode(egress_blocked).decode(),
                    outcome.via,
                    msgspec.json.encode(list(outcome.exec_facts)).decode(),
                    None if outcome.usage is None else msgspec.json.encode(outcome.usage).decode(),
                    proc,
                ),
            )
            self._journal.append_in(
                db,
                "proc.exited",
                {
                    "proc": proc,
                    "exit_code": outcome.exit_code,
                    "signal": outcome.signal,
                    "timed_out": outcome.timed_out,
                    "oom_killed": outcome.oom_killed,
                    "duration_ms": outcome.duration_ms,
                    "stdout": ref_summary(stdout),
                    "stderr": ref_summary(stderr),
                    "reaped": outcome.reaped,
                    "killed": outcome.killed,
                    "cancelled": outcome.cancelled,
                    **({} if outcome.via is None else {"via": outcome.via}),
                    "policy_blocked": [msgspec.to_builtins(b) for b in blocked],
                    **({} if changes is None else {"changes": msgspec.to_builtins(changes.counts)}),
                    **({} if egress_blocked is None else {"egress_blocked": egress_blocked.count}),
                    **(
                        {}
                        if outcome.usage is None
                        else {"usage": msgspec.to_builtins(outcome.usage)}
                    ),
                },
                workspace=workspace,
                actor=actor,
            )
