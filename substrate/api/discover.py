"""Handler of `rpc.discover` (docs/protocol.md §14): the OpenRPC document of every method."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import trio

from substrate.api.base import Caller, handles
from substrate.schema.common import Empty
from substrate.schema.openrpc import encoded

if TYPE_CHECKING:
    from substrate.daemon import Daemon


@handles("rpc.discover")
async def discover(daemon: Daemon, caller: Caller, p: Empty) -> msgspec.Raw:
    """The document as pre-encoded JSON: rendered once per run (in a thread: the first
    render parses the Structs' source), then sent as is."""
    return msgspec.Raw(await trio.to_thread.run_sync(encoded))
