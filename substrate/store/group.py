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

A place in the order can be taken before the work is known (`reserve`, under the lock)
and filled later (`fill`, after a directory fsync the unit must follow; `drop` if it
never comes). A batch never waits for one: the leader takes the queued units that are
ready, in order, up to the first reserved place not yet filled; units submitted
`ordered=False` (a write's intent, which no entry's order depends on) go past such a
place. So the transaction, and the store's lock, are never held while a writer fsyncs,
and the commit of one batch overlaps the directory fsyncs of the next. `flush` waits
for every place taken before it, filled or not.

Blocking: call from worker threads. Costs per batch one transaction, one savepoint per
unit (none for a batch of one), and a wake-up per thread waiting on it, plus one to hand
the lead on.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

__all__ = ["GroupCommit", "Ticket"]

T = TypeVar("T")


class Ticket(Generic[T]):
    """One submitted unit: its result or error once its batch is committed. `work` is
    None while a reserved place is not filled."""

    __slots__ = ("done", "error", "ordered", "result", "work")

    def __init__(self, work: Callable[[sqlite3.Connection], T] | None, ordered: bool) -> None:
        self.work = work
        self.ordered = ordered
        self.done = False
        self.result: T | None = None
        self.error: BaseException | None = None


class _Sleeper:
    """A thread blocked in `GroupCommit.wait` on `ticket`: it sleeps on `lock` (held),
    and whoever releases it has removed it from the sleepers."""

    __slots__ = ("lock", "ticket")

    def __init__(self, ticket: Ticket[Any]) -> None:
        self.ticket = ticket
        self.lock = threading.Lock()
        self.lock.acquire()


class GroupCommit:
    """Batches units of database work submitted by concurrent threads into shared commits.

    Wake-ups are targeted, not broadcast: a finished batch wakes the threads waiting on
    its units, then at most one other sleeper to lead the next batch (when units are
    queued); a filled or dropped place wakes one sleeper to lead when no batch is being
    committed. So N concurrent writers cost about N wake-ups per batch, not N for every
    commit and every fill (each wake-up is a thread taking the interpreter lock)."""

    def __init__(
        self, transaction: Callable[[], AbstractContextManager[sqlite3.Connection]]
    ) -> None:
        #: Opens one plain transaction (the store's, without the flush).
        self._transaction = transaction
        self._lock = threading.Lock()
        self._queue: list[Ticket[object]] = []
        #: The batch being committed (empty when none is).
        self._batch: list[Ticket[object]] = []
        self._committing = False
        #: Threads blocked in `wait`, in the order they went to sleep.
        self._sleepers: list[_Sleeper] = []

    def submit(self, work: Callable[[sqlite3.Connection], T], *, ordered: bool = True) -> Ticket[T]:
        """Queue `work` behind every unit submitted before it; returns at once. Not
        `ordered`: it may commit before a reserved place queued before it is filled."""
        ticket: Ticket[T] = Ticket(work, ordered)
        with self._lock:
            self._queue.append(ticket)  # type: ignore[arg-type]
        return ticket

    def reserve(self) -> Ticket[Any]:
        """Take the next place in the order for work given later (`fill`, or `drop`):
        nothing submitted after it (ordered) commits before it. Returns at once."""
        ticket: Ticket[Any] = Ticket(None, True)
        with self._lock:
            self._queue.append(ticket)
        return ticket

    def fill(self, ticket: Ticket[T], work: Callable[[sqlite3.Connection], T]) -> None:
        """Give a reserved place its work: it commits with the next batch."""
        with self._lock:
            ticket.work = work
            if not self._committing:
                # Units behind this place may be ready now: someone asleep leads them.
                self._wake_leader()

    def drop(self, ticket: Ticket[Any], error: BaseException) -> None:
        """Give up a reserved place (its work will never come): `wait` raises `error`."""
        with self._lock:
            if ticket in self._queue:
                self._queue.remove(ticket)
            ticket.error, ticket.done = error, True
            self._wake_done()
            if not self._committing:
                self._wake_leader()

    def _ready(self) -> list[Ticket[object]]:
        """Take from the queue the units a batch may commit now: in order, up to the
        first unfilled place, and past it those not `ordered` (call holding the lock)."""
        batch: list[Ticket[object]] = []
        left: list[Ticket[object]] = []
        blocked = False
        for ticket in self._queue:
            if ticket.work is None:
                blocked = True
                left.append(ticket)
            elif blocked and ticket.ordered:
                left.append(ticket)
            else:
                batch.append(ticket)
        self._queue = left
        return batch

    def _wake_done(self) -> None:
        """Release every sleeper whose ticket is settled (call holding the lock)."""
        if any(s.ticket.done for s in self._sleepers):
            keep: list[_Sleeper] = []
            for sleeper in self._sleepers:
                if sleeper.ticket.done:
                    sleeper.lock.release()
                else:
                    keep.append(sleeper)
            self._sleepers = keep

    def _wake_leader(self) -> None:
        """Release the longest sleeper to lead a batch, when units are queued (call
        holding the lock, with no batch being committed)."""
        if self._queue and self._sleepers:
            self._sleepers.pop(0).lock.release()

    def wait(self, ticket: Ticket[T]) -> T:
        """Block until `ticket`'s batch is committed (leading a batch when none is being
        committed); its result, or the error of its unit or of the commit."""
        self._lock.acquire()
        try:
            while not ticket.done:
                if not self._committing:
                    batch = self._ready()
                    if batch:
                        self._lead(batch)
                        continue
                # A batch is being committed, or nothing may commit before a reserved
                # place is filled: sleep until this ticket is settled or it is our turn.
                sleeper = _Sleeper(ticket)
                self._sleepers.append(sleeper)
                self._lock.release()
                woken = False
                try:
                    woken = sleeper.lock.acquire()
                finally:
                    self._lock.acquire()
                    if not woken:  # interrupted: never leave a sleeper that cannot wake
                        if sleeper in self._sleepers:
                            self._sleepers.remove(sleeper)
                        elif not self._committing:
                            self._wake_leader()  # pass on the turn it was given
        finally:
            self._lock.release()
        if ticket.error is not None:
            raise ticket.error
        return ticket.result  # type: ignore[return-value]

    def _lead(self, batch: list[Ticket[object]]) -> None:
        """Commit `batch` (called holding the lock, released meanwhile); then wake its
        waiters and, when more is queued, one sleeper to lead the next batch."""
        self._committing, self._batch = True, batch
        self._lock.release()
        try:
            self._commit(batch)
        finally:
            self._lock.acquire()
            for ticket in batch:
                ticket.done = True  # under the lock, once the commit has returned
            self._committing, self._batch = False, []
            self._wake_done()
            self._wake_leader()

    def run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """`submit` then `wait`."""
        return self.wait(self.submit(work))

    def flush(self) -> None:
        """Return once everything submitted (or reserved) so far is committed or has
        failed: leads batches of what is queued, or waits for the one being committed,
        and for reserved places to be filled. Free when nothing is queued or committing."""
        with self._lock:
            if not self._queue and not self._committing:
                return
            before = [*self._batch, *self._queue]
        for ticket in before:
            with contextlib.suppress(Exception):
                self.wait(ticket)  # its error is its submitter's to see

    def _commit(self, batch: list[Ticket[object]]) -> None:
        """Run `batch` in one transaction, a savepoint each; give every ticket its
        result or error (`_lead` marks them done). A
        batch of one needs no savepoint: its unit's error rolls back the transaction,
        which then holds nothing else."""
        try:
            with self._transaction() as db:
                if len(batch) == 1:
                    [only] = batch
                    assert only.work is not None
                    only.result = only.work(db)
                    return
                for ticket in batch:
                    assert ticket.work is not None  # only filled places are taken
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
