"""Handlers of `proc.*` (docs/protocol.md §5): argv-only commands in verified sandboxes."""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING

import trio

from substrate.api.base import Caller, handles
from substrate.errors import InvalidParams
from substrate.process import intents, layer_keep
from substrate.process.runner import RunRequest
from substrate.schema.proc import (
    ListParams,
    ListResult,
    ProcParams,
    ProcPending,
    ProcResult,
    ProcStatus,
    RunParams,
    SignalParams,
    SignalResult,
    StartResult,
    SubscribeParams,
    SubscribeResult,
    WaitParams,
)

if TYPE_CHECKING:
    from substrate.daemon import Daemon
    from substrate.process.service import Execution


def execution_of(daemon: Daemon) -> Execution:
    """The daemon's execution layer."""
    return daemon.execution


def stdin_bytes(p: RunParams) -> bytes | None:
    """The command's stdin from `stdin` (text) or `stdin_b64`; both is invalid_params."""
    if p.stdin is not None and p.stdin_b64 is not None:
        raise InvalidParams("give stdin or stdin_b64, not both", path="$.stdin_b64")
    if p.stdin is not None:
        return p.stdin.encode("utf-8", "surrogatepass")
    if p.stdin_b64 is not None:
        try:
            return base64.b64decode(p.stdin_b64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidParams("stdin_b64 is not base64", path="$.stdin_b64") from None
    return None


def run_request(daemon: Daemon, caller: Caller, p: RunParams) -> RunRequest:
    """The runner's request for `proc.run`/`proc.start` params. Refuses
    `unknown_workspace`, and `invalid_params` for bad stdin (see `stdin_bytes`) or for
    `changes` other than "apply" on a profile without a working layer (its writes land
    directly: nothing could be kept or discarded)."""
    if p.changes != "apply":
        profile = daemon.execution.profiles.get(p.profile)
        if profile is not None and profile.workspace != "layer":
            raise InvalidParams(
                f'changes = "{p.changes}" needs a workspace = "layer" profile',
                path="$.changes",
            )
    return RunRequest(
        ws=daemon.workspaces.get(p.workspace),
        profile=p.profile,
        argv=tuple(p.argv),
        cwd=p.cwd,
        stdin=stdin_bytes(p),
        timeout_s=p.timeout_s,
        actor=caller.name,
        changes=p.changes,
    )


async def checked_request(daemon: Daemon, caller: Caller, p: RunParams) -> RunRequest:
    """`run_request`, and on a `workspace = "layer"` profile the cap on change sets kept
    per workspace (`limit_exceeded`, `scope: "kept_changesets"`; docs/working-layer.md):
    refused before anything runs."""
    req = run_request(daemon, caller, p)
    execution = execution_of(daemon)
    profile = execution.profiles.get(p.profile)
    if profile is not None and profile.workspace == "layer":
        await trio.to_thread.run_sync(
            layer_keep.check_room,
            execution.changesets,
            req.ws.id,
            p.changes,
            execution.config.max_kept_changesets,
        )
    return req


@handles("proc.run")
async def run(daemon: Daemon, caller: Caller, p: RunParams) -> ProcResult:
    execution = execution_of(daemon)
    return await execution.processes.run(await checked_request(daemon, caller, p))


@handles("proc.start")
async def start(daemon: Daemon, caller: Caller, p: RunParams) -> StartResult:
    execution = execution_of(daemon)
    proc = await execution.processes.start(await checked_request(daemon, caller, p))
    return StartResult(proc=proc)


@handles("proc.wait")
async def wait(daemon: Daemon, caller: Caller, p: WaitParams) -> ProcResult | ProcPending:
    return await intents.wait(execution_of(daemon).processes, p.proc, p.timeout_s)


@handles("proc.signal")
async def signal(daemon: Daemon, caller: Caller, p: SignalParams) -> SignalResult:
    processes = execution_of(daemon).processes
    delivered = await processes.signal(p.proc, p.signal)
    if delivered is not None:
        return SignalResult(proc=p.proc, state="running", delivered=delivered)
    found = await intents.status(processes, p.proc)  # process_unknown, or it ended
    return SignalResult(proc=p.proc, state=found.state, delivered=0)


@handles("proc.status")
async def status(daemon: Daemon, caller: Caller, p: ProcParams) -> ProcStatus:
    return await intents.status(execution_of(daemon).processes, p.proc)


@handles("proc.list")
async def list_(daemon: Daemon, caller: Caller, p: ListParams) -> ListResult:
    processes = execution_of(daemon).processes
    if p.workspace is not None:
        daemon.workspaces.get(p.workspace)  # unknown_workspace
    return ListResult(processes=await intents.listing(processes, p.workspace, p.limit))


@handles("proc.subscribe")
async def subscribe(daemon: Daemon, caller: Caller, p: SubscribeParams) -> SubscribeResult:
    processes = execution_of(daemon).processes
    await intents.subscribe(processes, p.proc, p.since, caller.notify, caller.on_close)
    return SubscribeResult(proc=p.proc, subscribed=True)
