"""Durable records of commands: the `processes` table and their journal entries.

One row per command (`running` → `exited`, or `lost` when its daemon died or the run
broke), written in the same transaction as its `proc.started` / `proc.exited` /
`proc.lost` journal entry, so the table and the journal never disagree. Neither holds
output bytes: only argv, outcomes, sizes, digests and artifact ids.

Blocking (SQLite): async callers use `trio.to_thread.run_sync`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from substrate.journal import Journal
from substrate.schema.artifact import OutputRef
from substrate.schema.proc import PolicyBlocked
from substrate.store import Store

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
    epoch INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS processes_workspace ON processes(workspace, started);
"""


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


def _ref(raw: object) -> OutputRef | None:
    if not isinstance(raw, str) or not raw:
        return None
    return msgspec.json.decode(raw, type=OutputRef)


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
    )


_ROW_COLUMNS = (
    "id, workspace, profile, argv, cwd, state, started, ended, exit_code, signal, timed_out,"
    " oom_killed, duration_ms, stdout, stderr, epoch"
)


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
        rows = self._store.query(f"SELECT {_ROW_COLUMNS} FROM processes WHERE id = ?", (proc,))
        return _row(rows[0]) if rows else None

    def recent(self, workspace: str | None, limit: int) -> list[ProcRow]:
        """The newest `limit` records, of one workspace or all; newest first."""
        if workspace is None:
            rows = self._store.query(
                f"SELECT {_ROW_COLUMNS} FROM processes ORDER BY started DESC, id LIMIT ?",
                (limit,),
            )
        else:
            rows = self._store.query(
                f"SELECT {_ROW_COLUMNS} FROM processes WHERE workspace = ?"
                " ORDER BY started DESC, id LIMIT ?",
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
    ) -> None:
        with self._store.transaction() as db:
            db.execute(
                "INSERT INTO processes(id, workspace, profile, argv, cwd, container, state,"
                " started, epoch) VALUES (?, ?, ?, ?, ?, ?, 'running', ?, ?)",
                (
                    proc,
                    workspace,
                    profile,
                    msgspec.json.encode(list(argv)).decode(),
                    cwd,
                    container,
                    time.time(),
                    self._journal.epoch,
                ),
            )
            self._journal.append_in(
                db,
                "proc.started",
                {
                    "proc": proc,
                    "profile": profile,
                    "argv": list(argv),
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
    ) -> None:
        artifacts = [r.artifact for r in (stdout, stderr) if r.artifact is not None]
        with self._store.transaction() as db:
            db.execute(
                "UPDATE processes SET state = 'exited', exit_code = ?, signal = ?,"
                " timed_out = ?, oom_killed = ?, ended = ?, duration_ms = ?, stdout = ?,"
                " stderr = ?, artifacts = ? WHERE id = ?",
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
                    "policy_blocked": [msgspec.to_builtins(b) for b in blocked],
                },
                workspace=workspace,
                actor=actor,
            )
