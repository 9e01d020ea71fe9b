"""The kernel's mount table: `/proc/<pid>/mountinfo` parsed (pure, no I/O).

The working layer checks its own host mounts with it (`overlay.read_mounts`,
`plan.verify`); the sandbox reads a container's table with it too
(`substrate.sandbox.observe`, `substrate.sandbox.parsers`' mount facts). Each parser
takes the text as the kernel writes it and raises ValueError on a malformed line;
tested in tests/sandbox/test_parsers.py with texts from real hosts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

_OCTAL_RE = re.compile(r"\\([0-7]{3})")


class Mount(msgspec.Struct, frozen=True, kw_only=True):
    """One /proc/<pid>/mountinfo line, octal escapes decoded."""

    mount_id: int
    parent_id: int
    root: str  # the path inside the source filesystem that is mounted
    mount_point: str  # relative to the reading process's root
    options: tuple[str, ...]  # per-mount options ("ro", "nosuid", …)
    fstype: str
    source: str
    super_options: tuple[str, ...]  # per-superblock options ("size=65536k", …)

    @property
    def read_only(self) -> bool:
        return "ro" in self.options or "ro" in self.super_options


def unescape_mount(field: str) -> str:
    r"""Decode mountinfo's octal escapes (\040 space, \011 tab, \012 newline, \134 \)."""
    return _OCTAL_RE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a /proc/<pid>/mountinfo text, in order (later ones are on top).

    Raises ValueError on a malformed line.
    """
    out = []
    for line in text.splitlines():
        if not line:
            continue
        parts = line.split(" ")
        try:
            sep = parts.index("-", 6)
        except ValueError:
            raise ValueError(f"mountinfo line without separator: {line[:80]!r}") from None
        if len(parts) < sep + 3 or sep < 6:
            raise ValueError(f"short mountinfo line: {line[:80]!r}")
        out.append(
            Mount(
                mount_id=int(parts[0]),
                parent_id=int(parts[1]),
                root=unescape_mount(parts[3]),
                mount_point=unescape_mount(parts[4]),
                options=tuple(parts[5].split(",")),
                fstype=parts[sep + 1],
                source=unescape_mount(parts[sep + 2]),
                super_options=tuple(parts[sep + 3].split(",")) if len(parts) > sep + 3 else (),
            )
        )
    return out


def visible_mounts(mounts: Sequence[Mount]) -> list[Mount]:
    """The mounts a path lookup can reach, in order, by the mount tree (not list order).

    A mount is hidden when another is mounted on the same point on top of it (its child
    there), or when a mount it hangs from is hidden, except for the base of a stack: the
    new mount on a point hangs from the one it covers.
    """
    by_id = {m.mount_id: m for m in mounts}
    covered = {
        m.parent_id
        for m in mounts
        if m.parent_id in by_id and by_id[m.parent_id].mount_point == m.mount_point
    }

    def reachable(m: Mount) -> bool:
        seen: set[int] = set()
        while m.parent_id in by_id and m.mount_id not in seen:
            seen.add(m.mount_id)
            parent = by_id[m.parent_id]
            if parent.mount_point != m.mount_point and parent.mount_id in covered:
                return False
            m = parent
        return True

    return [m for m in mounts if m.mount_id not in covered and reachable(m)]
