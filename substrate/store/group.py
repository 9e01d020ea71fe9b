"""Group commit: the database work of concurrent callers in one fsynced transaction.

Theory of operation. A caller `submit`s a unit of work (a function of the open
transaction's connection) and later `wait`s for it. Submitting only queues it, in order;
the first waiter that finds no batch being committed becomes the leader: it takes every
unit queued so far, runs them in queue order in one transaction, each inside its own
savepoint, commits once (one fsync with `synchronous=FULL`), and wakes the others.
Units queued while a batch commits go in the next one. So N writers that finish their
file steps together pay one commit instead of N, and a lone writer pays exactly what a
plain transaction costs (it leads a batch of one).

Every other transaction keeps the order too: `Store.transaction` first `flush`es what is
queued (committing it, or waiting for the batch being committed), so a unit submitted
before any transaction begins is committed before it. A caller that submits under a
lock (a workspace's commit lock) and waits after releasing it therefore gets its entry
before that of anyone who takes the lock after it, whichever way they commit.

What each caller sees is what its own transaction would give: `wait` returns the unit's
result once the commit that holds it is durable, or raises what the unit raised (its
savepoint rolled back, the others unaffected), or what the commit raised (then nothing
of the batch was committed). Order is kept: units commit in the order they were
submitted, so a caller that submits under a lock (a workspace's commit lock) gets
entries in the order it took that lock.

Blocking: call from worker threads. Costs per batch one transaction, one savepoint per
unit, and a condition-variable wake-up per waiter.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Generic, TypeVar

__all__ = ["GroupCommit", "Ticket"]

T = TypeVar("T")


class Ticket(Generic[T]):
    """One submitted unit: its result or error once its batch is committed."""

    __slots__ = ("done", "error", "result", "work")

    def __init__(self, work: Callable[[sqlite3.Connection], T]) -> None:
        self.work = work
        self.done = False
        self.result: T | None = None
        self.error: BaseException | None = None


class GroupCommit:
    """Batches units of database work submitted by concurrent threads into shared commits."""

    def __init__(
        self, transaction: Callable[[], AbstractContextManager[sqlite3.Connection]]
    ) -> None:
        #: Opens one plain transaction (the store's, without the flush).
        self._transaction = transaction
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[Ticket[object]] = []
        self._committing = False

    def submit(self, work: Callable[[sqlite3.Connection], T]) -> Ticket[T]:
        """Queue `work` behind every unit submitted before it; returns at once."""
        ticket: Ticket[T] = Ticket(work)
        with self._cond:
            self._queue.append(ticket)  # type: ignore[arg-type]
        return ticket

    def wait(self, ticket: Ticket[T]) -> T:
        """Block until `ticket`'s batch is committed (leading a batch when none is being
        committed); its result, or the error of its unit or of the commit."""
        with self._cond:
            while not ticket.done:
                if self._committing:
                    self._cond.wait()
                    continue
                batch, self._queue = self._queue, []
                self._committing = True
                self._cond.release()
                try:
                    self._commit(batch)
                finally:
                    self._cond.acquire()
                    self._committing = False
                    self._cond.notify_all()
        if ticket.error is not None:
            raise ticket.error
        return ticket.result  # type: ignore[return-value]

    def run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """`submit` then `wait`."""
        return self.wait(self.submit(work))

    def flush(self) -> None:
        """Return once everything submitted so far is committed (or has failed): leads a
        batch of what is queued, or waits for the one being committed. Free when nothing
        is queued or committing."""
        with self._cond:
            if not self._queue and not self._committing:
                return
            last = self._queue[-1] if self._queue else None
        if last is not None:
            with contextlib.suppress(Exception):
                self.wait(last)  # its error is its submitter's to see
            return
        with self._cond:
            while self._committing:
                self._cond.wait()

    def _commit(self, batch: list[Ticket[object]]) -> None:
        """Run `batch` in one transaction, a savepoint each; settle every ticket."""
        try:
            with self._transaction() as db:
                for ticket in batch:
                    db.execute("SAVEPOINT unit")
                    try:
                        ticket.result = ticket.work(db)
                    except Exception as exc:
                        db.execute("ROLLBACK TO unit")
                        ticket.error = exc
                    db.execute("RELEASE unit")
        except BaseException as exc:
            for ticket in batch:
                ticket.result, ticket.error = None, exc
            if not isinstance(exc, Exception):
                raise
        finally:
            for ticket in batch:
                ticket.done = True
