"""Wire schema of agent turns (docs/protocol.md §17): `agent.start`, `agent.wait`."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from substrate.schema.common import Params, Result, WorkspaceId, method

#: The providers (`substrate.agents.PROVIDERS`).
ProviderName = Literal["claude-code", "codex"]
#: A CLI's session id: a plain token (`substrate.agents.envelope.SESSION_ID_RE`).
SessionId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")]
#: The longest prompt in characters; its UTF-8 must also fit 1 MiB.
MAX_PROMPT_CHARS = 1 << 20
ToolName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
PathGlob = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]


class AgentStartParams(Params):
    workspace: WorkspaceId
    provider: ProviderName
    prompt: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PROMPT_CHARS)]
    #: The CLI's tool names the turn may use (each provider translates them to its flags).
    allowed_tools: Annotated[list[ToolName], msgspec.Meta(max_length=64)] = msgspec.field(
        default_factory=list
    )
    #: Globs (the policy's syntax) whose changes apply when the turn ends; the rest of
    #: what it changed waits for a person (`changes.apply`). Only with `changes: "review"`.
    allowed_paths: Annotated[list[PathGlob], msgspec.Meta(max_length=64)] = msgspec.field(
        default_factory=list
    )
    resume: SessionId | None = None
    changes: Literal["review", "apply"] = "review"
    #: The operator's profile for the turn; default: the one named like the provider.
    profile: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None


class AgentStartResult(Result):
    turn: str
    #: The command running the CLI: `proc.subscribe` streams its JSON lines.
    proc: str


class AgentWaitParams(Params):
    turn: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    timeout_s: Annotated[float, msgspec.Meta(ge=0)] | None = None


class AgentTool(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    paths: list[str] = msgspec.field(default_factory=list)


class AgentTurn(Result, omit_defaults=False):
    turn: str
    proc: str
    provider: str
    state: Literal["running", "finished"]
    exit_code: int | None = None
    timed_out: bool = False
    #: The CLI's session id (for `resume`), when it named a valid one.
    session: str | None = None
    tool_calls: int = 0
    tool_failures: int = 0
    #: The first 256 tool calls: names and the workspace paths they named.
    tools: list[AgentTool] = msgspec.field(default_factory=list)
    #: Error envelopes by reason (`malformed_line`, `exited_mid_stream`, the CLI's, ...).
    errors: dict[str, int] = msgspec.field(default_factory=dict)
    input_tokens: int = 0
    output_tokens: int = 0
    #: The turn's change set, and what the gate did with it: paths applied (allowed and
    #: let through by the policy), and paths left for a person.
    changeset: str | None = None
    applied: list[str] = msgspec.field(default_factory=list)
    left: list[str] = msgspec.field(default_factory=list)


method(
    "agent.start",
    AgentStartParams,
    AgentStartResult,
    mutating=True,
    doc="Run one turn of an agent CLI in the workspace's sandbox; its stream via proc.subscribe.",
)
method(
    "agent.wait",
    AgentWaitParams,
    AgentTurn,
    doc="A turn's record: its session, tools, errors and what its gate applied.",
)
