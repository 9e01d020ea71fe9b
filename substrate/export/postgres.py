"""The PostgreSQL side of the journal export (docs/fleet.md): schema, batches, the chain.

Theory of operation. `open_target` connects (psycopg 3, its blocking API: the caller
runs it in a worker thread) with a connect timeout, a statement timeout and TCP
keepalives, so a server that is away, slow or refusing fails a call within bounded time
instead of holding a thread. It creates `substrate_journal` and the version table
`substrate_schema` if missing (under an advisory lock: nodes starting together do not
race) and checks that the table is exactly the one this release writes (`check_schema`:
its columns, their types, the primary key and the `(node, seq)` key), else raises
`ExportError("schema_mismatch")` naming what differs.

`Target.ship` writes one batch in one transaction: COPY into a temporary table, then
`INSERT ... SELECT ... ON CONFLICT DO NOTHING`, then, unless every row was new, one
query that compares every row of the batch with the row the table holds for its
`(node, seq)`. A batch shipped twice
(after a crash between PostgreSQL's commit and the cursor's) inserts nothing and
compares equal; a different row already there (another journal under the same node
name, or one altered) rolls the batch back and raises `ExportError("conflict")` with
its seq. So each entry is in the table exactly once, as the node wrote it.

Errors are translated here, at the edge, into `ExportError` with a stable `kind`;
messages never hold the password (`redact`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import conninfo

__all__ = [
    "COLUMNS",
    "SCHEMA_VERSION",
    "ExportError",
    "Row",
    "Target",
    "describe_dsn",
    "open_target",
    "redact",
]

#: The version of the table's layout this release writes (row `journal` of `substrate_schema`).
SCHEMA_VERSION = 1
TABLE = "substrate_journal"
#: Each column and its type, in order: `substrate_journal` must be exactly this.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("node", "text"),
    ("epoch", "bigint"),
    ("seq", "bigint"),
    ("ts", "double precision"),
    ("kind", "text"),
    ("workspace", "text"),
    ("actor", "text"),
    ("data", "jsonb"),
    ("prev", "text"),
    ("hash", "text"),
)
NAMES = tuple(name for name, _ in COLUMNS)
#: One entry as shipped: node, epoch, seq, ts, kind, workspace, actor, data (canonical
#: JSON text), prev, hash.
Row = tuple[str, int, int, float, str, str | None, str, str, str, str]

_DDL = f"""
CREATE TABLE IF NOT EXISTS substrate_schema (
    component text PRIMARY KEY,
    version integer NOT NULL
);
CREATE TABLE IF NOT EXISTS {TABLE} (
    node text NOT NULL,
    epoch bigint NOT NULL,
    seq bigint NOT NULL,
    ts double precision NOT NULL,
    kind text NOT NULL,
    workspace text,
    actor text NOT NULL,
    data jsonb NOT NULL,
    prev text NOT NULL,
    hash text NOT NULL,
    PRIMARY KEY (node, epoch, seq),
    CONSTRAINT {TABLE}_node_seq UNIQUE (node, seq)
);
INSERT INTO substrate_schema (component, version) VALUES ('journal', {SCHEMA_VERSION})
    ON CONFLICT (component) DO NOTHING;
"""
#: Held while creating, so that nodes starting together create the tables once.
_LOCK_KEY = 0x5B57_7A7E

_STAGE = "substrate_journal_in"
_STAGE_DDL = f"CREATE TEMPORARY TABLE IF NOT EXISTS {_STAGE} (LIKE {TABLE}) ON COMMIT DELETE ROWS"
_COLS = ", ".join(NAMES)
_INSERT = (
    f"INSERT INTO {TABLE} ({_COLS}) SELECT {_COLS} FROM {_STAGE} ORDER BY seq"
    " ON CONFLICT DO NOTHING"
)
_DIFFERENT = (
    f"SELECT i.seq FROM {_STAGE} i JOIN {TABLE} j ON j.node = i.node AND j.seq = i.seq"
    " WHERE (j.epoch, j.ts, j.kind, j.workspace, j.actor, j.data, j.prev, j.hash)"
    " IS DISTINCT FROM (i.epoch, i.ts, i.kind, i.workspace, i.actor, i.data, i.prev, i.hash)"
    " ORDER BY i.seq LIMIT 1"
)


class ExportError(Exception):
    """The export could not go on; `kind` says why, the message the detail (never the
    password). Kinds: `unreachable` (no connection: down, refused, bad credentials,
    timed out), `schema_mismatch` (the table is not the one this release writes),
    `conflict` (the table holds another row at one of our seqs), `unstorable` (an
    entry PostgreSQL cannot hold, such as text with U+0000), `failed` (any other
    error the server answered)."""

    def __init__(self, kind: str, message: str, *, seq: int | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.seq = seq


def redact(text: str, secrets: Sequence[str | None]) -> str:
    """`text` with every non-empty value of `secrets` replaced by `***`. Pure."""
    for value in secrets:
        if value:
            text = text.replace(value, "***")
    return text


def describe_dsn(dsn: str, only: Sequence[str] | None = None) -> str:
    """The DSN as a person may see it: its parameters (those named in `only`, if given)
    without any password. Raises ExportError("failed") for one that does not parse (the
    message never quotes it)."""
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        raise ExportError("failed", "the DSN does not parse as a libpq DSN or URI") from None
    params.pop("password", None)
    if only is not None:
        params = {k: v for k, v in params.items() if k in only}
    return " ".join(f"{k}={v}" for k, v in sorted(params.items()))


def dsn_password(dsn: str) -> str | None:
    """The password a DSN carries, if any (to keep it out of messages)."""
    with contextlib.suppress(psycopg.ProgrammingError):
        value = conninfo.conninfo_to_dict(dsn).get("password")
        return None if value is None else str(value)
    return None


def _translated(exc: psycopg.Error, secrets: Sequence[str | None]) -> ExportError:
    """A psycopg error as an `ExportError` of the right kind."""
    message = redact(" ".join(str(exc).split()), secrets)
    sqlstate = getattr(exc, "sqlstate", None) or ""
    if sqlstate == "22P05" or isinstance(exc, psycopg.errors.UntranslatableCharacter):
        return ExportError("unstorable", message)
    if isinstance(exc, psycopg.OperationalError) and not sqlstate:
        return ExportError("unreachable", message)
    if sqlstate.startswith(("08", "57", "53")) or isinstance(exc, psycopg.errors.QueryCanceled):
        return ExportError("unreachable", message)  # connection, shutdown, resources, timeout
    return ExportError("failed", message)


@contextlib.contextmanager
def _edge(secrets: Sequence[str | None]) -> Iterator[None]:
    """Translate psycopg's errors to `ExportError` (the one place that does)."""
    try:
        yield
    except psycopg.Error as exc:
        raise _translated(exc, secrets) from None


@dataclass
class Target:
    """One open connection to the export's database. Blocking; one thread at a time."""

    conn: psycopg.Connection[Any]
    secrets: tuple[str | None, ...]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()

    def last_seq(self, node: str) -> int:
        """The highest seq the table holds for `node` (0: none)."""
        with _edge(self.secrets), self.conn.transaction():
            row = self.conn.execute(
                f"SELECT max(seq) FROM {TABLE} WHERE node = %s", (node,)
            ).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def ship(self, rows: Sequence[Row]) -> int:
        """Write `rows` (one node's, in seq order) exactly once; how many were new.
        Raises ExportError: `conflict` (nothing of the batch is kept) and the others."""
        if not rows:
            return 0
        with _edge(self.secrets), self.conn.transaction():
            cur = self.conn.cursor()
            with cur.copy(f"COPY {_STAGE} ({_COLS}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
            inserted = cur.execute(_INSERT).rowcount
            # Every row new: nothing to compare. Else (shipped again) compare them all, by
            # the (node, seq) key's index: the staging table has no statistics, and a hash
            # join would scan the whole table once per batch.
            different = None
            if inserted != len(rows):
                cur.execute("SET LOCAL enable_hashjoin = off")
                cur.execute("SET LOCAL enable_mergejoin = off")
                different = cur.execute(_DIFFERENT).fetchone()
            if different is not None:
                seq = int(different[0])
                raise ExportError(
                    "conflict",
                    f"{TABLE} already holds a different entry for node {rows[0][0]!r} at seq"
                    f" {seq} (another journal under this node name, or a row altered)",
                    seq=seq,
                )
        return max(inserted, 0)

    def chain(self, node: str, after: int, limit: int) -> list[tuple[Any, ...]]:
        """Up to `limit` of `node`'s rows with `seq > after`, in seq order, `data` as
        jsonb's text: (epoch, seq, ts, kind, workspace, actor, data, prev, hash)."""
        with _edge(self.secrets), self.conn.transaction():
            return self.conn.execute(
                "SELECT epoch, seq, ts, kind, workspace, actor, data::text, prev, hash"
                f" FROM {TABLE} WHERE node = %s AND seq > %s ORDER BY seq LIMIT %s",
                (node, after, limit),
            ).fetchall()


def open_target(
    dsn: str,
    *,
    password: str | None = None,
    timeout_s: float = 10.0,
    create: bool = True,
    application: str = "substrate-journal-export",
) -> Target:
    """Connect to `dsn` (with `password` if given, else libpq's own: the DSN, PGPASSWORD,
    ~/.pgpass), create the tables if `create`, check them. Raises ExportError
    (`unreachable`, `schema_mismatch`, `failed`). Costs a connection and a few catalog
    queries."""
    secrets = (password, dsn_password(dsn))
    timeout_ms = max(int(timeout_s * 1000), 1)
    try:
        given = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        raise ExportError("failed", "the DSN does not parse as a libpq DSN or URI") from None
    extra: dict[str, Any] = {} if password is None else {"password": password}
    if "application_name" not in given:
        extra["application_name"] = application
    # The DSN's own `options` (a search_path, ...) are kept; the timeout is added after.
    # A wait for a lock counts in the statement's time.
    options = f"{given.get('options', '')} -c statement_timeout={timeout_ms}".strip()
    with _edge(secrets):
        try:
            conn = psycopg.connect(
                dsn,
                connect_timeout=max(int(timeout_s), 1),
                options=options,
                keepalives=1,
                keepalives_idle=30,
                keepalives_interval=10,
                keepalives_count=3,
                tcp_user_timeout=timeout_ms,
                **extra,
            )
        except psycopg.ProgrammingError as exc:
            raise ExportError("failed", redact(str(exc), secrets)) from None
    target = Target(conn, secrets)
    try:
        with _edge(secrets):
            if create and not _tables_exist(conn):
                # Only then: a role granted SELECT and INSERT alone (no CREATE on the
                # schema) works on tables an administrator made.
                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
                    conn.execute(_DDL)
            problem = check_schema(conn)
            if problem is not None:
                raise ExportError("schema_mismatch", problem)
            with conn.transaction():
                conn.execute(_STAGE_DDL)
    except BaseException:
        target.close()
        raise
    return target


def _tables_exist(conn: psycopg.Connection[Any]) -> bool:
    with conn.transaction():
        row = conn.execute(
            f"SELECT to_regclass('substrate_schema') IS NOT NULL AND to_regclass('{TABLE}')"
            " IS NOT NULL"
        ).fetchone()
    return bool(row and row[0])


def check_schema(conn: psycopg.Connection[Any]) -> str | None:
    """What about `substrate_journal` and `substrate_schema` differs from what this
    release writes, in one sentence; None when nothing does."""
    with conn.transaction():
        version = conn.execute(
            "SELECT version FROM substrate_schema WHERE component = 'journal'"
        ).fetchone()
        if version is None:
            return "substrate_schema has no row for component 'journal'"
        if int(version[0]) != SCHEMA_VERSION:
            return (
                f"substrate_schema says the journal table is version {version[0]};"
                f" this release writes version {SCHEMA_VERSION}"
            )
        have = conn.execute(
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull"
            " FROM pg_attribute a WHERE a.attrelid = %s::regclass AND a.attnum > 0"
            " AND NOT a.attisdropped ORDER BY a.attnum",
            (TABLE,),
        ).fetchall()
        keys = conn.execute(
            "SELECT i.indisprimary, array_agg(a.attname::text ORDER BY k.ord)"
            " FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(num, ord)"
            " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.num"
            " WHERE i.indrelid = %s::regclass AND i.indisunique GROUP BY i.indexrelid,"
            " i.indisprimary",
            (TABLE,),
        ).fetchall()
    return schema_problem(
        [(str(n), str(t), bool(nn)) for n, t, nn in have],
        [(bool(p), [str(c) for c in cols]) for p, cols in keys],
    )


def schema_problem(
    columns: Sequence[tuple[str, str, bool]], keys: Sequence[tuple[bool, Sequence[str]]]
) -> str | None:
    """The first difference between the table's `columns` (name, type, not null) and
    unique `keys` (primary?, columns) and this release's layout; None if none. Pure."""
    expected = dict(COLUMNS)
    found = {name: kind for name, kind, _ in columns}
    for name, kind in COLUMNS:
        if name not in found:
            return f"{TABLE} has no column {name} ({kind})"
        if found[name] != kind:
            return f"{TABLE}.{name} is {found[name]}, expected {kind}"
    for name, kind, not_null in columns:
        if name not in expected:
            return f"{TABLE} has a column {name} ({kind}) this release does not write"
        if not not_null and name != "workspace":
            return f"{TABLE}.{name} allows NULL; this release writes it NOT NULL"
    if (True, ["node", "epoch", "seq"]) not in [(p, list(c)) for p, c in keys]:
        return f"{TABLE}'s primary key is not (node, epoch, seq)"
    if not any(list(c) == ["node", "seq"] for _, c in keys):
        return f"{TABLE} has no unique key on (node, seq)"
    return None
