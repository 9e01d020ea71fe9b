"""Shared bases of the wire schema and the method table.

Every method is declared once with `method(...)`: its params Struct (the validation), its
result Struct (the shape) and whether only operators may call it. `docs/api.schema.json`
is generated from this table (`substrate.schema.json_schema`).
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
#: A workspace-relative POSIX path; validated further by `substrate.workspace.paths`.
RelPath = Annotated[str, msgspec.Meta(max_length=8192)]
Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


@dataclass(frozen=True)
class MethodSpec:
    name: str
    params: type[Params]
    result: type[msgspec.Struct]
    operator_only: bool
    doc: str


METHODS: dict[str, MethodSpec] = {}


def method(
    name: str,
    params: type[Params],
    result: type[msgspec.Struct],
    *,
    operator_only: bool = False,
    doc: str = "",
) -> None:
    """Declare a wire method. Declaring a name twice is a programming error."""
    if name in METHODS:
        raise RuntimeError(f"method {name} declared twice")
    METHODS[name] = MethodSpec(name, params, result, operator_only, doc)


class Empty(Params):
    """Params of methods that take none."""
