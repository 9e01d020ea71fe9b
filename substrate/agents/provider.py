"""The agent-provider contract: what substrate needs of an agent CLI to run its turn.

A provider has five members (docs/agent-provider.md "Providers"):

1. `command(spec, profile_env)`: the turn's argv and stdin from a `TurnSpec` — the
   prompt goes on stdin (never argv: argv is recorded, and a 1 MiB prompt would not
   fit), the allowed tools become the CLI's own flags, a session to resume its own flag;
   the environment is the operator's profile's (the model key a secret there, the model
   endpoint, the CLI's switches: docs/agent-provider.md), read here, never added to;
2. `parser()`: a `StreamParser` that turns the CLI's JSON lines into `Envelope`s;
3. the gate, shared by every provider (`Gate`): the turn runs with `changes = "review"`;
   what it changed under one of the turn's `allowed_paths` is applied through the
   guarded path (the workspace policy still decides), the rest stays for a person;
4. the audit, shared too (`TurnAudit`): tool names, workspace paths and counts for the
   journal's `agent.turn` / `agent.tool`, never prompt, text, tool input or tokens;
5. session capture and resume: the parser's `session` envelope names the CLI's session,
   which lives in the persistent home, and `command` turns `spec.resume` into the flag.

Pure: nothing here runs anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from substrate.agents.envelope import Envelope
from substrate.workspace.policy import GlobSet

#: The largest prompt, bytes of UTF-8.
MAX_PROMPT_BYTES = 1 << 20
#: Tool calls the audit names one by one; past it, only counted.
MAX_AUDITED_TOOLS = 256
#: Paths kept per turn in the audit.
MAX_AUDITED_PATHS = 256


class TurnSpec(msgspec.Struct, frozen=True, kw_only=True):
    prompt: str
    #: The CLI's tool names the turn may use without asking (each provider translates).
    allowed_tools: tuple[str, ...] = ()
    #: Globs over workspace paths whose changes apply at the turn's end; the rest wait.
    allowed_paths: tuple[str, ...] = ()
    #: A session id from an earlier turn's `session` envelope.
    resume: str | None = None


@dataclass(frozen=True)
class TurnCommand:
    argv: tuple[str, ...]
    stdin: bytes


class StreamParser(Protocol):
    def line(self, line: bytes) -> list[Envelope]:
        """The envelopes one complete JSON line of the CLI's stdout makes (an unparsable
        line: one `malformed_line` error)."""
        ...

    def finished(self, exit_code: int | None) -> list[Envelope]:
        """At the end of the stream: an error if the CLI stopped before its own end."""
        ...


class AgentProvider(Protocol):
    @property
    def name(self) -> str: ...

    #: `argv[0]` of the turn: the profile's `argv_allow` must allow it.
    @property
    def program(self) -> str: ...

    def command(self, spec: TurnSpec, profile_env: Mapping[str, str]) -> TurnCommand: ...

    def parser(self) -> StreamParser: ...


@dataclass
class TurnAudit:
    """What the journal keeps of a turn (module doc, member 4); bounded."""

    tools: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    tool_calls: int = 0
    tool_failures: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    paths: list[str] = field(default_factory=list)
    session: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0

    def add(self, env: Envelope) -> tuple[str, tuple[str, ...]] | None:
        """Count `env`; a tool call to journal as `agent.tool` is returned (name, paths)."""
        if env.kind == "session":
            self.session = env.session
        elif env.kind == "usage":
            self.input_tokens += env.input_tokens or 0
            self.output_tokens += env.output_tokens or 0
        elif env.kind == "error":
            reason = env.reason or "cli_error"
            if reason in self.errors or len(self.errors) < 32:
                self.errors[reason] = self.errors.get(reason, 0) + 1
        elif env.kind == "tool_result" and env.ok is False:
            self.tool_failures += 1
        elif env.kind == "tool_call":
            self.tool_calls += 1
            for p in env.paths:
                if p not in self.paths and len(self.paths) < MAX_AUDITED_PATHS:
                    self.paths.append(p)
            if len(self.tools) < MAX_AUDITED_TOOLS:
                named = ((env.tool or "?")[:128], env.paths)
                self.tools.append(named)
                return named
        return None


class Gate:
    """Which changed paths of a turn apply at its end (module doc, member 3)."""

    def __init__(self, allowed_paths: Sequence[str]) -> None:
        """Globs as the policy's (`write_allow`'s syntax); refuses `invalid_params`."""
        self._globs = GlobSet.of(allowed_paths)

    def allows(self, path: str) -> bool:
        return self._globs.matches(path)

    def split(self, paths: Sequence[str]) -> tuple[list[str], list[str]]:
        """(to apply, to leave for a person)."""
        apply = [p for p in paths if self.allows(p)]
        return apply, [p for p in paths if not self.allows(p)]
