"""Wire schema of `rpc.discover` (docs/protocol.md §14): the OpenRPC document of every
method, as `substrate.schema.openrpc` generates it from the method table."""

from __future__ import annotations

from typing import Any

import msgspec

from substrate.schema.common import Empty, Result, method


class OpenRpcInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    title: str
    version: str  # the daemon's version
    description: str = ""


class DiscoverResult(Result):
    """An OpenRPC 1.3 document (https://spec.open-rpc.org). Each method object carries
    `x-substrate-sockets` (`["agent", "operator"]`, or `["operator"]` for operator-only
    methods), `x-substrate-mutating` and `x-substrate-section` (its § of
    docs/protocol.md); every refusal is an error object under `components.errors`."""

    openrpc: str  # the OpenRPC version the document follows
    info: OpenRpcInfo
    #: OpenRPC method objects, by name; params by name, with each field's doc.
    methods: list[dict[str, Any]]
    #: `schemas` (the Structs, field docs as `description`) and `errors` (the refusals).
    components: dict[str, Any]


method(
    "rpc.discover",
    Empty,
    DiscoverResult,
    doc="The OpenRPC document of every method of both sockets (generated once per run).",
)
