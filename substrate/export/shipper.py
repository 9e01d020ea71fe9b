"""The journal export's shipper: a daemon task that copies each committed entry to PostgreSQL.

Theory of operation. `Exporter` is the blocking core, used as is by `substrate journal
export` and from worker threads by `Shipper`: it resumes from the cursor (or from what
PostgreSQL holds, if that is less: a table emptied since), reads the next batch from
the journal on its own connection (`JournalSource`), ships it exactly once
(`Target.ship`), and moves the cursor on. `Shipper` runs it under Trio: a batch at a
time while there is lag, a look at the journal's head every `poll_s` when caught up,
and, when PostgreSQL fails in any way, a bounded exponential backoff (`backoff_s`) and
a new connection, resuming where PostgreSQL's last commit left off. Nothing a request
waits for is touched: the journal is read on the source's connection, PostgreSQL is
called from the shipper's own thread (a limiter of one), and the cursor is written at
most once per `CURSOR_EVERY_S` in a store transaction of a few microseconds.

A call to PostgreSQL that a shutdown interrupts is abandoned to its thread (the batch
is idempotent: shipped again at the next start if it never committed), so a server that
hangs cannot hold the daemon's exit; connect and statement timeouts bound the thread.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import trio

from substrate.export.postgres import ExportError, Target, describe_dsn, open_target, redact
from substrate.export.source import Cursors, JournalSource

__all__ = [
    "CURSOR_EVERY_S",
    "DRAIN_S",
    "ExportSettings",
    "ExportState",
    "Exporter",
    "Shipper",
    "Status",
    "backoff_s",
]

log = logging.getLogger("substrate.export")

#: The cursor is written at most this often while shipping, seconds (and at shutdown).
CURSOR_EVERY_S = 1.0
#: `refresh` waits at most this long for the source's connection (another read holds it).
HEAD_WAIT_S = 1.0
#: The DSN parameters that say which database the rows land in (the cursor's key).
WHERE = ("host", "hostaddr", "port", "dbname", "service")
#: The first retry's delay, seconds; it doubles per failure up to `max_backoff_s`.
FIRST_BACKOFF_S = 0.5

ExportState = Literal["off", "connecting", "shipping", "caught_up", "retrying"]


def backoff_s(failures: int, cap: float, rand: Callable[[], float] = random.random) -> float:
    """The delay before retry number `failures` (1, 2, ...): `FIRST_BACKOFF_S` doubling
    per failure, at most `cap`, less up to a quarter at random (nodes that lost the same
    server do not all come back at once). Pure given `rand`."""
    base = min(cap, FIRST_BACKOFF_S * 2.0 ** min(max(failures - 1, 0), 64))
    return base * (1 - 0.25 * rand())


@dataclass(frozen=True, kw_only=True)
class ExportSettings:
    """What the export is configured with (`[journal_export]`, docs/fleet.md)."""

    dsn: str
    node: str
    #: The password, read when connecting (a secret's value); None: libpq's own ways.
    password: Callable[[], str | None] = lambda: None
    batch_entries: int = 1000
    poll_s: float = 0.5
    max_backoff_s: float = 30.0
    timeout_s: float = 10.0

    def target(self) -> str:
        """The cursor's key: this node in that database (host, port, database name; not
        the user, TLS or other settings, whose change moves no row). A key with no
        cursor yet ships from seq 1: rows PostgreSQL already holds of this node are
        compared, never assumed to be ours."""
        return f"{self.node} {describe_dsn(self.dsn, only=WHERE)}"


@dataclass(eq=False)
class Exporter:
    """The blocking core: one connection at a time, batches in order. One thread at a time."""

    settings: ExportSettings
    source: JournalSource
    cursors: Cursors
    target: Target | None = None
    #: The highest seq PostgreSQL is known to hold of this node.
    last_seq: int = 0
    _secret: str | None = field(default=None, repr=False)

    def connect(self) -> None:
        """Open the target (creating and checking its tables) and settle where to resume.
        Raises ExportError."""
        self.close()
        try:
            self._secret = self.settings.password()
        except Exception as exc:  # a secret not set, unreadable: say which, never a value
            raise ExportError("unreachable", f"the password's secret: {exc}") from None
        self.target = open_target(
            self.settings.dsn, password=self._secret, timeout_s=self.settings.timeout_s
        )
        try:
            cursor = self.cursors.load(self.settings.target())
            held = self.target.last_seq(self.settings.node)
        except BaseException:
            self.close()
            raise
        if held < cursor:
            log.warning(
                "journal export: PostgreSQL holds node %s up to seq %d, the cursor says %d:"
                " shipping again from %d",
                self.settings.node,
                held,
                cursor,
                held,
            )
        self.last_seq = min(cursor, held)

    def step(self) -> int:
        """Ship the next batch; how many entries it held (0: caught up). Raises
        ExportError, or what reading the journal raised; either way the connection is
        closed (the next step connects again)."""
        try:
            if self.target is None:
                self.connect()
            assert self.target is not None
            rows = self.source.batch(self.last_seq, self.settings.batch_entries)
            if not rows:
                return 0
            self.target.ship(rows)
        except BaseException:
            self.close()
            raise
        self.last_seq = rows[-1][2]
        return len(rows)

    def save(self) -> None:
        """Write the cursor (the store's transaction: brief)."""
        self.cursors.save(self.settings.target(), self.last_seq, time.time())

    def ship_all(self) -> int:
        """Ship until caught up, saving the cursor at most every `CURSOR_EVERY_S` and at
        the end; how many entries were shipped."""
        shipped = 0
        saved = time.monotonic()
        try:
            while n := self.step():
                shipped += n
                if time.monotonic() - saved >= CURSOR_EVERY_S:
                    self.save()
                    saved = time.monotonic()
        finally:
            self.close()
            if shipped:
                self.save()
        return shipped

    def redacted(self, text: str) -> str:
        return redact(text, [self._secret])

    def close(self) -> None:
        if self.target is not None:
            self.target.close()
            self.target = None


#: A graceful stop ships what remains for at most this long, seconds (`Shipper.drain`).
DRAIN_S = 5.0


@dataclass(frozen=True)
class Status:
    """What `daemon.status` reports as `journal_export` (docs/fleet.md)."""

    state: ExportState
    last_seq: int
    lag_entries: int
    last_error: str | None


class Shipper:
    """The daemon's export task (`run`) and what `daemon.status` reports of it (`status`)."""

    def __init__(self, exporter: Exporter, *, on_error: Callable[[], None] = lambda: None):
        self.exporter = exporter
        self.state: ExportState = "connecting"
        self.head = 0
        self.last_error: str | None = None
        self._on_error = on_error
        self._pg = trio.CapacityLimiter(1)  # PostgreSQL calls: the shipper's thread
        self._sqlite = trio.CapacityLimiter(1)  # the source's connection
        self._saved_at = 0.0
        self._saved_seq = -1

    def status(self) -> Status:
        """What the task last saw (no I/O; `refresh` first for the journal's head now).
        Entries committed since it looked are lag: `shipping`, not `caught_up`."""
        last = self.exporter.last_seq
        lag = max(self.head - last, 0)
        state: ExportState = "shipping" if self.state == "caught_up" and lag else self.state
        return Status(state, last, lag, self.last_error)

    async def refresh(self, timeout_s: float = HEAD_WAIT_S) -> None:
        """Read the journal's head now (bounded), so the lag `status` reports counts every
        entry committed before this call, not only those of the task's last look."""
        with trio.move_on_after(timeout_s):
            self.head = await self._head()

    def lag(self) -> int:
        return max(self.head - self.exporter.last_seq, 0)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Ship until cancelled; never raises for PostgreSQL's sake (backs off instead)."""
        settings = self.exporter.settings
        log.info(
            "journal export: node %s to %s",
            settings.node,
            self.exporter.redacted(describe_dsn(settings.dsn)),
        )
        task_status.started()
        failures = 0
        try:
            while True:
                try:
                    await self._ship_while_lagging()
                    failures = 0
                    self.state = "caught_up"
                    await trio.sleep(settings.poll_s)
                    continue
                except ExportError as exc:
                    error = exc
                except Exception as exc:  # the journal's side, or a bug: never the daemon's end
                    log.exception("journal export: unexpected error")
                    error = ExportError("failed", type(exc).__name__)
                failures += 1
                self._failed(error, failures)
                self.state = "retrying"
                await self._wait(backoff_s(failures, settings.max_backoff_s))
                self.state = "connecting"
        finally:
            with trio.CancelScope(shield=True):
                await self._save(force=True)

    async def drain(self, grace_s: float = DRAIN_S) -> None:
        """After `run` ended (a graceful stop, the last entries journaled): ship what
        remains, for at most `grace_s`; whatever is left then (PostgreSQL away or slow)
        is shipped at the next start, or by `substrate journal export`. Never raises."""
        with trio.move_on_after(grace_s):
            try:
                await self._ship_while_lagging()
            except ExportError as exc:
                log.warning("journal export at stop: %s", self.exporter.redacted(str(exc)))
            except Exception:
                log.exception("journal export at stop: unexpected error")
        with trio.CancelScope(shield=True):
            await self._save(force=True)

    async def _wait(self, delay: float) -> None:
        """Sleep `delay`, keeping the head (so the lag reported) current meanwhile."""
        deadline = trio.current_time() + delay
        while (left := deadline - trio.current_time()) > 0:
            await trio.sleep(min(left, self.exporter.settings.poll_s))
            self.head = await self._head()

    async def _head(self) -> int:
        return await trio.to_thread.run_sync(self.exporter.source.head, limiter=self._sqlite)

    async def _ship_while_lagging(self) -> None:
        exporter = self.exporter
        if exporter.target is None:
            self.state = "connecting"
            await self._pg_call(exporter.connect)
            if self.last_error is not None:
                log.info(
                    "journal export: connected again, resuming after seq %d", exporter.last_seq
                )
            self.last_error = None
        self.head = await self._head()
        while self.head > exporter.last_seq:
            self.state = "shipping"
            shipped = await self._pg_call(exporter.step)
            self.last_error = None
            await self._save()
            if shipped == 0:  # the head moved back? (a journal replaced): look again
                self.head = await self._head()
                break
            if exporter.last_seq >= self.head:
                self.head = await self._head()
        await self._save(force=True)

    async def _pg_call(self, fn: Callable[[], int | None]) -> int:
        # Abandoned on cancel (shutdown): idempotent, and bounded by the timeouts.
        result = await trio.to_thread.run_sync(fn, limiter=self._pg, abandon_on_cancel=True)
        return int(result or 0)

    async def _save(self, *, force: bool = False) -> None:
        exporter = self.exporter
        now = time.monotonic()
        if exporter.last_seq == self._saved_seq or (
            not force and now - self._saved_at < CURSOR_EVERY_S
        ):
            return
        seq = exporter.last_seq
        await trio.to_thread.run_sync(exporter.save)
        self._saved_at, self._saved_seq = now, seq

    def _failed(self, exc: ExportError, failures: int) -> None:
        message = self.exporter.redacted(str(exc))
        self._on_error()
        if message != self.last_error or failures in (1, 10, 100) or failures % 1000 == 0:
            log.warning("journal export: %s (attempt %d; retrying)", message, failures)
        self.last_error = message
