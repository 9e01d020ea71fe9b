"""A private PostgreSQL server for tests: `initdb` in a temp dir, a Unix socket only.

`PostgresServer(base)` makes a cluster in `base/data` as the `postgres` user (`setpriv`
argv, never a shell string), with password authentication (scram-sha-256) for its
superuser and a random password (`password`), listening on no TCP address
(`listen_addresses=''`) and on a socket in `base/socket`. `start`/`stop` run and end
the server process directly (no `pg_ctl`, whose `-o` is a shell string); `dsn` names
the socket, never the password. `postgres_server()` is the context manager behind the
`postgres` fixture: it fails loudly under SUBSTRATE_REQUIRE_DOCKER=1 when no PostgreSQL
is installed (as a missing engine does) and skips otherwise.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

from tests.harness.waiting import wait_until

__all__ = ["PostgresServer", "find_bindir", "postgres_server"]

READY_TIMEOUT_S = 60.0


def find_bindir() -> Path | None:
    """The newest /usr/lib/postgresql/<n>/bin holding `initdb` and `postgres`, else the
    directory `initdb` on PATH resolves into; None when PostgreSQL is not installed."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: (
            int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0
        ),
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb is not None and (Path(initdb).resolve().parent / "postgres").exists():
        return Path(initdb).resolve().parent
    return None


class PostgresServer:
    """One private cluster under `base` (made by `init`)."""

    def __init__(self, base: Path, bindir: Path, *, fsync: bool = False) -> None:
        self.base = base
        self.fsync = fsync  # off for tests (a server that never outlives its test)
        self.bindir = bindir
        self.data = base / "data"
        self.socket_dir = base / "socket"
        self.log_path = base / "postgres.log"
        self.password = secrets.token_urlsafe(18)
        self.proc: subprocess.Popen[bytes] | None = None
        self._user = pwd.getpwnam("postgres")

    @property
    def dsn(self) -> str:
        """host=<socket dir> dbname=postgres user=postgres (no password)."""
        return f"host={self.socket_dir} dbname=postgres user=postgres"

    def _as_postgres(self, *argv: str) -> list[str]:
        return ["setpriv", f"--reuid={self._user.pw_uid}", f"--regid={self._user.pw_gid}",
                "--init-groups", "--", *argv]  # fmt: skip

    def init(self) -> None:
        """initdb (trust nowhere: the superuser logs in with `password`)."""
        os.chmod(self.base, 0o755)
        for d in (self.data, self.socket_dir):
            d.mkdir(mode=0o700)
            os.chown(d, self._user.pw_uid, self._user.pw_gid)
        os.chmod(self.socket_dir, 0o755)
        pwfile = self.base / "pwfile"
        pwfile.write_text(self.password + "\n")
        os.chown(pwfile, self._user.pw_uid, self._user.pw_gid)
        pwfile.chmod(0o600)
        try:
            done = subprocess.run(
                self._as_postgres(
                    str(self.bindir / "initdb"),
                    "-D", str(self.data),
                    "-U", "postgres",
                    "--auth=scram-sha-256",
                    f"--pwfile={pwfile}",
                    "--encoding=UTF8",
                    "--no-instructions",
                ),
                check=False,
                capture_output=True,
                timeout=120,
            )  # fmt: skip
        finally:
            pwfile.unlink()
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed ({done.returncode}): {done.stderr.decode()[-2000:]}")

    def start(self) -> PostgresServer:
        """Run the server and wait until it accepts connections."""
        assert self.proc is None or self.proc.poll() is not None
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it; closed below
        try:
            self.proc = subprocess.Popen(
                self._as_postgres(
                    str(self.bindir / "postgres"),
                    "-D", str(self.data),
                    "-c", "listen_addresses=",
                    "-c", f"unix_socket_directories={self.socket_dir}",
                    "-c", f"fsync={'on' if self.fsync else 'off'}",
                    "-c", "max_connections=40",
                ),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        finally:
            log.close()
        wait_until(self._accepts, READY_TIMEOUT_S)
        return self

    def _accepts(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"postgres exited {self.proc.returncode}: {self.log_tail()}")
        try:
            with psycopg.connect(self.dsn, password=self.password, connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    def stop(self) -> None:
        """Fast shutdown (SIGINT: sessions are ended, nothing is lost), and wait."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        """A connection as the superuser (autocommit unless `autocommit=False`)."""
        return psycopg.connect(self.dsn, password=self.password, **{"autocommit": True, **kwargs})

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Run one statement; its rows (none for a statement without)."""
        with self.connect() as conn:
            cur = conn.execute(sql.encode(), params)
            return list(cur.fetchall()) if cur.description else []

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A started private server, stopped and removed at the end (see the module doc)."""
    import pytest

    bindir = find_bindir()
    if bindir is None or shutil.which("setpriv") is None:
        why = "no PostgreSQL server (initdb, postgres) or no setpriv on this machine"
        if os.environ.get("SUBSTRATE_REQUIRE_DOCKER") == "1":
            pytest.fail(f"SUBSTRATE_REQUIRE_DOCKER=1 but {why}")
        pytest.skip(why)
    base = Path(tempfile.mkdtemp(prefix="sbpg-", dir="/tmp"))
    server = PostgresServer(base, bindir)
    try:
        server.init()
        yield server.start()
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
