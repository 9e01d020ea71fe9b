"""Handlers of `agent.*` (docs/protocol.md §17): one turn of an agent CLI in a sandbox."""

from __future__ import annotations

from substrate.api.base import Caller, Handles
from substrate.api.services import AgentServices
from substrate.schema.agents import AgentStartParams, AgentStartResult, AgentTurn, AgentWaitParams

handles = Handles(AgentServices)


@handles("agent.start")
async def start(s: AgentServices, caller: Caller, p: AgentStartParams) -> AgentStartResult:
    ws = s.workspaces.get(p.workspace)
    turn = await s.turns.start(ws, p, caller.name)
    return AgentStartResult(turn=turn.turn, proc=turn.proc)


@handles("agent.wait")
async def wait(s: AgentServices, caller: Caller, p: AgentWaitParams) -> AgentTurn:
    return await s.turns.wait(p.turn, p.timeout_s)
