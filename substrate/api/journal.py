"""Handlers of `journal.*` and `daemon.status`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import psutil
import trio

from substrate import __version__
from substrate.api.base import Caller, handles
from substrate.api.profile import profile_digests
from substrate.protocol.client import AGENT_SOCKET, OPERATOR_SOCKET
from substrate.pty.http import parse_listen
from substrate.schema.journal import (
    InfoResult,
    JournalReadParams,
    JournalReadResult,
    JournalVerifyParams,
    JournalVerifyResult,
    ReplayFile,
    ReplayParams,
    ReplayResult,
    StatusParams,
    StatusResult,
)
from substrate.workspace import writes

if TYPE_CHECKING:
    from substrate.daemon import Daemon


@handles("journal.read")
async def read(daemon: Daemon, caller: Caller, p: JournalReadParams) -> JournalReadResult:
    entries = await trio.to_thread.run_sync(
        lambda: daemon.journal.read(since=p.since, limit=p.limit, workspace=p.workspace)
    )
    return JournalReadResult(entries=entries)


@handles("journal.verify")
async def verify(daemon: Daemon, caller: Caller, p: JournalVerifyParams) -> JournalVerifyResult:
    def run() -> JournalVerifyResult:
        bad = daemon.journal.verify()
        return JournalVerifyResult(
            ok=bad is None, entries=daemon.journal.count(), first_bad_seq=bad
        )

    return await trio.to_thread.run_sync(run)


@handles("journal.replay")
async def replay(daemon: Daemon, caller: Caller, p: ReplayParams) -> ReplayResult:
    ws = daemon.workspaces.get(p.workspace)
    rows = await trio.to_thread.run_sync(writes.drift_report, ws, daemon.journal)
    files = [
        ReplayFile(path=path, last_seq=seq, last_sha256=last, current_sha256=now, status=status)  # type: ignore[arg-type]
        for path, seq, last, now, status in rows
    ]
    return ReplayResult(files=files, drifted=sum(f.status != "match" for f in files))


@handles("daemon.status")
async def status(daemon: Daemon, caller: Caller, p: StatusParams) -> StatusResult:
    """Never refuses: an engine that does not answer is `engine.reachable = false`. Costs
    one engine round trip (bounded by the engine client's timeout) and three /proc reads."""
    me = psutil.Process()
    return StatusResult(
        version=__version__,
        epoch=daemon.epoch,
        uptime_s=round(time.monotonic() - daemon.started, 3),
        engine=await daemon.execution.engine_status(),
        listen=terminal_listen(daemon),
        rss_bytes=_measured(lambda: me.memory_info().rss),
        open_fds=_measured(me.num_fds),
        threads=_measured(me.num_threads),
    )


@handles("daemon.info")
async def info(daemon: Daemon, caller: Caller, p: StatusParams) -> InfoResult:
    """Operator socket only (its paths are the host's). Never refuses; costs one engine
    round trip, as `daemon.status`."""
    return InfoResult(
        version=__version__,
        pid=os.getpid(),
        epoch=daemon.epoch,
        uptime_s=round(time.monotonic() - daemon.started, 3),
        state_dir=str(daemon.state_dir),
        agent_socket=str(daemon.state_dir / AGENT_SOCKET),
        operator_socket=str(daemon.state_dir / OPERATOR_SOCKET),
        listen=terminal_listen(daemon),
        config=daemon.config.public(),
        profiles=profile_digests(daemon),
        engine=await daemon.execution.engine_status(),
    )


def _measured(read: Callable[[], int]) -> int | None:
    """A figure about this process, or None when the system will not give it."""
    try:
        return int(read())
    except (psutil.Error, OSError):
        return None


def terminal_listen(daemon: Daemon) -> str | None:
    """Where terminals are served (`HOST:PORT`, the bound port), or None when they are not.

    Clients build their terminal URL from this, never from a default port: a token sent
    to whatever else listens on 7681 would be a leak.
    """
    port = daemon.terminals.http.port
    if not port:
        return None
    host, _ = parse_listen(daemon.config.listen)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
