"""The pre-warmed launcher: imports substrate once, then forks one daemon per request.

Run by `tests.harness.prewarmed` as `python -m tests.harness.launcher` (cwd `/`, with
`PYTHONPATH` naming the tree of the `substrate` under test first), one per test session.
A fresh interpreter spends ~2 s importing substrate; a fork of this one starts a daemon
in ~0.1 s. Each child runs `substrate.cli.main.main` exactly as `python -m substrate`
would: same argv, config, sockets and signals, its own cwd, environment and log.

Protocol, one JSON object a line on stdin, one reply a line on stdout:
`{"op": "spawn", "argv", "cwd", "env", "log"}` → `{"pid"}`;
`{"op": "poll", "pid"}` → `{"code"}` (the exit code, or null while it runs).
The launcher exits when its stdin closes; it reaps only the children it is asked about.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import traceback
from typing import Any

import substrate.cli.main

# --- the daemon's API, as the launcher uses it (adapt here when it changes) ----------------

#: Imported before any fork, so that a daemon starts with them loaded.
PREWARM_MODULES = (
    "substrate.daemon",
    "substrate.api",
    "substrate.process.service",
    "substrate.pty.service",
)


def prewarm() -> None:
    """Import what a daemon imports, so that its forks need not."""
    for name in PREWARM_MODULES:
        # The daemon imports it again itself, and fails there as it would anyway.
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def run_daemon(argv: list[str]) -> int:
    """Run `substrate ARGV` in this (forked) process, as `python -m substrate` does."""
    sys.argv = ["substrate", *argv]
    return substrate.cli.main.main(argv)


# --- the launcher --------------------------------------------------------------------------


def _child(request: dict[str, Any]) -> None:
    """In the fork: become the daemon described by `request`, then exit (never returns)."""
    code = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        code = run_daemon(request["argv"])
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _spawn(request: dict[str, Any]) -> int:
    pid = os.fork()
    if pid == 0:
        _child(request)
    return pid


def _poll(pid: int) -> int | None:
    done, status = os.waitpid(pid, os.WNOHANG)
    return os.waitstatus_to_exitcode(status) if done else None


def main() -> None:
    prewarm()
    for raw in sys.stdin.buffer:
        request = json.loads(raw)
        if request["op"] == "spawn":
            reply: dict[str, Any] = {"pid": _spawn(request)}
        else:
            reply = {"code": _poll(request["pid"])}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
