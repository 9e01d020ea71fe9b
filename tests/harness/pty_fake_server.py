"""A terminal server on the in-memory fake PTY, for client tests in another process.

Prints one JSON line `{"port": P, "token": T}` (a 5-use grant), then serves until killed.
`tests/pty/test_pty_attach.py` runs it as `python -m tests.harness.pty_fake_server`.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import trio

from substrate.pty.backend import FakePtys
from substrate.pty.grants import Grants
from substrate.pty.http import TerminalHttp
from substrate.pty.terminals import Terminals
from substrate.store.db import Store
from substrate.store.journal import Journal


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "db")
        journal = Journal(store)
        grants = Grants(store, journal)
        terminals = Terminals(grants=grants, journal=journal, spawner=FakePtys())
        http = TerminalHttp(terminals)
        _, token = grants.issue(workspace="w", profile="interactive", ttl_s=600, uses=5, actor="t")
        async with trio.open_nursery() as nursery:
            await nursery.start(terminals.run)
            port = await nursery.start(http.serve, "127.0.0.1:0")
            sys.stdout.write(json.dumps({"port": port, "token": token}) + "\n")
            sys.stdout.flush()
            await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main)
