"""Command-line commands of the execution and terminal layers: image, exec, doctor,
grant, attach. Kept apart from `substrate.cli.main`, which adds them to its parser.
"""

from __future__ import annotations

import argparse
import base64
import signal
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from substrate.cli.common import client_for, iso_time, workspace_handle
from substrate.protocol.client import Client


def _write_stream(client: Client, ref: dict[str, Any], out: Any) -> None:
    """Copy one output ref to `out`: inline text, or the artifact read in 1 MiB slices."""
    if "inline" in ref:
        data = ref["inline"]
        out.write(
            data.encode() if ref.get("encoding", "utf-8") == "utf-8" else base64.b64decode(data)
        )
        return
    offset = 0
    while True:
        part = client.call("artifact.read", artifact=ref["artifact"], offset=offset, length=1 << 20)
        raw = part["data"]
        chunk = raw.encode() if part["encoding"] == "utf-8" else base64.b64decode(raw)
        out.write(chunk)
        offset += len(chunk)
        if part["eof"] or not chunk:
            return


def cmd_exec(args: argparse.Namespace) -> int:

    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise SystemExit("substrate: exec needs a command after --")
    with client_for(args) as c:
        params: dict[str, Any] = {
            "workspace": workspace_handle(c, args.workspace),
            "profile": args.profile,
            "argv": argv,
            "cwd": args.cwd,
        }
        if args.timeout is not None:
            params["timeout_s"] = args.timeout
        if not sys.stdin.isatty() and args.stdin:
            params["stdin_b64"] = base64.b64encode(sys.stdin.buffer.read()).decode()
        result = c.call("proc.run", **params)
        _write_stream(c, result["stdout"], sys.stdout.buffer)
        sys.stdout.buffer.flush()
        _write_stream(c, result["stderr"], sys.stderr.buffer)
    for blocked in result.get("policy_blocked", []):
        print(f"substrate: policy reverted {blocked}", file=sys.stderr)
    if result.get("timed_out"):
        print("substrate: timed out", file=sys.stderr)
    code = result.get("exit_code")
    if code is None:  # the engine lost the exec: report it as killed
        name = result.get("signal") or "KILL"
        return 128 + int(getattr(signal, f"SIG{name}", signal.SIGKILL))
    return int(code)


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
    p.add_argument("--profile", default="default", help="the profile to run under (default)")
    p.add_argument("--workspace", help=ws_help)
    p.add_argument("--cwd", default=".", help="the working directory, workspace-relative")
    p.add_argument("--timeout", type=float, help="seconds; may only lower the profile's")
    p.add_argument("--stdin", action="store_true", help="forward standard input")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    p.set_defaults(func=cmd_exec)

    p = sub.add_parser("image", help="build sandbox images without a registry")
    isub = p.add_subparsers(dest="image_cmd", required=True)
    b = isub.add_parser("build", help="build the images the shipped profiles use")
    b.add_argument("--tiny", action="store_true", help="only the tiny busybox image")
    b.add_argument("--all", action="store_true", help="the default and the tiny image")
    b.add_argument("--force", action="store_true", help="rebuild even if present and current")
    p.set_defaults(func=cmd_image)
