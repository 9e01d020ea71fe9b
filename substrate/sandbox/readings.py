"""Bounded reads of kernel files, and how a reading becomes `Fact`s: shared by the
observers (`substrate.sandbox.observe`, `substrate.sandbox.observe_gvisor`).

Every read is of at most `MAX_READ` bytes (procfs and cgroup files of a container are a
few KiB); a failed read becomes facts with value None and the reason in their `source`
(`failed`), which never meets a required fact.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Mapping, Sequence

from substrate.sandbox.facts import Fact, FactValue

log = logging.getLogger("substrate.sandbox.observe")

#: Largest procfs/cgroup file read (mountinfo of a container is a few KiB).
MAX_READ = 1 << 20


def read_at(dir_fd: int, name: str) -> str:
    """The text of `name` relative to `dir_fd` (a `/proc/<pid>` fd). Raises OSError."""
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


def read_path(path: str) -> str:
    """The text of the file at `path`. Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


def _read_fd(fd: int) -> str:
    chunks = []
    total = 0
    while total <= MAX_READ:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks).decode("utf-8", "surrogateescape")


def why(exc: BaseException) -> str:
    """A failed read's reason for a fact's `source`: the errno name, else the type."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return type(exc).__name__


def facts(names_values: Mapping[str, FactValue], source: str) -> list[Fact]:
    """One `Fact` per name, read now from `source`."""
    now = time.time()
    return [Fact(name=n, value=v, source=source, observed_at=now) for n, v in names_values.items()]


def failed(names: Sequence[str], source: str, exc: BaseException) -> list[Fact]:
    """`names` as unobserved (value None), the reason in the source; logged."""
    log.warning("cannot observe %s from %s: %s", ", ".join(names), source, exc)
    return facts(dict.fromkeys(names), f"{source} ({why(exc)})")
