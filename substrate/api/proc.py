"""Handlers of `proc.*` (docs/protocol.md §5): argv-only commands in verified sandboxes;
`proc.write` and streamed stdin (§14)."""

from __future__ import annotations

import base64
import binascii

import trio

from substrate.api.base import Caller, Handles
from substrate.api.services import ProcServices
from substrate.errors import InvalidParams, StdinClosed, TooLarge
from substrate.layer import check_room, room_now
from substrate.process import intents
from substrate.process.facts_summary import shaped
from substrate.process.processes import RunRequest
from substrate.process.stdin_stream import StdinStream
from substrate.schema.proc import (
    MAX_WRITE_BYTES,
    STDIN_STREAM,
    ListParams,
    ListResult,
    ProcParams,
    ProcPending,
    ProcResult,
    ProcStatus,
    RunParams,
    SignalParams,
    SignalResult,
    StartParams,
    StartResult,
    SubscribeParams,
    SubscribeResult,
    WaitParams,
    WriteParams,
    WriteResult,
)

handles = Handles(ProcServices)


def stdin_bytes(p: StartParams) -> bytes | None:
    """The command's stdin from `stdin` (text) or `stdin_b64`; both is invalid_params."""
    return _text_or_b64(p.stdin, p.stdin_b64, "stdin")


def _text_or_b64(text: str | None, b64: str | None, name: str) -> bytes | None:
    """Bytes from a text field or its `_b64` twin; both, or bad base64, is invalid_params."""
    if text is not None and b64 is not None:
        raise InvalidParams(f"give {name} or {name}_b64, not both", path=f"$.{name}_b64")
    if text is not None:
        return text.encode("utf-8", "surrogatepass")
    if b64 is not None:
        try:
            return base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidParams(f"{name}_b64 is not base64", path=f"$.{name}_b64") from None
    return None


def stdin_of(caller: Caller, p: StartParams) -> bytes | StdinStream | None:
    """`stdin_bytes`, or for `stdin: "stream"` a `StdinStream` owned by `caller`;
    `proc.run` refuses "stream" (`invalid_params`: nobody could write to it)."""
    if p.stdin != STDIN_STREAM:
        return stdin_bytes(p)
    if isinstance(p, RunParams):
        raise InvalidParams(
            'stdin: "stream" needs proc.start (send the text as stdin_b64)', path="$.stdin"
        )
    if p.stdin_b64 is not None:
        raise InvalidParams("give stdin or stdin_b64, not both", path="$.stdin_b64")
    return StdinStream(caller.name)


def profile_name(s: ProcServices, p: StartParams) -> str:
    """The profile a command runs under: the one named, else the daemon's
    `default_profile` (docs/protocol.md §9)."""
    return p.profile if p.profile is not None else s.config.default_profile


def run_request(s: ProcServices, caller: Caller, p: StartParams) -> RunRequest:
    """The runner's request for `proc.run`/`proc.start` params. Refuses
    `unknown_workspace`, and `invalid_params` for bad stdin (see `stdin_of`) or for
    `changes` other than "apply" on a profile without a working layer (its writes land
    directly: nothing could be kept or discarded)."""
    name = profile_name(s, p)
    if p.changes != "apply":
        profile = s.profiles.by_name.get(name)
        if profile is not None and profile.workspace != "layer":
            raise InvalidParams(
                f'changes = "{p.changes}" needs a workspace = "layer" profile',
                path="$.changes",
            )
    return RunRequest(
        ws=s.workspaces.get(p.workspace),
        profile=name,
        argv=tuple(p.argv),
        cwd=p.cwd,
        stdin=stdin_of(caller, p),
        timeout_s=p.timeout_s,
        actor=caller.name,
        changes=p.changes,
    )


async def checked_request(s: ProcServices, caller: Caller, p: StartParams) -> RunRequest:
    """`run_request`, and on a `workspace = "layer"` profile the cap on change sets kept
    per workspace (`limit_exceeded`, `scope: "kept_changesets"`; docs/working-layer.md):
    refused before anything runs."""
    req = run_request(s, caller, p)
    profile = s.profiles.by_name.get(req.profile)
    if profile is not None and profile.workspace == "layer":
        room = (s.changesets, req.ws.id, p.changes, s.config.max_kept_changesets)
        if not room_now(*room):  # the database busy: wait for it off the event loop
            await trio.to_thread.run_sync(check_room, *room)
    return req


@handles("proc.run")
async def run(s: ProcServices, caller: Caller, p: RunParams) -> ProcResult:
    result = await s.processes.run(await checked_request(s, caller, p))
    return shaped(result, p.facts)


@handles("proc.start")
async def start(s: ProcServices, caller: Caller, p: StartParams) -> StartResult:
    proc = await s.processes.start(await checked_request(s, caller, p))
    return StartResult(proc=proc)


@handles("proc.wait")
async def wait(s: ProcServices, caller: Caller, p: WaitParams) -> ProcResult | ProcPending:
    return await intents.wait(s.processes, p.proc, p.timeout_s, p.facts)


@handles("proc.signal")
async def signal(s: ProcServices, caller: Caller, p: SignalParams) -> SignalResult:
    processes = s.processes
    delivered = await processes.signal(p.proc, p.signal)
    if delivered is not None:
        return SignalResult(proc=p.proc, state="running", delivered=delivered)
    found = await intents.status(processes, p.proc)  # process_unknown, or it ended
    return SignalResult(proc=p.proc, state=found.state, delivered=0)


@handles("proc.status")
async def status(s: ProcServices, caller: Caller, p: ProcParams) -> ProcStatus:
    return await intents.status(s.processes, p.proc, p.facts)


@handles("proc.list")
async def list_(s: ProcServices, caller: Caller, p: ListParams) -> ListResult:
    processes = s.processes
    if p.workspace is not None:
        s.workspaces.get(p.workspace)  # unknown_workspace
    return ListResult(processes=await intents.listing(processes, p.workspace, p.limit))


@handles("proc.subscribe")
async def subscribe(s: ProcServices, caller: Caller, p: SubscribeParams) -> SubscribeResult:
    processes = s.processes
    await intents.subscribe(processes, p.proc, p.since, caller.notify, caller.on_close, p.facts)
    return SubscribeResult(proc=p.proc, subscribed=True)


@handles("proc.write")
async def write(s: ProcServices, caller: Caller, p: WriteParams) -> WriteResult:
    """Refuses `invalid_params` (data and data_b64, bad base64), `too_large` (over
    `MAX_WRITE_BYTES`), `process_unknown`, `unauthorized` (not the starter nor the
    operator), `stdin_closed`, `limit_exceeded` (no room in time; see
    `substrate.process.stdin_stream`)."""
    data = _text_or_b64(p.data, p.data_b64, "data") or b""
    if len(data) > MAX_WRITE_BYTES:
        raise TooLarge(
            f"a proc.write carries at most {MAX_WRITE_BYTES} bytes", limit=MAX_WRITE_BYTES
        )
    processes = s.processes
    entry = processes.live(p.proc)
    if entry is None:
        await intents.status(processes, p.proc)  # process_unknown; waits out a start
        entry = processes.live(p.proc)
        if entry is None:
            raise StdinClosed("the command has ended", reason="ended")
    stream = entry.stdin
    if stream is None:
        raise StdinClosed('the command was not started with stdin: "stream"', reason="not_streamed")
    stream.check_writer(caller.name, operator=caller.actor == "operator")
    state = await stream.write(data, eof=p.eof)
    return WriteResult(
        proc=p.proc,
        accepted=state.accepted,
        buffered=state.buffered,
        written=state.written,
        eof=state.eof,
    )
