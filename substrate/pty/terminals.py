"""The daemon's terminal sessions: grants checked, processes started, clients attached.

Theory of operation: `Terminals.run` owns a nursery in which every session runs three
tasks, the *pump* (PTY output → the session's ring, then wake every reader), the
*idle watch* and the *resizer*. A controller's `resize` only records the size it wants;
the resizer applies the latest one, at most one PTY (engine) resize per
`RESIZE_INTERVAL_S`, so a dragged window's thousands of sizes cost a few calls and never
queue up ahead of the keystrokes behind them. Clients (WebSocket connections, `substrate.pty.connection`) call `open`,
then `input`/`resize`/`close_frame`, and `detach` when they go. The pump never waits for
a client: each client reads the ring through its own cursor at its own pace.

A new session is started in this order, so that a refusal changes nothing: check the
grant without consuming it → start the process (confinement verified by the spawner, as
for any command) → consume one use (and terminate the process if that now fails).
Joining a session checks its controller slot before consuming.

Ended sessions stay readable by `pty.selection` (the newest `keep_ended` of them) until
the daemon stops. Journal entries (`pty.opened`, `pty.attached`, `pty.detached`,
`pty.resized`, `pty.closed`) carry ids, modes, sizes, byte counts and exit codes, never
bytes; they are written in order by one task.
"""

from __future__ import annotations

import codecs
import itertools
import logging
import math
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from substrate.errors import (
    ControllerBusy,
    GrantInvalid,
    InvalidParams,
    LimitExceeded,
    ProcessUnknown,
)
from substrate.pty.backend import PtyProcess, PtySpawner
from substrate.pty.frames import Error, Open
from substrate.pty.grants import Grants
from substrate.pty.session import Mode, Session
from substrate.schema.pty import SelectionResult, SessionInfo, SessionList
from substrate.store.journal import Journal

log = logging.getLogger("substrate.pty")

#: Called to disconnect a client: (close code, error frame to send first or None, reason).
Kick = Callable[[int, Error | None, str], None]
#: The least time between two resizes of one session's PTY, seconds.
RESIZE_INTERVAL_S = 0.05


@dataclass
class TerminalSettings:
    """Knobs of the terminal service; every one has a unit."""

    ring_bytes: int = 1 << 20  # scrollback per session, bytes
    idle_timeout_s: float = 1800.0  # a session with no input/output/attach this long ends
    first_frame_timeout_s: float = 5.0  # `open` must arrive within this, seconds
    ping_interval_s: float = 20.0  # seconds between WebSocket pings
    ping_timeout_s: float = 20.0  # a ping unanswered this long disconnects (4408)
    send_timeout_s: float = 20.0  # a frame not taken by the client this long disconnects (4429)
    frame_bytes: int = 32 * 1024  # PTY bytes per output frame, at most
    max_sessions: int = 32  # running sessions per daemon; more: limit_exceeded
    max_clients: int = 256  # attached connections per daemon; more: limit_exceeded
    keep_ended: int = 16  # ended sessions kept for pty.selection
    terminate_timeout_s: float = 10.0  # waiting for an ended process to go, seconds


@dataclass
class Live:
    """A session and its process, with the wake-up that readers wait on."""

    session: Session
    proc: PtyProcess
    changed: trio.Event = field(default_factory=trio.Event)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    joined: set[str] = field(default_factory=set)  # grants that already paid a use here
    kicks: dict[int, tuple[str, Kick]] = field(default_factory=dict)  # client → (grant, kick)
    lock: trio.Lock = field(default_factory=trio.Lock)
    started: float = 0.0
    last_resize_journaled: float = -math.inf
    #: Set when the controller wants a size the PTY does not have yet (`session.cols/rows`).
    resize_wanted: trio.Event = field(default_factory=trio.Event)

    def wake(self) -> None:
        """Wake every reader waiting for output or the end."""
        self.changed.set()
        self.changed = trio.Event()


@dataclass(frozen=True)
class Attached:
    """What `open` gives a client: the session, its mode, where its reading starts."""

    live: Live
    client: int
    mode: Mode
    grant: str
    start: int  # the `since` to read from; a resync follows if it is not in the ring


_REVOKED = Error(refusal="grant_expired", message="the grant was revoked")


class Terminals:
    """All terminal sessions of one daemon run."""

    def __init__(
        self,
        *,
        grants: Grants,
        journal: Journal,
        spawner: PtySpawner,
        settings: TerminalSettings | None = None,
        check_workspace: Callable[[str], object] | None = None,
    ) -> None:
        self.grants = grants
        self.settings = settings or TerminalSettings()
        self._journal = journal
        self._spawner = spawner
        self._check_workspace = check_workspace
        self._live: dict[str, Live] = {}
        self._ended: OrderedDict[str, Session] = OrderedDict()
        self._clients = itertools.count(1)
        self._attached = 0  # client slots taken, counting opens still under way
        self._starting = 0  # sessions being started (not yet in `_live`)
        self._nursery: trio.Nursery | None = None
        self._jsend, self._jrecv = trio.open_memory_channel[
            tuple[str, dict[str, Any], str | None, str]
        ](math.inf)
        self._queued = self._written = 0
        self._settled = trio.Event()

    # -- lifetime ---------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve sessions until cancelled; then end every session ("shutdown")."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._journal_writer)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            with trio.CancelScope(shield=True):
                for live in list(self._live.values()):
                    await self._end(live, "shutdown", None)
                await self._drain_journal()

    async def _journal_writer(self) -> None:
        async for kind, data, workspace, actor in self._jrecv:
            await self._write_entry(kind, data, workspace, actor)

    async def _write_entry(
        self, kind: str, data: dict[str, Any], workspace: str | None, actor: str
    ) -> None:
        try:
            await trio.to_thread.run_sync(
                lambda: self._journal.append(kind, data, workspace=workspace, actor=actor)
            )
        except Exception:
            log.exception("journal append of %s failed", kind)
        finally:
            self._written += 1
            self._settled.set()

    async def _drain_journal(self) -> None:
        while True:
            try:
                entry = self._jrecv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            await self._write_entry(*entry)

    def record(
        self,
        kind: str,
        data: dict[str, Any],
        *,
        workspace: str | None = None,
        actor: str = "daemon",
    ) -> None:
        """Queue a journal entry (written in order by one task; never blocks)."""
        self._queued += 1
        self._jsend.send_nowait((kind, data, workspace, actor))

    def _log(self, kind: str, live: Live, actor: str, **data: Any) -> None:
        self.record(
            kind,
            {"session": live.session.id, **data},
            workspace=live.session.workspace,
            actor=actor,
        )

    async def settle(self) -> None:
        """Wait until every journal entry queued so far is written (for tests)."""
        while self._queued != self._written:
            self._settled = trio.Event()
            await self._settled.wait()

    # -- opening and attaching ----------------------------------------------------------

    async def open(self, f: Open, kick: Kick) -> Attached:
        """Start (no `session`) or join a session for a client. Refuses as documented.

        The client slot is reserved before the first await and given back on a refusal,
        so concurrent opens can never pass `max_clients` together.
        """
        if self._nursery is None:
            raise LimitExceeded("the terminal service is not running")
        if self._attached >= self.settings.max_clients:
            raise LimitExceeded("too many terminal connections", limit=self.settings.max_clients)
        self._attached += 1
        try:
            if f.session is None:
                attached = await self._start(f)
            else:
                attached = await self._join(f)
        except BaseException:
            self._attached -= 1
            raise
        live = attached.live
        live.kicks[attached.client] = (attached.grant, kick)
        self._log(
            "pty.attached",
            live,
            f"terminal:{attached.grant}",
            client=attached.client,
            mode=attached.mode,
            grant=attached.grant,
            since=f.since,
        )
        return attached

    async def _start(self, f: Open) -> Attached:
        if f.mode != "control":
            raise InvalidParams("a new session is opened with mode control", path="$.mode")
        running = sum(1 for live in self._live.values() if live.session.state == "running")
        if running + self._starting >= self.settings.max_sessions:
            raise LimitExceeded("too many terminal sessions", limit=self.settings.max_sessions)
        # Reserve the session slot before the first await; `_live` holds it once started.
        self._starting += 1
        try:
            return await self._start_reserved(f)
        finally:
            self._starting -= 1

    async def _start_reserved(self, f: Open) -> Attached:
        grant = await trio.to_thread.run_sync(lambda: self.grants.check(f.token, need_use=True))
        if self._check_workspace is not None:
            self._check_workspace(grant.workspace)
        sid = "t-" + secrets.token_hex(8)
        proc = await self._spawner(
            workspace=grant.workspace,
            profile=grant.profile,
            cols=f.cols,
            rows=f.rows,
            session=sid,
            actor=f"terminal:{grant.id}",
        )
        try:
            grant = await trio.to_thread.run_sync(
                lambda: self.grants.use(
                    f.token, session=sid, actor=f"terminal:{grant.id}", mode="control"
                )
            )
        except BaseException:
            with trio.CancelScope(shield=True):
                await proc.terminate()
            raise
        now = trio.current_time()
        session = Session(
            id=sid,
            workspace=grant.workspace,
            profile=grant.profile,
            grant=grant.id,
            cols=f.cols,
            rows=f.rows,
            now=now,
            idle_timeout_s=self.settings.idle_timeout_s,
            ring_capacity=self.settings.ring_bytes,
        )
        live = Live(session=session, proc=proc, started=now)
        live.joined.add(grant.id)
        client = next(self._clients)
        session.attach(client, "control", grant.id, now)
        self._live[sid] = live
        self._log(
            "pty.opened",
            live,
            f"terminal:{grant.id}",
            grant=grant.id,
            profile=grant.profile,
            cols=f.cols,
            rows=f.rows,
            **{"process": proc.info},
        )
        assert self._nursery is not None
        self._nursery.start_soon(self._run_session, live)
        return Attached(live, client, "control", grant.id, 0)

    async def _join(self, f: Open) -> Attached:
        assert f.session is not None
        live = self._live.get(f.session)
        if live is None or live.session.state != "running":
            raise ProcessUnknown("no such running terminal session", session=f.session)
        async with live.lock:
            joined = f.token.split(".", 1)[0] in live.joined
            grant = await trio.to_thread.run_sync(
                lambda: self.grants.check(f.token, need_use=not joined)
            )
            s = live.session
            if (grant.workspace, grant.profile) != (s.workspace, s.profile):
                raise GrantInvalid("this grant is not for this session", grant=grant.id)
            if f.mode == "control" and s.controller is not None:
                raise ControllerBusy("this session already has a controller", session=s.id)
            if grant.id not in live.joined:
                await trio.to_thread.run_sync(
                    lambda: self.grants.use(
                        f.token,
                        session=s.id,
                        actor=f"terminal:{grant.id}",
                        mode=f.mode,
                    )
                )
                live.joined.add(grant.id)
            if s.state != "running":
                raise ProcessUnknown("the terminal session has ended", session=s.id)
            client = next(self._clients)
            s.attach(client, f.mode, grant.id, trio.current_time())
        start = s.ring.start if f.since is None else f.since
        return Attached(live, client, f.mode, grant.id, start)

    def detach(self, attached: Attached, reason: str) -> None:
        """The client's connection is gone; the session lives on."""
        live = attached.live
        if live.kicks.pop(attached.client, None) is None:
            return
        self._attached -= 1
        live.session.detach(attached.client, trio.current_time())
        self._log(
            "pty.detached",
            live,
            f"terminal:{attached.grant}",
            client=attached.client,
            mode=attached.mode,
            reason=reason,
        )

    # -- client frames ------------------------------------------------------------------

    async def input(self, attached: Attached, data: str) -> None:
        """Keystrokes from a client: the controller's go to the PTY (`unauthorized` else)."""
        live = attached.live
        live.session.check_input(attached.client, trio.current_time())
        if live.session.state == "running":
            await live.proc.write(data.encode("utf-8", errors="replace"))

    def resize(self, attached: Attached, cols: int, rows: int) -> None:
        """The controller's window size; the PTY follows soon (the resizer applies the
        latest size only). An observer's is ignored. Never waits."""
        live = attached.live
        if not live.session.resize(attached.client, cols, rows):
            return
        live.resize_wanted.set()
        now = trio.current_time()
        # Dragging a window sends many resizes: journal at most one a second; the final
        # size is in `pty.closed` anyway.
        if now - live.last_resize_journaled >= 1.0:
            live.last_resize_journaled = now
            self._log("pty.resized", live, f"terminal:{attached.grant}", cols=cols, rows=rows)

    async def close_frame(self, attached: Attached) -> None:
        """A `close` frame: the controller ends the session, an observer leaves."""
        live = attached.live
        is_controller = live.session.attached.get(attached.client)
        if is_controller is not None and is_controller.mode == "control":
            await self._end(live, "close", None)

    # -- the session's tasks ------------------------------------------------------------

    async def _run_session(self, live: Live) -> None:
        with live.scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._idle_watch, live)
                nursery.start_soon(self._resizer, live)
                await self._pump(live)
                nursery.cancel_scope.cancel()

    async def _pump(self, live: Live) -> None:
        try:
            while True:
                data = await live.proc.read(65536)
                if not data:
                    break
                live.session.output(data, trio.current_time())
                live.wake()
            code = await live.proc.wait()
        except Exception:
            log.exception("terminal session %s failed", live.session.id)
            await self._end(live, "error", None)
            return
        await self._end(live, "exit", code)

    async def _resizer(self, live: Live) -> None:
        """Resize the PTY to the controller's latest size whenever it differs from the
        PTY's, then wait `RESIZE_INTERVAL_S`: the sizes asked for meanwhile collapse into
        the last. A resize that fails is logged; the next size is tried all the same."""
        applied = (live.session.cols, live.session.rows)  # the size the PTY started with
        while True:
            await live.resize_wanted.wait()
            live.resize_wanted = trio.Event()
            wanted = (live.session.cols, live.session.rows)
            if wanted == applied:
                continue
            try:
                await live.proc.resize(*wanted)
            except Exception:
                log.warning("terminal session %s: resize failed", live.session.id, exc_info=True)
            applied = wanted
            await trio.sleep(RESIZE_INTERVAL_S)

    async def _idle_watch(self, live: Live) -> None:
        while True:
            await trio.sleep_until(live.session.idle_deadline())
            if live.session.is_idle(trio.current_time()):
                await self._end(live, "idle", None)
                return

    async def _end(self, live: Live, reason: str, code: int | None) -> None:
        """End a session once: stop the process, tell the readers, journal it."""
        s = live.session
        if s.state != "running":
            return
        # Mark first so that no second caller and no new client gets in meanwhile.
        s.end(reason, code)
        if code is None:
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(self.settings.terminate_timeout_s),
            ):
                await live.proc.terminate()
                s.exit_code = await live.proc.wait()
        else:
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(self.settings.terminate_timeout_s),
            ):
                await live.proc.terminate()
        live.scope.cancel()
        live.wake()
        self._live.pop(s.id, None)
        self._ended[s.id] = s
        while len(self._ended) > self.settings.keep_ended:
            self._ended.popitem(last=False)
        self._log(
            "pty.closed",
            live,
            "daemon",
            reason=reason,
            exit_code=s.exit_code,
            cols=s.cols,
            rows=s.rows,
            bytes=s.ring.end,
            duration_s=round(trio.current_time() - live.started, 3),
            **live.proc.ended,
        )

    async def revoke_grant(self, grant: str) -> int:
        """After `grant.revoke`: end the sessions it started, disconnect its clients."""
        n = 0
        for live in list(self._live.values()):
            if live.session.grant == grant:
                for _g, kick in list(live.kicks.values()):
                    kick(4401, _REVOKED, "revoked")
                await self._end(live, "revoked", None)
                n += 1
                continue
            for g, kick in list(live.kicks.values()):
                if g == grant:
                    kick(4401, _REVOKED, "revoked")
        return n

    # -- agents ---------------------------------------------------------------------------

    def _find(self, session: str) -> Session:
        live = self._live.get(session)
        if live is not None:
            return live.session
        ended = self._ended.get(session)
        if ended is None:
            raise ProcessUnknown("no such terminal session", session=session)
        return ended

    def selection(self, session: str, since: int | None, max_bytes: int) -> SelectionResult:
        """Scrollback for agents: from `since` (or the newest `max_bytes`), bounded, text."""
        s = self._find(session)
        ring = s.ring
        if since is None:
            first = max(ring.start, ring.end - max_bytes)
        else:
            first = min(max(since, ring.start), ring.end)
        data = ring.read(first, max_bytes)
        text, first, nxt = _whole_characters(data, first, cut=first != since and first > 0)
        return SelectionResult(
            session=s.id,
            seq=first,
            next=nxt,
            end=ring.end,
            truncated=since is not None and since < ring.start,
            data=text,
        )

    def list(self) -> SessionList:
        """Running sessions, then the ended ones still kept."""
        out: list[SessionInfo] = []
        sessions = [live.session for live in self._live.values()] + list(self._ended.values())
        for s in sessions:
            out.append(
                SessionInfo(
                    session=s.id,
                    workspace=s.workspace,
                    profile=s.profile,
                    state=s.state,
                    cols=s.cols,
                    rows=s.rows,
                    controller=s.controller is not None,
                    observers=sum(1 for a in s.attached.values() if a.mode == "observe"),
                    end=s.ring.end,
                    exit_code=s.exit_code,
                )
            )
        return SessionList(sessions=out)


def _whole_characters(data: bytes, first: int, *, cut: bool) -> tuple[str, int, int]:
    """Decode a slice without a split character at either end: (text, first, next)."""
    if cut:
        skip = 0
        while skip < min(3, len(data)) and 0x80 <= data[skip] <= 0xBF:
            skip += 1
        data = data[skip:]
        first += skip
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = dec.decode(data)
    pending = len(dec.getstate()[0])
    return text, first, first + len(data) - pending


__all__ = ["Attached", "Live", "TerminalSettings", "Terminals"]
