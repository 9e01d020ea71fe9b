"""Command-line commands of the execution and terminal layers: image, exec, doctor,
grant, attach. Kept apart from `substrate.cli.main`, which adds them to its parser.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import trio

from substrate.cli.common import client_for, iso_time, workspace_handle
from substrate.protocol.client import (
    AsyncClient,
    ConnectionLost,
    RpcError,
    open_client,
    socket_path,
)
from substrate.protocol.proc_text import blocked_lines

#: Largest piece of our stdin sent per `proc.write` (well under `MAX_WRITE_BYTES`).
STDIN_PIECE = 64 << 10


class OutputTracker:
    """Turns `proc.output` notifications into the bytes to print, once each (pure).

    Pieces arrive in order per stream; one that overlaps what was printed (a replay) is
    cut to the new part; `skipped_from` (the daemon skipped ahead of a slow reader, or
    the client's queue dropped pieces) is reported as a note naming the missing range.
    """

    def __init__(self) -> None:
        self.pos = {"stdout": 0, "stderr": 0}

    def feed(self, params: dict[str, Any]) -> tuple[str, bytes, str | None]:
        """(stream, bytes to print, a note for stderr or None) for one notification."""
        stream = "stderr" if params.get("stream") == "stderr" else "stdout"
        raw = params.get("data")
        data = (
            raw.encode("utf-8", "surrogatepass")
            if isinstance(raw, str)
            else base64.b64decode(params.get("data_b64") or "")
        )
        offset = int(params.get("offset", 0))
        note = None
        skipped = params.get("skipped_from")
        if skipped is not None and offset > self.pos[stream]:
            note = (
                f"substrate: {stream} bytes {self.pos[stream]}..{offset} were not shown"
                " (the whole stream is in the result's artifact)"
            )
        elif offset > self.pos[stream]:
            note = f"substrate: {stream} bytes {self.pos[stream]}..{offset} are missing"
        cut = max(0, self.pos[stream] - offset)
        data = data[cut:]
        self.pos[stream] = max(self.pos[stream], offset + cut + len(data))
        return stream, data, note


def exit_code_of(result: dict[str, Any]) -> int:
    """The command's exit code; 128 + n for a death by signal n when the engine lost
    the code (or the command was lost: reported as killed)."""
    code = result.get("exit_code")
    if code is None:
        name = result.get("signal") or "KILL"
        return 128 + int(getattr(signal, f"SIG{name}", signal.SIGKILL))
    return int(code)


def _emit(out: Any, data: bytes) -> None:
    out.write(data)
    out.flush()


async def _show_output(client: AsyncClient, proc: str) -> dict[str, Any]:
    """Print the command's output as it comes; return the `proc.exit` params."""
    tracker = OutputTracker()
    outs = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}
    async for message in client.notifications:
        params = message.get("params") or {}
        if params.get("proc") != proc:
            continue
        if message.get("method") == "proc.exit":
            return dict(params)
        stream, data, note = tracker.feed(params)
        if note is not None:
            await trio.to_thread.run_sync(_emit, sys.stderr.buffer, (note + "\n").encode())
        if data:
            # A pipe that is full blocks only a worker thread, never Ctrl-C handling.
            await trio.to_thread.run_sync(_emit, outs[stream], data)
    raise ConnectionLost("the daemon closed the connection before the command ended")


#: Signals to the CLI that reach the command: Ctrl-C as INT (a second one: KILL); the
#: CLI asked to end (TERM) or its terminal gone (HUP) as TERM.
FORWARDED = {signal.SIGINT: "INT", signal.SIGTERM: "TERM", signal.SIGHUP: "TERM"}
#: How long the CLI, failing, waits for its KILL of the command to be sent, seconds.
KILL_ON_FAILURE_S = 5.0


async def _forward_signals(client: AsyncClient, proc: str, received: AsyncIterator[int]) -> None:
    """Ctrl-C → `proc.signal INT`, and a second one → `KILL`; TERM and HUP → `TERM`."""
    interrupts = 0
    async for signum in received:
        name = FORWARDED.get(signal.Signals(signum), "TERM")
        if name == "INT":
            interrupts += 1
            name = "INT" if interrupts == 1 else "KILL"
        with contextlib.suppress(RpcError):
            await client.call("proc.signal", proc=proc, signal=name)
        if name == "INT":
            note = f"substrate: sent INT to {proc}; Ctrl-C again sends KILL\n"
            await trio.to_thread.run_sync(_emit, sys.stderr.buffer, note.encode())


async def _forward_stdin(client: AsyncClient, proc: str) -> None:
    """Our stdin → `proc.write`, as it comes; EOF closes the command's. Stops quietly when
    the command's stdin is closed (it ended, or closed it)."""
    fd = sys.stdin.fileno()
    try:
        while True:
            piece = await trio.to_thread.run_sync(os.read, fd, STDIN_PIECE, abandon_on_cancel=True)
            params: dict[str, Any] = {"proc": proc, "eof": not piece}
            if piece:
                params["data_b64"] = base64.b64encode(piece).decode("ascii")
            await client.call("proc.write", **params)
            if not piece:
                return
    except RpcError as exc:
        if exc.refusal != "stdin_closed":
            raise


async def run_live(path: Path, params: dict[str, Any], forward_stdin: bool) -> dict[str, Any]:
    """`proc.start` + `proc.subscribe` on one connection: print output live, forward
    signals (`FORWARDED`) and, with `forward_stdin`, our stdin; return the `proc.exit`
    params once it ended. A refused start raises `RpcError` (nothing ran). Failing
    after the start (the subscription refused, the connection lost), the CLI kills the
    command on its way out, as a cut-off `proc.run` would be: never left running."""
    with trio.open_signal_receiver(*FORWARDED) as received:
        async with open_client(path) as client:
            if forward_stdin:
                params = {**params, "stdin": "stream"}
            proc = str((await client.call("proc.start", **params))["proc"])
            try:
                await client.call("proc.subscribe", proc=proc)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_forward_signals, client, proc, received)
                    if forward_stdin:
                        nursery.start_soon(_forward_stdin, client, proc)
                    result = await _show_output(client, proc)
                    nursery.cancel_scope.cancel()
                return result
            except BaseException:
                with (
                    trio.move_on_after(KILL_ON_FAILURE_S, shield=True),
                    contextlib.suppress(RpcError, ConnectionLost, OSError),
                ):
                    await client.call("proc.signal", proc=proc, signal="KILL")
                raise


def cmd_exec(args: argparse.Namespace) -> int:
    """`substrate exec`: start the command, print its output as it comes, forward Ctrl-C
    (INT, then KILL) and `--stdin`; exit with the command's code."""
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise SystemExit("substrate: exec needs a command after --")
    with client_for(args) as c:
        params: dict[str, Any] = {
            "workspace": workspace_handle(c, args.workspace),
            "argv": argv,
            "cwd": args.cwd,
        }
    if args.profile is not None:
        params["profile"] = args.profile
    if args.timeout is not None:
        params["timeout_s"] = args.timeout
    try:
        result = trio.run(run_live, socket_path(args.state_dir), params, bool(args.stdin))
    except BaseExceptionGroup as group:  # one failure inside the nursery: raise it as is
        raise _sole(group) from None
    if "exit_code" not in result:  # {proc, state: "lost"}: its daemon stopped
        print(f"substrate: {result.get('proc')} was lost", file=sys.stderr)
    for blocked in result.get("policy_blocked", []):
        print(f"substrate: policy reverted {blocked}", file=sys.stderr)
    # What of the working layer's changes did not land, after the output (bounded).
    for line in blocked_lines(result.get("changes")):
        print(f"substrate: {line}", file=sys.stderr)
    if result.get("timed_out"):
        print("substrate: timed out", file=sys.stderr)
    return exit_code_of(result)


def _sole(group: BaseExceptionGroup[BaseException]) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def cmd_image(args: argparse.Namespace) -> int:
    from substrate.sandbox.images import build as imagebuild

    started = time.monotonic()
    which = "all" if args.all else ("tiny" if args.tiny else "default")
    imagebuild.build_images(which, args.force, lambda line: print(line, flush=True))
    print(f"images ready in {time.monotonic() - started:.1f}s")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """The checks of `substrate.cli.doctor`, on the running daemon's own configuration
    when one answers on its operator socket, else on `--config` or the defaults."""
    from substrate.cli import doctor
    from substrate.config import Config, ConfigError, load_config

    running, said = doctor.ask_daemon(args.state_dir)
    if running is not None:
        config = msgspec.convert(running.info["config"], Config)
        print(f"daemon: running ({said}); checking the configuration it runs with")
    else:
        try:
            config = load_config(
                Path(args.config) if args.config else None, {"state_dir": args.state_dir}
            )
        except ConfigError as exc:
            raise SystemExit(f"substrate: {exc}") from None
        print(f"daemon: {said}; checking {args.config or 'the default configuration'}")
    checks = doctor.run_checks(config, running)
    print(doctor.render(checks))
    return 0 if all(ok for _, ok, _ in checks) else 1


def cmd_grant(args: argparse.Namespace) -> int:
    from substrate.pty.attach import NoTerminalUrl, terminal_listen
    from substrate.pty.grants import parse_duration

    with client_for(args, operator=True) as c:
        # Where the daemon really listens (never a default port), asked before issuing.
        try:
            listen = args.listen or terminal_listen(c)
        except NoTerminalUrl as exc:
            raise SystemExit(f"substrate: {exc}") from None
        result = c.call(
            "grant.issue",
            kind="interactive_terminal",
            workspace=workspace_handle(c, args.workspace),
            profile=args.profile,
            ttl_s=parse_duration(args.ttl),
            uses=args.uses,
        )
    # The token is shown once, here; the daemon keeps only its SHA-256.
    print(f"grant   {result['grant']}")
    print(f"token   {result['token']}")
    print(f"expires {iso_time(result['expires'])}")
    print(f"page    http://{listen}/#token={result['token']}")
    print(f"attach  SUBSTRATE_TOKEN={result['token']} substrate attach --url ws://{listen}/pty")
    return 0


def cmd_attach(args: argparse.Namespace) -> int:
    from substrate.pty import attach

    argv = ["--url", args.url] if args.url else []
    if args.state_dir:
        argv += ["--state-dir", args.state_dir]
    if args.token:
        argv += ["--token", args.token]
    if args.session:
        argv += ["--session", args.session]
    if args.observe:
        argv.append("--observe")
    return attach.main(argv)


def add_commands(sub: Any) -> None:
    ws_help = "workspace handle, root id or path (default: the current directory)"
    p = sub.add_parser("grant", help="operator: issue a terminal grant")
    gsub = p.add_subparsers(dest="grant_cmd", required=True)
    g = gsub.add_parser("terminal", help="a short-lived grant for an interactive terminal")
    g.add_argument("--workspace", help=ws_help)
    g.add_argument(
        "--profile", default="interactive", help="an interactive profile (default interactive)"
    )
    g.add_argument("--ttl", default="10m", help="how long it is valid, e.g. 90s, 10m, 1h")
    g.add_argument("--uses", type=int, default=1, help="how many opens it allows (default 1)")
    g.add_argument("--listen", help="the daemon's terminal HOST:PORT (default: asked of it)")
    p.set_defaults(func=cmd_grant)

    p = sub.add_parser("attach", help="open a terminal with a grant token")
    p.add_argument("--token", help="the grant token (or $SUBSTRATE_TOKEN; --token shows in ps)")
    p.add_argument("--url", help="the terminal URL (default: asked of the daemon)")
    p.add_argument("--session", help="join an existing session")
    p.add_argument("--observe", action="store_true", help="watch without typing")
    p.set_defaults(func=cmd_attach)

    p = sub.add_parser(
        "doctor", help="what works on this machine: engine, cgroups, seccomp, gVisor"
    )
    p.add_argument(
        "--config", help="a substrate.toml to check when no daemon answers (default: defaults)"
    )
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("exec", help="run a command in the workspace's confined container")
    p.add_argument(
        "--profile", help="the profile to run under (default: the daemon's default_profile)"
    )
    p.add_argument("--workspace", help=ws_help)
    p.add_argument("--cwd", default=".", help="the working directory, workspace-relative")
    p.add_argument("--timeout", type=float, help="seconds; may only lower the profile's")
    p.add_argument(
        "--stdin", action="store_true", help="forward standard input as it comes (until EOF)"
    )
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    p.set_defaults(func=cmd_exec)

    p = sub.add_parser("image", help="build sandbox images without a registry")
    isub = p.add_subparsers(dest="image_cmd", required=True)
    b = isub.add_parser("build", help="build the images the shipped profiles use")
    b.add_argument("--tiny", action="store_true", help="only the tiny busybox image")
    b.add_argument("--all", action="store_true", help="the default and the tiny image")
    b.add_argument("--force", action="store_true", help="rebuild even if present and current")
    p.set_defaults(func=cmd_image)
