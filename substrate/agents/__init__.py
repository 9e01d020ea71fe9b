"""Agent CLIs run as substrate turns (docs/agent-provider.md).

- `envelope`: the one vocabulary every CLI's stream is parsed into, and the bounded
  line splitter.
- `provider`: the provider contract (turn command, stream parser, gate, audit, session)
  and the `TurnSpec`.
- `claude_code`, `codex`: the two providers.
- `turns`: the daemon's side of a turn (`agent.start` / `agent.wait`): the command
  started in the workspace's sandbox, its stream followed and audited into the journal,
  the gate applied when it ends.
"""

from __future__ import annotations

from substrate.agents.claude_code import ClaudeCode
from substrate.agents.codex import Codex
from substrate.agents.envelope import Envelope, LineSplitter
from substrate.agents.provider import AgentProvider, Gate, TurnAudit, TurnCommand, TurnSpec

#: The providers by name (`agent.start {provider}`, `substrate agent run --provider`).
PROVIDERS: dict[str, AgentProvider] = {"claude-code": ClaudeCode(), "codex": Codex()}

__all__ = [
    "PROVIDERS",
    "AgentProvider",
    "ClaudeCode",
    "Codex",
    "Envelope",
    "Gate",
    "LineSplitter",
    "TurnAudit",
    "TurnCommand",
    "TurnSpec",
]
