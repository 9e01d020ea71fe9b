"""The daemon's side of an agent turn: `agent.start` and `agent.wait` (docs/protocol.md §17).

Theory of operation. `start` builds the turn's command with its provider (the prompt
on stdin), checks it as any `proc.start` is checked (the profile is the operator's: its
`argv_allow` must allow the CLI, its egress, secrets and home are the turn's) and starts
it; the client streams the CLI's JSON lines with `proc.subscribe` and parses them with
the same provider (`substrate.agents`), live. A task of the service nursery waits for
the command to end, then:

1. reads its stdout from where the runner put it (inline or the artifact), a piece at a
   time through the bounded `LineSplitter`, and parses it into envelopes, counted into a
   `TurnAudit` — a 10 MB line, malformed JSON, a CLI cut off mid-stream are error
   envelopes, never more memory;
2. applies the gate: on a `review` turn, the changes under the turn's `allowed_paths` go
   through `changes.apply` (the guarded path: policy, bases, journal); the rest stay in
   the kept set for a person. When others shared the turn's generation (a terminal, a
   command still running), its changes are concluded when the last of them ends, and
   the gate waits for that (`LayerUsers.conclusion_of`): the record is `running` until;
3. journals one `agent.tool` per tool call (its name and the workspace paths it named;
   at most `MAX_AUDITED_TOOLS`) and one `agent.turn` (provider, session id, exit, counts,
   the gate's outcome) — never prompt, text, tool input or tokens.

Records live in memory, the last `MAX_TURNS`; after a restart the journal is the record
and `agent.wait` refuses `turn_unknown`.
"""

from __future__ import annotations

import logging
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from substrate.agents import PROVIDERS
from substrate.agents.envelope import Envelope, LineSplitter
from substrate.agents.provider import AgentProvider, Gate, TurnAudit, TurnSpec
from substrate.errors import InvalidParams, ProfileUnknown, Refusal, TooLarge, TurnUnknown
from substrate.layer import Changesets, check_room
from substrate.process import intents
from substrate.process.processes import Processes, RunRequest
from substrate.process.profile_registry import ProfileRegistry
from substrate.schema.agents import AgentStartParams, AgentTool, AgentTurn
from substrate.schema.proc import ProcPending, ProcResult
from substrate.store.journal import Draft, Journal
from substrate.workspace.registry import Workspace
from substrate.workspace.writes import Writer

log = logging.getLogger("substrate.agents.turns")

#: Turn records kept in memory (the oldest finished ones go first).
MAX_TURNS = 256
#: Bytes of a turn's stdout read per piece when it is parsed.
READ_PIECE = 1 << 20
#: The most of a turn's stdout parsed for its audit (a longer stream is counted, cut).
MAX_PARSED_BYTES = 256 << 20


@dataclass
class TurnState:
    turn: str
    proc: str
    provider: str
    workspace: str
    actor: str
    done: trio.Event = field(default_factory=trio.Event)
    record: AgentTurn | None = None


class Turns:
    def __init__(
        self,
        *,
        processes: Processes,
        profiles: ProfileRegistry,
        changesets: Changesets,
        writer: Writer,
        journal: Journal,
        max_kept_changesets: int,
    ) -> None:
        self._processes = processes
        self._profiles = profiles
        self._changesets = changesets
        self._writer = writer
        self._journal = journal
        self._max_kept = max_kept_changesets
        self._turns: OrderedDict[str, TurnState] = OrderedDict()

    async def start(self, ws: Workspace, p: AgentStartParams, actor: str) -> TurnState:
        """Refuses `invalid_params` (a prompt over 1 MiB of UTF-8, bad `allowed_paths`
        globs, `allowed_paths` on an `apply` turn, tools the CLI has no switch for),
        `profile_unknown`, and whatever `proc.start` refuses (`argv_denied` when the
        profile does not allow the CLI, `limit_exceeded`, `confinement_unmet`, ...)."""
        provider: AgentProvider = PROVIDERS[p.provider]
        if len(p.prompt.encode("utf-8", "surrogatepass")) > 1 << 20:
            raise TooLarge("the prompt is over 1 MiB of UTF-8", limit=1 << 20)
        if p.allowed_paths and p.changes != "review":
            raise InvalidParams('allowed_paths needs changes = "review"', path="$.allowed_paths")
        gate = Gate(p.allowed_paths)
        profile_name = p.profile or provider.name
        profile = self._profiles.by_name.get(profile_name)
        if profile is None:
            raise ProfileUnknown(f"no profile {profile_name!r}", profile=profile_name)
        if profile.workspace != "layer":
            raise InvalidParams(
                'an agent turn needs a workspace = "layer" profile (its gate is the change set)',
                path="$.profile",
            )
        spec = TurnSpec(
            prompt=p.prompt,
            allowed_tools=tuple(p.allowed_tools),
            allowed_paths=tuple(p.allowed_paths),
            resume=p.resume,
        )
        command = provider.command(spec, profile.env)
        await trio.to_thread.run_sync(
            check_room, self._changesets, ws.id, p.changes, self._max_kept
        )
        proc = await self._processes.start(
            RunRequest(
                ws=ws,
                profile=profile.name,
                argv=command.argv,
                stdin=command.stdin,
                timeout_s=p.timeout_s,
                actor=actor,
                changes=p.changes,
            )
        )
        state = TurnState(
            turn="t_" + secrets.token_hex(8),
            proc=proc,
            provider=provider.name,
            workspace=ws.id,
            actor=actor,
        )
        self._remember(state)
        self._processes.nursery.start_soon(self._follow, state, provider, gate, ws)
        return state

    async def wait(self, turn: str, timeout_s: float | None) -> AgentTurn:
        state = self._turns.get(turn)
        if state is None:
            raise TurnUnknown(f"no turn {turn!r} in this daemon run", turn=turn)
        with trio.move_on_after(float("inf") if timeout_s is None else timeout_s):
            await state.done.wait()
        if state.record is None:
            return AgentTurn(
                turn=state.turn, proc=state.proc, provider=state.provider, state="running"
            )
        return state.record

    def _remember(self, state: TurnState) -> None:
        self._turns[state.turn] = state
        while len(self._turns) > MAX_TURNS:
            oldest = next((k for k, s in self._turns.items() if s.done.is_set()), None)
            if oldest is None:
                break
            del self._turns[oldest]

    async def _follow(
        self, state: TurnState, provider: AgentProvider, gate: Gate, ws: Workspace
    ) -> None:
        try:
            result = await intents.wait(self._processes, state.proc, None)
            audit = TurnAudit()
            tools: list[tuple[str, tuple[str, ...]]] = []
            if isinstance(result, ProcResult):
                tools = await trio.to_thread.run_sync(self._parse, provider, result, audit)
            applied, left, changeset = await self._gate(result, gate, ws, state.actor)
            state.record = _record(state, result, audit, applied, left, changeset)
            await trio.to_thread.run_sync(self._journal_turn, state, tools, state.record)
        except Exception:  # a turn's audit failing must not end the service nursery
            log.exception("%s: the turn's conclusion failed", state.turn)
            if state.record is None:
                state.record = AgentTurn(
                    turn=state.turn, proc=state.proc, provider=state.provider, state="finished",
                    errors={"internal": 1},
                )  # fmt: skip
        finally:
            state.done.set()

    def _parse(
        self, provider: AgentProvider, result: ProcResult, audit: TurnAudit
    ) -> list[tuple[str, tuple[str, ...]]]:
        """Blocking: the stdout of the finished command, parsed piece by piece."""
        source = intents.output_source(self._processes, result.stdout)
        parser, splitter = provider.parser(), LineSplitter()
        tools: list[tuple[str, tuple[str, ...]]] = []

        def count(envelopes: list[Envelope]) -> None:
            for envelope in envelopes:
                named = audit.add(envelope)
                if named is not None:
                    tools.append(named)

        size, offset = min(source.size(), MAX_PARSED_BYTES), 0
        while offset < size:
            data = source.read(offset, min(READ_PIECE, size - offset))
            if not data:
                break
            offset += len(data)
            for item in splitter.feed(data):
                count([item] if isinstance(item, Envelope) else parser.line(item))
        last = splitter.end()
        if last is not None:
            count(parser.line(last))
        count(parser.finished(result.exit_code))
        if result.timed_out:
            audit.add(Envelope(kind="error", reason="timed_out"))
        return tools

    async def _gate(
        self, result: ProcResult | ProcPending, gate: Gate, ws: Workspace, actor: str
    ) -> tuple[list[str], list[str], str | None]:
        """(applied, left for a person, the change set's id) of a finished turn."""
        changes = result.changes if isinstance(result, ProcResult) else None
        if changes is not None and changes.deferred:
            # Others share the generation (a terminal, another command): its changes
            # are concluded, with theirs, when the last of them ends.
            changes = await self._processes.layer_users.conclusion_of(result.proc)
        if changes is None or changes.changeset is None:
            return [], [], None
        changeset = changes.changeset
        if changes.mode != "review":
            return [c.path for c in changes.applied], [], changeset
        kept = await trio.to_thread.run_sync(self._changesets.get, changeset)
        to_apply, left = gate.split([c.path for c in kept.changeset.changes])
        if not to_apply:
            return [], left, changeset
        try:
            _, outcome, _ = await trio.to_thread.run_sync(
                self._changesets.apply, self._writer, ws, changeset, to_apply, False, actor
            )
        except Refusal as exc:
            log.warning("turn gate of %s: %s", changeset, exc.name)
            return [], to_apply + left, changeset
        applied = [o.path for o in outcome.applied + outcome.unchanged]
        refused = [o.path for o in outcome.blocked + outcome.pending + outcome.conflicts]
        return applied, refused + left, changeset

    def _journal_turn(
        self, state: TurnState, tools: list[tuple[str, tuple[str, ...]]], record: AgentTurn
    ) -> None:
        """One transaction: every `agent.tool`, then the `agent.turn` (module doc)."""
        drafts = [
            Draft(
                "agent.tool",
                {
                    "turn": state.turn,
                    "provider": state.provider,
                    "tool": name,
                    "paths": list(paths),
                },
                state.workspace,
                state.actor,
            )
            for name, paths in tools
        ]
        summary: dict[str, Any] = msgspec.to_builtins(record)
        summary.pop("tools", None)
        summary.pop("state", None)
        drafts.append(Draft("agent.turn", summary, state.workspace, state.actor))
        with self._journal.store.transaction() as db:
            self._journal.append_many_in(db, drafts)


def _record(
    state: TurnState,
    result: ProcResult | ProcPending,
    audit: TurnAudit,
    applied: list[str],
    left: list[str],
    changeset: str | None,
) -> AgentTurn:
    finished = isinstance(result, ProcResult)
    errors = dict(audit.errors)
    if not finished:
        errors["lost"] = errors.get("lost", 0) + 1
    return AgentTurn(
        turn=state.turn,
        proc=state.proc,
        provider=state.provider,
        state="finished",
        exit_code=result.exit_code if isinstance(result, ProcResult) else None,
        timed_out=result.timed_out if isinstance(result, ProcResult) else False,
        session=audit.session,
        tool_calls=audit.tool_calls,
        tool_failures=audit.tool_failures,
        tools=[AgentTool(name=n, paths=list(p)) for n, p in audit.tools],
        errors=errors,
        input_tokens=audit.input_tokens,
        output_tokens=audit.output_tokens,
        changeset=changeset,
        applied=applied[:1000],
        left=left[:1000],
    )
