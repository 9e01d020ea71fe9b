"""Shared bases of the wire schema and the method table.

Every method is declared once with `method(...)`: its params Struct (the validation), its
result Struct (the shape) and its properties (who may call it, whether it changes state,
whether it completes across a shutdown). The server reads those properties from here and
nowhere else. `docs/api.schema.json` is generated from this table
(`substrate.schema.document`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec


class Params(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of every method's params: unknown fields are invalid_params."""


class Result(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Base of every method's result. Optional fields left at None are omitted."""


#: A workspace handle, as returned by `workspace.adopt`.
WorkspaceId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
#: A workspace-relative POSIX path; validated further by `substrate.fs.paths`.
RelPath = Annotated[str, msgspec.Meta(max_length=8192)]
Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


@dataclass(frozen=True)
class MethodSpec:
    """One wire method and its properties."""

    name: str
    params: type[Params]
    result: type[msgspec.Struct]
    #: Only the operator socket may call it; the agent socket answers `unauthorized`.
    operator_only: bool
    #: It changes workspace state: its refusals are journaled (what was refused, where).
    mutating: bool
    #: Once started it runs to completion, reply included, even while the daemon stops,
    #: so a change that landed is never reported lost.
    shielded: bool
    doc: str
    #: Server notifications the method starts on the caller's connection: method name →
    #: the Struct of their params (`proc.subscribe`: `proc.output`, `proc.exit`).
    notifications: tuple[tuple[str, type[msgspec.Struct]], ...] = ()


METHODS: dict[str, MethodSpec] = {}


def method(
    name: str,
    params: type[Params],
    result: type[msgspec.Struct],
    *,
    operator_only: bool = False,
    mutating: bool = False,
    shielded: bool = False,
    doc: str = "",
    notifications: tuple[tuple[str, type[msgspec.Struct]], ...] = (),
) -> None:
    """Declare a wire method. Declaring a name twice, or a shielded method that is not
    mutating (only a change needs protecting from a shutdown), is a programming error."""
    if name in METHODS:
        raise RuntimeError(f"method {name} declared twice")
    if shielded and not mutating:
        raise RuntimeError(f"method {name} is shielded but not mutating")
    METHODS[name] = MethodSpec(
        name,
        params,
        result,
        operator_only=operator_only,
        mutating=mutating,
        shielded=shielded,
        doc=doc,
        notifications=notifications,
    )


class Empty(Params):
    """Params of methods that take none."""
