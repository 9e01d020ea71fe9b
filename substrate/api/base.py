"""The handler table: one async function per wire method.

A handler takes the running `Daemon`, the `Caller` and the method's validated params
Struct, and returns the method's result Struct (or raises a `Refusal`). Handlers live in
`substrate/api/<domain>.py` and register with `@handles("name")`; `dispatcher(daemon)`
is what the daemon gives the server to run them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from substrate.errors import Internal
from substrate.protocol.caller import Actor, Caller
from substrate.protocol.server import Dispatcher
from substrate.schema import METHODS

if TYPE_CHECKING:
    from substrate.daemon import Daemon

__all__ = ["HANDLERS", "Actor", "Caller", "Handler", "dispatcher", "handles"]

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


def dispatcher(daemon: Daemon) -> Dispatcher:
    """The server's dispatcher for `daemon`: runs the registered handler of a method.

    A declared method without a handler is `internal` (tests/test_schema.py keeps the
    table and the handlers in step).
    """

    async def dispatch(method: str, caller: Caller, params: Any) -> Any:
        handler = HANDLERS.get(method)
        if handler is None:
            raise Internal(f"{method} has no handler")
        return await handler(daemon, caller, params)

    return dispatch
