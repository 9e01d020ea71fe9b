"""Handler of `rpc.discover` (docs/protocol.md §14): the OpenRPC document of every method."""

from __future__ import annotations

import msgspec
import trio

from substrate.api.base import Caller, Handles
from substrate.api.services import NoServices
from substrate.schema.common import Empty
from substrate.schema.openrpc import encoded

handles = Handles(NoServices)


@handles("rpc.discover")
async def discover(s: NoServices, caller: Caller, p: Empty) -> msgspec.Raw:
    """The document as pre-encoded JSON: rendered once per run (in a thread: the first
    render parses the Structs' source), then sent as is."""
    return msgspec.Raw(await trio.to_thread.run_sync(encoded))
