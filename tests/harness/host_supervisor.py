"""substrate's sandbox supervisor run on this host, for tests of fast exec without Docker.

`host_link()` starts `substrate/sandbox/supervisor/agent.py` as a subprocess serving a
socketpair (no container, no secret: the start-up is the engine path's business) and
returns the daemon's `Link` to it. The "sandbox" is this test process: the baseline is
its own status, cgroups and namespaces, which every child of the subprocess shares.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from substrate.sandbox.facts import make_fact
from substrate.sandbox.supervisor import agent, checks
from substrate.sandbox.supervisor.link import Link


def own_baseline() -> checks.Baseline:
    """This process as the "sandbox"."""
    values = checks.status_values(checks.read_process(os.getpid()).status)
    found = [make_fact(n, v, source="kernel:proc-status") for n, v in values.items()]
    return checks.baseline(os.getpid(), found)


@asynccontextmanager
async def host_link(generation: int = 1) -> AsyncIterator[Link]:
    """A `Link` to a supervisor subprocess on this host; killed and reaped on exit."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    code = (
        "import ctypes, os, socket, sys; sys.path.insert(0, sys.argv[1]); import agent; "
        "ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); "  # non-dumpable, as in a sandbox
        "agent.serve(socket.socket(fileno=int(sys.argv[2])), dict(os.environ))"
    )
    program_dir = str(Path(agent.__file__).parent)
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-I", "-c", code, program_dir, str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    link = Link(
        container="host",
        generation=generation,
        pid=proc.pid,
        pidfd=os.pidfd_open(proc.pid),
        control=trio.socket.from_stdlib_socket(ours),
        base=own_baseline(),
        uid=os.getuid(),
        started=0.0,
    )
    try:
        yield link
    finally:
        link.kill()
        link.close()
        with trio.fail_after(10):
            await proc.wait()
