"""Who called, on which connection: what a handler learns about its caller."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

#: Which socket a connection came in on: the agent's (0660) or the operator's (0600).
Actor = Literal["agent", "operator"]


@dataclass
class Caller:
    """Who called, on which connection. `notify` sends a notification on that connection."""

    actor: Actor
    uid: int
    connection: int
    notify: Callable[[str, Any], Awaitable[None]]
    #: Cleanups to run when the connection closes (e.g. cancel subscriptions). While any
    #: is registered the connection is held open: it is not idle.
    on_close: list[Callable[[], None]] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The journal's `actor` string."""
        return f"{self.actor}:{self.uid}"
