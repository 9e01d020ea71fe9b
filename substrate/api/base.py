"""The handler table: one async function per wire method.

A handler takes its group's bundle of services (`substrate.api.services`), the `Caller`
and the method's validated params Struct, and returns the method's result Struct (or
raises a `Refusal`). Handlers live in `substrate/api/<domain>.py`; each module makes its
registrar, `handles = Handles(FsServices)`, and registers with `@handles("name")`.
`dispatcher(*bundles)` is what the daemon gives the server to run them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from substrate.errors import Internal
from substrate.protocol.caller import Actor, Caller
from substrate.protocol.server import Dispatcher
from substrate.schema import METHODS

__all__ = ["HANDLERS", "Actor", "Caller", "Handler", "Handles", "Registered", "dispatcher"]

S = TypeVar("S")
P = TypeVar("P")
R = TypeVar("R")

#: A handler of a group whose bundle is `S`, for params `P`, answering `R`.
Handler = Callable[[S, Caller, P], Awaitable[R]]


@dataclass(frozen=True)
class Registered:
    """A method's handler and the type of the bundle it is given."""

    services: type
    handler: Handler[Any, Any, Any]


HANDLERS: dict[str, Registered] = {}


class Handles(Generic[S]):
    """The registrar of one group of handlers, each given a bundle of type `S`."""

    def __init__(self, services: type[S]) -> None:
        self.services = services

    def __call__(self, name: str) -> Callable[[Handler[S, P, R]], Handler[S, P, R]]:
        """Register the handler of a method declared in `substrate.schema`."""
        if name not in METHODS:
            raise RuntimeError(f"handler for undeclared method {name}")

        def register(fn: Handler[S, P, R]) -> Handler[S, P, R]:
            if name in HANDLERS:
                raise RuntimeError(f"two handlers for {name}")
            HANDLERS[name] = Registered(self.services, fn)
            return fn

        return register


def dispatcher(*bundles: object) -> Dispatcher:
    """The server's dispatcher: runs a method's registered handler with the one bundle of
    its group's type among `bundles`.

    Raises RuntimeError at once, before anything is served, for two bundles of one type or
    a group with handlers and no bundle. A declared method without a handler is
    `internal` (tests/schema/test_schema.py keeps the table and the handlers in step).
    """
    given = {type(b): b for b in bundles}
    if len(given) != len(bundles):
        raise RuntimeError("two service bundles of one type")
    missing = sorted({r.services.__name__ for r in HANDLERS.values() if r.services not in given})
    if missing:
        raise RuntimeError(f"no service bundle for {', '.join(missing)}")

    async def dispatch(method: str, caller: Caller, params: Any) -> Any:
        found = HANDLERS.get(method)
        if found is None:
            raise Internal(f"{method} has no handler")
        return await found.handler(given[found.services], caller, params)

    return dispatch
