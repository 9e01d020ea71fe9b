"""`substrate` command line (docs/protocol.md §9): the daemon, and a client for people at a shell.

Client commands find the daemon through `--state-dir` or `$SUBSTRATE_STATE_DIR`. A
refusal prints `substrate: <refusal>: <message>` on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

from substrate.cli import agent as cli_agent
from substrate.cli import exec as cli_exec
from substrate.cli import journal_pg as cli_journal_pg
from substrate.cli import node as cli_node
from substrate.cli import secret as cli_secret
from substrate.cli.common import (
    STATE_DIR_HELP,
    StateDirParser,
    client_for,
    human_times,
    workspace_handle,
)
from substrate.protocol.client import RpcError


def _print_json(value: Any) -> None:
    """A result as indented JSON, its unix times in ISO 8601 (`human_times`)."""
    print(json.dumps(human_times(value), indent=2, sort_keys=True))


# -- serve ----------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    import trio

    from substrate.config import Config, ConfigError, load_config
    from substrate.daemon import configure_logging, open_daemon
    from substrate.errors import StartupError

    overrides: dict[str, Any] = {
        "state_dir": args.state_dir or os.environ.get("SUBSTRATE_STATE_DIR"),
        "adopt_roots": [os.path.abspath(p) for p in args.adopt_root],
        "profiles_dir": args.profiles,
        "seccomp_dir": args.seccomp,
        "listen": args.listen,
        "log_level": args.log_level,
    }

    async def serve(config: Config) -> None:
        async with open_daemon(config) as daemon:
            await daemon.serve()

    try:
        config = load_config(Path(args.config) if args.config else None, overrides)
        configure_logging(config.log_level)
        trio.run(serve, config)
    except (ConfigError, StartupError) as exc:
        print(f"substrate: {exc}", file=sys.stderr)
        return 2
    return 0


# -- workspace and files ----------------------------------------------------------------------


def cmd_adopt(args: argparse.Namespace) -> int:
    with client_for(args) as c:
        params: dict[str, Any] = {"path": os.path.abspath(args.path)}
        if args.root_id:
            params["root_id"] = args.root_id
        _print_json(c.call("workspace.adopt", **params))
    return 0


def cmd_read(args: argparse.Namespace) -> int:
    with client_for(args) as c:
        ws = workspace_handle(c, args.workspace)
        result = c.call(
            "fs.read", workspace=ws, path=args.path, offset=args.offset, length=args.length
        )
    data = result.pop("data")
    if args.json:
        result["data"] = data
        _print_json(result)
        return 0
    raw = data.encode() if result["encoding"] == "utf-8" else base64.b64decode(data)
    sys.stdout.buffer.write(raw)
    print(f"sha256 {result['sha256']}  size {result['size']}", file=sys.stderr)
    return 0


#: Bigger content goes by a chunked upload (`fs.upload.*`) instead of one `fs.write` line.
WRITE_INLINE_BYTES = 512 << 10


def cmd_write(args: argparse.Namespace) -> int:
    content = Path(args.source).read_bytes() if args.source else sys.stdin.buffer.read()
    base = None if args.create else args.base
    with client_for(args) as c:
        ws = workspace_handle(c, args.workspace)
        if len(content) > WRITE_INLINE_BYTES:
            plan = c.upload_file(
                ws,
                args.path,
                io.BytesIO(content),
                base_sha256=base,
                create_parents=args.parents,
                dry_run=args.dry_run,
            )
        else:
            plan = c.call(
                "fs.write",
                workspace=ws,
                path=args.path,
                content_b64=base64.b64encode(content).decode(),
                base_sha256=base,
                create_parents=args.parents,
                dry_run=args.dry_run,
            )
    _print_json(plan)
    return 0


def cmd_patch(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"path": args.path, "base_sha256": args.base, "dry_run": args.dry_run}
    if args.diff:
        params["unified_diff"] = Path(args.diff).read_text()
    else:
        if not args.edit:
            raise SystemExit("substrate: give --edit OLD NEW (repeatable) or --diff FILE")
        count: int | str = "all" if args.all else 1
        params["edits"] = [{"old": old, "new": new, "count": count} for old, new in args.edit]
    with client_for(args) as c:
        params["workspace"] = workspace_handle(c, args.workspace)
        _print_json(c.call("fs.patch", **params))
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    with client_for(args) as c:
        ws = workspace_handle(c, args.workspace)
        params: dict[str, Any] = {
            "workspace": ws,
            "pattern": args.pattern,
            "path": args.path,
            "fixed": args.fixed,
            "ignore_case": args.ignore_case,
            "max_matches": args.max_matches,
        }
        if args.glob:
            params["glob"] = args.glob
        if args.exclude:
            params["exclude"] = args.exclude
        if args.gitignore:
            params["gitignore"] = True
        result = c.call("fs.search", **params)
    for match in result["matches"]:
        print(f"{match['path']}:{match['line']}:{match['column']}:{match['text']}")
    if result["truncated"]:
        print("(truncated)", file=sys.stderr)
    return 0 if result["matches"] else 1


# -- journal -------------------------------------------------------------------------------


def cmd_journal(args: argparse.Namespace) -> int:
    if args.journal_cmd == "verify" and args.postgres:
        return cli_journal_pg.cmd_verify_postgres(args)  # PostgreSQL alone, no daemon
    if args.journal_cmd == "export":
        return cli_journal_pg.cmd_export(args)  # the state dir's files, no daemon
    with client_for(args) as c:
        if args.journal_cmd == "read":
            params: dict[str, Any] = {"since": args.since, "limit": args.limit}
            if args.workspace:
                params["workspace"] = workspace_handle(c, args.workspace)
            for entry in c.call("journal.read", **params)["entries"]:
                print(json.dumps(human_times(entry), sort_keys=True))
            return 0
        if args.journal_cmd == "verify":
            result = c.call("journal.verify")
            _print_json(result)
            return 0 if result["ok"] else 1
        result = c.call("journal.replay", workspace=workspace_handle(c, args.workspace))
    for f in result["files"]:
        print(f"{f['status']:<10} {f['path']}")
    print(f"{result['drifted']} of {len(result['files'])} files differ from what substrate wrote")
    return 0 if result["drifted"] == 0 else 1


def cmd_approve(args: argparse.Namespace) -> int:
    with client_for(args, operator=True) as c:
        ws = workspace_handle(c, args.workspace)
        _print_json(c.call("approval.grant", workspace=ws, plan_digest=args.digest, ttl_s=args.ttl))
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    """`substrate policy set`: the operator's policy of one checkout (replaces the last)."""
    policy = {
        "write_allow": args.write_allow,
        "write_deny": args.write_deny,
        "read_deny": args.read_deny,
        "require_approval": args.require_approval,
    }
    with client_for(args, operator=True) as c:
        ws = workspace_handle(c, args.workspace)
        _print_json(c.call("workspace.set_policy", workspace=ws, policy=policy))
    return 0


def cmd_mcp(args: argparse.Namespace) -> int:
    """`substrate mcp`: an MCP server over stdio for one client (docs/mcp.md)."""
    from substrate.mcp import Options, run
    from substrate.protocol.client import socket_path

    if args.max_result_bytes < 4096:
        raise SystemExit("substrate: --max-result-bytes must be at least 4096")
    workspace = args.workspace
    if workspace is not None and workspace.startswith("."):
        workspace = os.path.abspath(workspace)  # a relative path, as for other commands
    options = Options(
        socket=socket_path(args.state_dir),
        workspace=workspace,
        result_bytes=args.max_result_bytes,
    )
    return run(options)


# -- parser ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The whole command line. `--state-dir` is accepted before the command and after
    it (after any subcommand); every option says what it does in `--help`."""
    parser = argparse.ArgumentParser(prog="substrate", description=__doc__)
    parser.add_argument("--state-dir", help=STATE_DIR_HELP)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=StateDirParser)

    p = sub.add_parser("serve", help="run the daemon")
    p.add_argument("--config", help="a substrate.toml to read (its keys: docs/configuration.md)")
    p.add_argument(
        "--adopt-root",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory workspaces may be adopted under (repeatable; adds to the config's)",
    )
    p.add_argument("--profiles", metavar="DIR", help="the profiles directory (*.toml)")
    p.add_argument("--seccomp", metavar="DIR", help="the seccomp policies directory (*.json)")
    p.add_argument("--listen", metavar="HOST:PORT", help="where terminals are served (loopback)")
    p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="the daemon's log on stderr (default: the config's log_level, else info); "
        "debug adds a line per refusal",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("adopt", help="adopt a checkout as a workspace")
    p.add_argument("path", help="the checkout's directory (under an adopt root)")
    p.add_argument("--root-id", help="the public name of the checkout (default: from its name)")
    p.set_defaults(func=cmd_adopt)

    ws_help = "workspace handle, root id or path (default: the current directory)"
    p = sub.add_parser("read", help="read a file")
    p.add_argument("path", help="the file, relative to the workspace")
    p.add_argument("--workspace", help=ws_help)
    p.add_argument("--offset", type=int, default=0, help="the first byte to read (default 0)")
    p.add_argument(
        "--length", type=int, default=4 << 20, help="bytes to read, at most 4 MiB (the default)"
    )
    p.add_argument("--json", action="store_true", help="print the whole fs.read result as JSON")
    p.set_defaults(func=cmd_read)

    p = sub.add_parser("write", help="guarded write of stdin or --from FILE")
    p.add_argument("path", help="the file, relative to the workspace")
    p.add_argument("--workspace", help=ws_help)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--base", help="sha256 the file must have now")
    group.add_argument("--create", action="store_true", help="the file must not exist")
    p.add_argument("--from", dest="source", metavar="FILE", help="the new content (default stdin)")
    p.add_argument("--parents", action="store_true", help="create missing parent directories")
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    p.set_defaults(func=cmd_write)

    p = sub.add_parser("patch", help="guarded edits or unified diff")
    p.add_argument("path", help="the file, relative to the workspace")
    p.add_argument("--workspace", help=ws_help)
    p.add_argument("--base", required=True, help="sha256 the file must have now")
    p.add_argument(
        "--edit",
        nargs=2,
        action="append",
        metavar=("OLD", "NEW"),
        help="replace OLD (which must occur exactly once, or see --all) by NEW; repeatable",
    )
    p.add_argument(
        "--all", action="store_true", help='replace every occurrence of each OLD (count "all")'
    )
    p.add_argument(
        "--diff", metavar="FILE", help="a unified diff of this one file, applied strictly"
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    p.set_defaults(func=cmd_patch)

    p = sub.add_parser("search", help="search the workspace")
    p.add_argument("pattern", help="a Python regular expression (or a string with --fixed)")
    p.add_argument("--workspace", help=ws_help)
    p.add_argument("--path", default=".", help="the directory to search (default: all)")
    p.add_argument("--glob", help="only paths matching this glob (policy dialect)")
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="leave out paths matching GLOB, directories whole (repeatable)",
    )
    p.add_argument(
        "--gitignore", action="store_true", help="leave out what .gitignore files ignore"
    )
    p.add_argument("--fixed", action="store_true", help="the pattern is a literal string")
    p.add_argument("-i", "--ignore-case", action="store_true", help="match case-insensitively")
    p.add_argument(
        "--max-matches", type=int, default=200, help="stop after this many matches (default 200)"
    )
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("approve", help="operator: approve one apply of a plan digest")
    p.add_argument("digest", help="the plan_digest of the plan to approve")
    p.add_argument("--workspace", help=ws_help)
    p.add_argument(
        "--ttl", type=float, default=600.0, help="seconds the approval stays valid (default 600)"
    )
    p.set_defaults(func=cmd_approve)

    p = sub.add_parser("policy", help="operator: set the policy of a checkout")
    psub = p.add_subparsers(dest="policy_cmd", required=True, parser_class=StateDirParser)
    ps = psub.add_parser("set", help="replace the checkout's policy (the default still applies)")
    ps.add_argument("--workspace", help=ws_help)
    for flag, what in (
        ("--write-allow", "only paths matching these may be written"),
        ("--write-deny", "paths matching GLOB are never written"),
        ("--read-deny", "paths matching GLOB are never read"),
        ("--require-approval", "writes to paths matching GLOB need an operator approval"),
    ):
        ps.add_argument(
            flag, action="append", default=[], metavar="GLOB", help=what + " (repeatable)"
        )
    p.set_defaults(func=cmd_policy)

    p = sub.add_parser("journal", help="read, verify or replay the journal")
    jsub = p.add_subparsers(dest="journal_cmd", required=True, parser_class=StateDirParser)
    jr = jsub.add_parser("read", help="print entries, one JSON object a line (times ISO 8601)")
    jr.add_argument("--since", type=int, default=0, help="entries after this seq (default 0)")
    jr.add_argument(
        "--limit", type=int, default=1000, help="at most this many entries (default 1000)"
    )
    jr.add_argument("--workspace", help="only this workspace's entries (handle, root id or path)")
    jv = jsub.add_parser("verify", help="check the hash chain; exit 1 if broken")
    cli_journal_pg.add_postgres_options(jv)
    cli_journal_pg.add_export_command(jsub)
    jp = jsub.add_parser("replay", help="which files substrate wrote still hold its bytes")
    jp.add_argument("--workspace", required=True, help=ws_help)
    p.set_defaults(func=cmd_journal)

    # `--state-dir` after `mcp` too (every subcommand takes it): MCP client configs list
    # the arguments of one command.
    p = sub.add_parser("mcp", help="serve the agent methods as MCP tools over stdio")
    p.add_argument(
        "--workspace",
        help="default workspace of every tool: a handle, root id, or path to adopt",
    )
    p.add_argument(
        "--max-result-bytes",
        type=int,
        default=64 << 10,
        help="largest tool result, bytes of JSON; more is cut and says so (default 65536)",
    )
    p.set_defaults(func=cmd_mcp)

    cli_exec.add_commands(sub)
    cli_secret.add_commands(sub)
    cli_agent.add_commands(sub)
    cli_node.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except RpcError as exc:
        print(f"substrate: {exc.refusal or exc.code}: {exc.message}", file=sys.stderr)
        return 2
