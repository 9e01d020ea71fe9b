"""The handler table: one async function per wire method.

A handler takes the running `Daemon`, the `Caller` and the method's validated params
Struct, and returns the method's result Struct (or raises a `Refusal`). Handlers live in
`substrate/api/<domain>.py` and register with `@handles("name")`; the server dispatches.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from substrate.schema import METHODS

if TYPE_CHECKING:
    from substrate.daemon import Daemon

Actor = Literal["agent", "operator"]


@dataclass
class Caller:
    """Who called, on which connection. `notify` sends a notification on that connection."""

    actor: Actor
    uid: int
    connection: int
    notify: Callable[[str, Any], Awaitable[None]]
    #: Cleanups to run when the connection closes (e.g. cancel subscriptions).
    on_close: list[Callable[[], None]] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The journal's `actor` string."""
        return f"{self.actor}:{self.uid}"


Handler = Callable[["Daemon", Caller, Any], Awaitable[Any]]
HANDLERS: dict[str, Handler] = {}

F = TypeVar("F", bound=Handler)


def handles(name: str) -> Callable[[F], F]:
    """Register the handler of a method declared in `substrate.schema`."""
    if name not in METHODS:
        raise RuntimeError(f"handler for undeclared method {name}")

    def register(fn: F) -> F:
        if name in HANDLERS:
            raise RuntimeError(f"two handlers for {name}")
        HANDLERS[name] = fn
        return fn

    return register
