"""Operator secrets on disk: one 0600 file per secret in a 0700 directory (docs/protocol.md §12).

Theory of operation. The operator sets a secret with `substrate secret set NAME` (the
value from stdin) as the user the daemon runs as; the command writes the file itself,
so a value never crosses a socket, a request or a log line. The daemon reads the values
a profile names (`load`) when it makes or reuses that profile's sandbox, and gives them
to each command and terminal as environment variables of its exec (never to the
container's own configuration: docs/environments.md says where a value is visible).

Layout: `<state_dir>/secrets/` (0700, owned by the daemon's user) holds `<name>` files
(0600), each replaced atomically through a same-directory temp file (`fsops.atomic_write`).
Everything is opened beneath the directory's fd with `O_NOFOLLOW`: a symlink planted at
a secret's name is refused, never followed. A name is `[A-Za-z0-9][A-Za-z0-9_-]{0,63}`;
at most `MAX_SECRETS` secrets; a value is 1..`MAX_VALUE_BYTES` bytes of UTF-8 without
NUL (an environment variable cannot hold more).

What never holds a value: refusals and their messages (names only), `names()`, the
journal, the daemon's log, `profile.get` (the profile maps variables to secret *names*).

Blocking (small file reads and writes): the daemon calls `load` from a worker thread,
`version` (lstat only) from the event loop.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

from substrate.errors import InvalidParams, LimitExceeded, PathDenied, SecretUnknown, TooLarge
from substrate.fs import fsops
from substrate.fs.state import StatePaths

#: A secret's name (its file name); no dot, so never `.`, `..` or a temp file's name.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
#: At most this many secrets are kept (`limit_exceeded` past it).
MAX_SECRETS = 256
#: Largest value, bytes (`too_large` past it).
MAX_VALUE_BYTES = 64 << 10

#: A listing reads at most this many directory entries (only the daemon's user writes there).
MAX_LISTED = 4 * MAX_SECRETS
#: What identifies the version of one secret's file: (st_ino, st_mtime_ns, st_size).
FileVersion = tuple[int, int, int]


def check_name(name: str) -> None:
    """Refuse `invalid_params` for a name outside `NAME_RE` (it is not echoed back whole)."""
    if not NAME_RE.fullmatch(name):
        raise InvalidParams(
            f"a secret's name must match {NAME_RE.pattern}", path="$.name", pattern=NAME_RE.pattern
        )


def check_value(value: bytes) -> str:
    """The value as text. Refuses `invalid_params` (empty, not UTF-8, holding NUL) and
    `too_large` (over `MAX_VALUE_BYTES`); the message never quotes the value."""
    if not value:
        raise InvalidParams("a secret's value is empty")
    if len(value) > MAX_VALUE_BYTES:
        raise TooLarge(f"a secret's value is over {MAX_VALUE_BYTES} bytes", limit=MAX_VALUE_BYTES)
    if b"\x00" in value:
        raise InvalidParams("a secret's value holds a NUL byte (an environment cannot carry it)")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidParams("a secret's value is not UTF-8 text") from None


class SecretStore:
    """The secrets of one state dir. Cheap to make: nothing is opened until used."""

    def __init__(self, state_dir: Path) -> None:
        self.directory = StatePaths(Path(state_dir)).secrets

    # -- the directory ---------------------------------------------------------------------

    def _open_dir(self, *, create: bool) -> int | None:
        """An fd of the secrets directory (None when it does not exist and not `create`).

        The state dir itself is made 0700 if missing (as the daemon does). Refuses
        `path_denied` for a secrets directory that is a symlink, not a directory, or
        owned by another user; one with looser bits is set back to 0700.
        """
        if create:
            self.directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            parent = os.open(self.directory.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            if create:
                with contextlib.suppress(FileExistsError):
                    fsops.make_dir(parent, self.directory.name, mode=0o700)
            try:
                fd = os.open(self.directory.name, fsops.DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                return None
            except OSError:
                raise PathDenied(
                    "the secrets directory is not a plain directory (a symlink is never followed)"
                ) from None
        finally:
            os.close(parent)
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            os.close(fd)
            raise PathDenied(f"the secrets directory belongs to uid {st.st_uid}, not us")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
        return fd

    # -- operator commands -------------------------------------------------------------------

    def set(self, name: str, value: bytes) -> None:
        """Create or replace secret `name` with `value` (atomically; 0600, fsynced).

        Refuses `invalid_params` (name or value), `too_large`, `limit_exceeded` (a new
        name past `MAX_SECRETS`), `path_denied` (the directory). Costs a write, two fsyncs.
        """
        check_name(name)
        check_value(value)
        fd = self._open_dir(create=True)
        assert fd is not None
        try:
            if _lstat(fd, name) is None and len(_names(fd)) >= MAX_SECRETS:
                raise LimitExceeded(f"at most {MAX_SECRETS} secrets are kept", limit=MAX_SECRETS)
            fsops.atomic_write(fd, name, value, mode=0o600)
        finally:
            os.close(fd)

    def remove(self, name: str) -> None:
        """Remove secret `name`. Refuses `invalid_params`, `secret_unknown` (not set)."""
        check_name(name)
        fd = self._open_dir(create=False)
        if fd is None:
            raise SecretUnknown(f"no secret {name!r} is set", secrets=[name])
        try:
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                raise SecretUnknown(f"no secret {name!r} is set", secrets=[name]) from None
            os.fsync(fd)
        finally:
            os.close(fd)

    def names(self) -> list[str]:
        """The names of the secrets set, sorted (never a value). Costs one listing."""
        fd = self._open_dir(create=False)
        if fd is None:
            return []
        try:
            return _names(fd)
        finally:
            os.close(fd)

    # -- the daemon ----------------------------------------------------------------------------

    def load(self, names: Iterable[str]) -> dict[str, str]:
        """name → value of each of `names`. Refuses `secret_unknown` listing every missing
        one (or one that is not a regular file: never followed), `too_large`,
        `invalid_params` (a value gone bad on disk). Costs one open and read per name."""
        wanted = sorted(set(names))
        if not wanted:
            return {}
        fd = self._open_dir(create=False)
        if fd is None:
            raise _unknown(wanted)
        found: dict[str, str] = {}
        missing: list[str] = []
        try:
            for name in wanted:
                check_name(name)
                st = _lstat(fd, name)
                if st is None or not stat.S_ISREG(st.st_mode):
                    missing.append(name)
                    continue
                _, data = fsops.read_regular(fd, name, MAX_VALUE_BYTES, f"secret {name!r}")
                found[name] = check_value(data)
        finally:
            os.close(fd)
        if missing:
            raise _unknown(missing)
        return found

    def version(self, names: Iterable[str]) -> tuple[FileVersion | None, ...]:
        """What identifies the current files of `names` (sorted; None for a missing one):
        a value set or removed since changes it. One lstat per name, by path (the
        state dir is the daemon's own), no open: cheap enough for the event loop."""
        out: list[FileVersion | None] = []
        for name in sorted(set(names)):
            try:
                st = os.lstat(self.directory / name)
            except OSError:
                out.append(None)
                continue
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(out)


def _unknown(missing: list[str]) -> SecretUnknown:
    listed = ", ".join(repr(n) for n in missing[:8])
    return SecretUnknown(
        f"secret(s) not set: {listed} (`substrate secret set NAME` as the daemon's user)",
        secrets=missing,
    )


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _names(dir_fd: int) -> list[str]:
    found: list[str] = []
    with os.scandir(dir_fd) as it:
        for seen, entry in enumerate(it):
            if seen >= MAX_LISTED:
                raise LimitExceeded(
                    f"the secrets directory holds more than {MAX_LISTED} entries",
                    limit=MAX_LISTED,
                )
            if NAME_RE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                found.append(entry.name)
    return sorted(found)
