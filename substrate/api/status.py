"""Handlers of `daemon.status`, `daemon.info` and `daemon.drain` (docs/protocol.md §9): what this daemon
run is, its engine, where its terminals are served."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import psutil

from substrate import __version__
from substrate.api.base import Caller, Handles
from substrate.api.services import StatusServices
from substrate.fs.state import StatePaths
from substrate.schema.journal import (
    DrainParams,
    DrainResult,
    InfoResult,
    JournalExportStatus,
    StatusParams,
    StatusResult,
    WarmPoolStatus,
)

handles = Handles(StatusServices)


@handles("daemon.status")
async def status(s: StatusServices, caller: Caller, p: StatusParams) -> StatusResult:
    """Never refuses: an engine that does not answer is `engine.reachable = false`. Costs
    one engine round trip (bounded by the engine client's timeout), three /proc reads and,
    with the journal export on, one read of the journal's head."""
    me = psutil.Process()
    return StatusResult(
        version=__version__,
        epoch=s.journal.epoch,
        uptime_s=round(time.monotonic() - s.started, 3),
        engine=await s.execution.engine_status(),
        journal_export=await _export(s),
        listen=s.terminals.address(),
        metrics_listen=s.metrics_address(),
        rss_bytes=_measured(lambda: me.memory_info().rss),
        open_fds=_measured(me.num_fds),
        threads=_measured(me.num_threads),
        draining=s.execution.processes.draining,
        running=s.execution.processes.running,
        fresh_view=s.execution.fresh_view(),
        warm_pool={
            name: WarmPoolStatus(ready=ready, wanted=wanted, last_error=error)
            for name, (ready, wanted, error) in s.execution.pool.status().items()
        },
    )


@handles("daemon.info")
async def info(s: StatusServices, caller: Caller, p: StatusParams) -> InfoResult:
    """Operator socket only (its paths are the host's). Never refuses; costs one engine
    round trip, as `daemon.status`."""
    return InfoResult(
        version=__version__,
        pid=os.getpid(),
        epoch=s.journal.epoch,
        uptime_s=round(time.monotonic() - s.started, 3),
        state_dir=str(s.state_dir),
        agent_socket=str(StatePaths(s.state_dir).agent_socket),
        operator_socket=str(StatePaths(s.state_dir).operator_socket),
        listen=s.terminals.address(),
        config=s.config.public(),
        profiles=s.profiles.listing(),
        engine=await s.execution.engine_status(),
    )


@handles("daemon.drain")
async def drain(s: StatusServices, caller: Caller, p: DrainParams) -> DrainResult:
    """Operator socket only. Sets the daemon draining (new commands and terminal sessions
    are refused `draining`; `daemon.status` says `draining: true`, which fails the
    readiness check of deploy/kubernetes) and waits up to `timeout_s` for the running
    commands; `cancel` accepts commands again. Never kills a command."""
    processes = s.execution.processes
    started = time.monotonic()
    if p.cancel:
        processes.draining = False
        running = processes.running
    else:
        running = await processes.drain(p.timeout_s)
    return DrainResult(
        draining=processes.draining,
        running=running,
        waited_s=round(time.monotonic() - started, 3),
    )


async def _export(s: StatusServices) -> JournalExportStatus:
    """The export's state now: the lag counts every entry committed before this call
    (one read of the journal's head, bounded), the rest is what its task last saw."""
    if s.shipper is None:
        return JournalExportStatus()
    await s.shipper.refresh()
    now = s.shipper.status()
    return JournalExportStatus(
        state=now.state,
        last_seq=now.last_seq,
        lag_entries=now.lag_entries,
        last_error=now.last_error,
    )


def _measured(read: Callable[[], int]) -> int | None:
    """A figure about this process, or None when the system will not give it."""
    try:
        return int(read())
    except (psutil.Error, OSError):
        return None
