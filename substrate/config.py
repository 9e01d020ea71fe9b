"""Daemon configuration: `substrate.toml` keys, overridden by command-line flags (docs/protocol.md §9).

Every key has a default that works on a fresh machine: the state dir from
`$SUBSTRATE_STATE_DIR`, else `$XDG_STATE_HOME/substrate`, else `~/.local/state/substrate`
(never inside a checkout), the profiles and seccomp policies shipped with this checkout.
"""

from __future__ import annotations

import grp
import os
import socket
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec
import psycopg
from psycopg import conninfo

from substrate.errors import Refusal
from substrate.metrics import parse_metrics_listen
from substrate.protocol.client import default_state_dir
from substrate.schema.workspace import Policy
from substrate.workspace.policy import compile_policy

#: Where the shipped profiles and seccomp policies live (a checkout or an sdist).
PROJECT_ROOT = Path(__file__).resolve().parent.parent


#: The most warm sandboxes one profile may keep (`warm_sandboxes`): a pool sized for the
#: burst it serves (docs/execution.md "The warm pool"), each member an idle container
#: (8 to 11 MiB of host memory here, docs/performance.md "Warm pool").
WARM_SANDBOXES_MAX = 128

#: A key whose name holds one of these is never reported (none does today).
SECRET_WORDS = ("secret", "token", "password")


class ConfigError(Exception):
    """The configuration file or a flag is wrong; the message names the key."""


class JournalExport(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """`[journal_export]`: ship the journal to PostgreSQL (docs/fleet.md)."""

    #: a libpq DSN or URI of the database (`host=db dbname=fleet user=substrate`), never
    #: holding a password (refused: use `password_secret`); "": no export
    postgres_dsn: str = ""
    node: str = ""  # this node's name in substrate_journal; "": the host name
    #: an operator secret (`substrate secret set NAME`) holding the password, read at
    #: each connect; "": libpq's own ways (PGPASSFILE, ~/.pgpass of the daemon's user)
    password_secret: str = ""
    batch_entries: int = 1000  # entries per batch (one transaction), 1..10000
    poll_s: float = 0.5  # caught up: how often the journal's head is looked at, seconds
    max_backoff_s: float = 30.0  # the longest wait between failed attempts, seconds
    timeout_s: float = 10.0  # connect and statement timeout, seconds

    def node_name(self) -> str:
        return self.node or socket.gethostname()


class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    state_dir: str = msgspec.field(default_factory=lambda: str(default_state_dir()))  # made 0700
    adopt_roots: list[str] = msgspec.field(default_factory=list)  # dirs workspaces may be under
    profiles_dir: str = str(PROJECT_ROOT / "profiles")  # operator profiles, *.toml
    seccomp_dir: str = str(PROJECT_ROOT / "seccomp")  # seccomp policies, *.json
    listen: str = "127.0.0.1:7681"  # HTTP/WebSocket terminals, loopback only
    allowed_origins: list[str] = msgspec.field(default_factory=list)  # empty: the daemon's own
    allowed_uids: list[int] = msgspec.field(default_factory=list)  # empty: ours and root
    #: a group (name or number) that may reach the agent socket: the state dir becomes
    #: 0710 with that group (enter, not list) and the agent socket 0660 with it; the
    #: operator socket and everything else stay the daemon's alone. "": 0700, root only
    agent_socket_group: str = ""
    max_request_bytes: int = 1 << 20  # one JSON-RPC line, bytes
    inline_output_bytes: int = 64 << 10  # larger output streams become artifacts
    artifact_quota_bytes: int = 10 << 30  # total artifact bytes kept
    artifact_max_age_s: float = 7 * 24 * 3600.0  # artifacts older than this are collected
    #: bytes one persistent home may hold; while over, its commands are refused
    #: limit_exceeded (checked before each, docs/environments.md); 0: no bound
    home_quota_bytes: int = 10 << 30
    max_connections: int = 2048  # per socket; more are refused with limit_exceeded
    max_connections_per_uid: int = 1024  # per peer uid and socket; more: limit_exceeded
    max_in_flight: int = 64  # concurrent requests per connection
    #: replies and notifications made but not yet sent, per connection, bytes; past it
    #: the connection is not read and its next reply waits until the client reads
    max_unsent_bytes: int = 4 << 20
    #: the same, summed over the connections of one peer uid per socket, bytes
    max_unsent_bytes_per_uid: int = 32 << 20
    line_timeout_s: float = 10.0  # a started request line must end within this
    idle_timeout_s: float = 600.0  # a connection with nothing in flight closes after this
    max_processes: int = 64  # running processes per daemon
    #: the profile of a proc.run/proc.start that names none (shipped: `default`)
    default_profile: str = "default"
    container_idle_s: float = 600.0  # an unused sandbox container is removed after this
    #: commands start through each sandbox's own supervisor (docs/fast-exec.md); false:
    #: every command is an engine exec (no supervisor, no supervisor directory bound)
    fast_exec: bool = True
    #: profile name → warm sandboxes kept ready with no workspace bound (0..128 each;
    #: docs/execution.md "The warm pool"); empty: every first command creates its sandbox
    warm_sandboxes: dict[str, int] = msgspec.field(default_factory=dict)
    inline_hash_bytes: int = 64 << 20  # fs.stat/fs.read hash files up to this; more: hash=true
    #: checkpoint pre-images kept, bytes; past it the oldest checkpoint expires (§11)
    preimage_quota_bytes: int = 1 << 30
    #: change sets a workspace keeps for review or approval; past it "apply"/"review" runs are refused (§11)
    max_kept_changesets: int = 64
    #: a change set's largest file, bytes (applied streamed); larger: blocked too_large
    max_change_file_bytes: int = 8 << 30
    #: the bytes one change set's scan hashes in all (the command's files and the
    #: checkout files they replace or delete); past it: blocked too_large
    max_changeset_bytes: int = 32 << 30
    max_upload_bytes: int = 1 << 30  # one chunked upload's declared size (§14); more: too_large
    max_uploads: int = 8  # open uploads per caller (socket and uid); more: limit_exceeded
    upload_idle_s: float = 600.0  # an upload with no call for this long expires, spool removed
    #: the egress proxy refuses private and other non-global addresses (RFC 1918, CGNAT,
    #: ULA) as well as this host's own, which it always refuses (docs/egress.md)
    egress_refuse_private: bool = False
    #: the daemon's log on stderr: "debug" adds one line per refusal (method and name only)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    #: where Prometheus scrapes `/metrics` (docs/fleet.md), HOST:PORT; "": not served.
    #: Loopback only unless `metrics_allow_remote`
    metrics_listen: str = ""
    metrics_allow_remote: bool = False  # let `metrics_listen` be a non-loopback address
    # `[journal_export]`: the journal shipped to PostgreSQL (docs/fleet.md).
    journal_export: JournalExport = msgspec.field(default_factory=JournalExport)
    # `[policy]`: the operator's default policy of every checkout (docs/protocol.md §2); agents add to it.
    policy: Policy = msgspec.field(default_factory=Policy)

    def state_path(self) -> Path:
        return Path(self.state_dir).absolute()

    def agent_gid(self) -> int | None:
        """The gid of `agent_socket_group`, or None when unset. Raises `ConfigError` for a
        group this host does not have."""
        name = self.agent_socket_group
        if not name:
            return None
        try:
            return grp.getgrgid(int(name)).gr_gid if name.isdigit() else grp.getgrnam(name).gr_gid
        except (KeyError, OverflowError):
            raise ConfigError(f"agent_socket_group: no group {name!r} on this host") from None

    def public(self) -> dict[str, Any]:
        """Every key and its effective value, but any named like a secret (`daemon.info`)."""
        values: dict[str, Any] = msgspec.to_builtins(self)
        return {k: v for k, v in values.items() if not any(w in k for w in SECRET_WORDS)}

    def effective_uids(self) -> frozenset[int]:
        return frozenset(self.allowed_uids) if self.allowed_uids else frozenset({os.getuid(), 0})


def load_config(path: Path | None, overrides: dict[str, Any]) -> Config:
    """Read `path` (if given), then apply non-None `overrides`; refuse unknown keys by name."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc
    for key, value in overrides.items():
        if value is None or value == []:
            continue
        raw[key] = value
    try:
        config = msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path or 'flags'}: {exc}") from exc
    if config.max_request_bytes < 1024:
        raise ConfigError("max_request_bytes: must be at least 1024")
    if config.inline_hash_bytes < 0:
        raise ConfigError("inline_hash_bytes: must not be negative")
    if config.home_quota_bytes < 0:
        raise ConfigError("home_quota_bytes: must not be negative")
    if config.preimage_quota_bytes < 0:
        raise ConfigError("preimage_quota_bytes: must not be negative")
    for name, count in config.warm_sandboxes.items():
        if not 0 <= count <= WARM_SANDBOXES_MAX:
            raise ConfigError(f"warm_sandboxes.{name}: must be 0 to {WARM_SANDBOXES_MAX}")
    if config.max_kept_changesets < 1:
        raise ConfigError("max_kept_changesets: must be at least 1")
    try:
        compile_policy(config.policy)
    except Refusal as exc:
        raise ConfigError(f"{path or 'flags'}: [policy]: {exc.message}") from exc
    for key in ("max_change_file_bytes", "max_changeset_bytes"):
        if getattr(config, key) < 0:
            raise ConfigError(f"{key}: must not be negative")
    if config.max_upload_bytes < 0:
        raise ConfigError("max_upload_bytes: must not be negative")
    if config.max_uploads < 1:
        raise ConfigError("max_uploads: must be at least 1")
    if config.upload_idle_s <= 0:
        raise ConfigError("upload_idle_s: must be positive")
    if config.max_connections_per_uid < 1:
        raise ConfigError("max_connections_per_uid: must be at least 1")
    if config.idle_timeout_s <= 0:
        raise ConfigError("idle_timeout_s: must be positive")
    for key in ("max_unsent_bytes", "max_unsent_bytes_per_uid"):
        if getattr(config, key) < 1:
            raise ConfigError(f"{key}: must be at least 1")
    _check_export(config.journal_export)
    if config.metrics_listen:
        try:
            parse_metrics_listen(config.metrics_listen, allow_remote=config.metrics_allow_remote)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return config


def _check_export(export: JournalExport) -> None:
    """Refuse `[journal_export]` values that cannot work, naming the key."""
    if not export.postgres_dsn:
        return
    try:
        params = conninfo.conninfo_to_dict(export.postgres_dsn)
    except psycopg.ProgrammingError:
        raise ConfigError(
            "journal_export.postgres_dsn: not a libpq DSN or URI (docs/fleet.md)"
        ) from None
    if "password" in params:
        raise ConfigError(
            "journal_export.postgres_dsn: holds a password; keep it in an operator secret"
            " (`substrate secret set NAME`) named by journal_export.password_secret"
        )
    if not 1 <= export.batch_entries <= 10000:
        raise ConfigError("journal_export.batch_entries: must be 1..10000")
    for key in ("poll_s", "max_backoff_s", "timeout_s"):
        if not getattr(export, key) > 0:
            raise ConfigError(f"journal_export.{key}: must be positive")
