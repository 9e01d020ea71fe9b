"""The quota of each persistent home: `home_quota_bytes` (docs/environments.md "Quota").

Theory of operation. Nothing in the kernel bounds a home (it is a directory of the state
dir's filesystem: ext4 project quotas are not enabled there, and a loop-mounted image
per home would need a mkfs, a loop device and a mount per home, kept across restarts).
So the bound is checked, not enforced: before each command or terminal starts in a
sandbox, `HomeQuota.check` looks at that home's usage (`Homes.usage`: the bounded walk
from held fds) and refuses `limit_exceeded` (`data.scope = "home"`) while it is over.
A command may pass the quota while it runs; the next one is refused, until the home
shrinks (the operator removes files, or releases with `keep_home: false`) or the quota
is raised.

What it costs. A walk is one lstat per entry (about 7 µs here). It is redone before a
command only when a command was handed that home since the last walk, or the last one
found it over; a walk that took longer than `CHEAP_WALK_S` is redone at most once per
`AMORTISE` times its own duration, so measuring costs at most about a tenth of the time
between commands (a venv of 6,000 entries: about 40 ms, redone at most every 0.4 s). A
walk that stops at its bounds (`truncated`: more than `homes.MAX_USAGE_ENTRIES` entries)
cannot show the home is within its quota: it counts as over.

A home the last walk found small (at most `INLINE_FILES` files, walked in under
`INLINE_WALK_S`) is walked again on the event loop (`check_here`), bounded to
`INLINE_ENTRIES` entries: one that grew past that bound since is no answer, and the
caller walks it whole in a worker thread. So a quiet home costs a command no thread hop,
and no agent can make the event loop walk more than `INLINE_ENTRIES` entries.

Blocking (the walk): callers use worker threads, but for `check_here`. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from substrate.errors import LimitExceeded
from substrate.schema.workspace import HomeUsage

#: A walk cheaper than this is redone before every command that follows another.
CHEAP_WALK_S = 0.005
#: A dearer one is redone once this many times its duration has passed since it ended.
AMORTISE = 10.0
#: Homes whose last measurement is remembered; past it the oldest is forgotten (and
#: measured again when next used).
MAX_REMEMBERED = 4096
#: A home last seen with at most this many files, walked in under `INLINE_WALK_S`, is
#: walked again on the event loop (`check_here`), at most `INLINE_ENTRIES` entries.
INLINE_FILES = 64
INLINE_WALK_S = 0.0005
INLINE_ENTRIES = 256


class Measure(Protocol):
    """A home's usage (`Homes.usage`): `truncated` past `max_entries` entries."""

    def __call__(self, checkout: str, home: str, *, max_entries: int = ...) -> HomeUsage | None: ...


@dataclass
class _Seen:
    usage: HomeUsage
    measured_at: float  # monotonic, when the walk ended
    cost: float  # seconds the walk took
    handed: bool = False  # a command was handed the home since


class HomeQuota:
    """The last measurement of each home, and the check before each command."""

    def __init__(
        self, measure: Measure, quota_bytes: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._measure = measure
        self.quota_bytes = quota_bytes  # 0: no bound
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], _Seen] = {}

    def due(self, checkout: str, home: str) -> bool:
        """Would `check` walk the home now? (A dict lookup: `check` is then cheap enough
        for the event loop when this says no.)"""
        if self.quota_bytes <= 0:
            return False
        with self._lock:
            seen = self._seen.get((checkout, home))
            return seen is None or self._due(seen)

    def check(self, checkout: str, home: str, *, walk: bool = True) -> None:
        """Before a command in home `home` of `checkout`: refuse `limit_exceeded`
        (`scope: "home"`, with `bytes`, `files`, `quota_bytes`, `truncated`) while the
        home is over the quota, else count the command as one that may change it. Costs
        a walk when one is due (see the module) and `walk` allows it (False: the last
        figure stands, for the event loop after `due` said no), else a dict lookup."""
        if self.quota_bytes <= 0:
            return
        key = (checkout, home)
        with self._lock:
            seen = self._seen.get(key)
            due = seen is None or (walk and self._due(seen))
        if due:
            started = self._clock()
            usage = self._measure(checkout, home) or HomeUsage(bytes=0, files=0)
            seen = self._remember(key, usage, started)
        assert seen is not None
        self._decide(seen)

    def check_here(self, checkout: str, home: str) -> bool:
        """`check`, on the event loop, when that costs at most a small walk (see the
        module): True once decided (refusing as `check` does); False when a walk is due
        that may be larger than `INLINE_ENTRIES` entries: the caller then runs `check`
        in a worker thread."""
        if self.quota_bytes <= 0:
            return True
        key = (checkout, home)
        with self._lock:
            seen = self._seen.get(key)
            due = seen is None or self._due(seen)
        if seen is None or (due and not _small(seen)):
            return False
        if due:
            started = self._clock()
            usage = self._measure(checkout, home, max_entries=INLINE_ENTRIES)
            if usage is not None and usage.truncated:
                return False  # grown past the bound (or too deep): the whole walk decides
            seen = self._remember(key, usage or HomeUsage(bytes=0, files=0), started)
        self._decide(seen)
        return True

    def _remember(self, key: tuple[str, str], usage: HomeUsage, started: float) -> _Seen:
        ended = self._clock()
        seen = _Seen(usage=usage, measured_at=ended, cost=ended - started)
        with self._lock:
            self._seen.pop(key, None)
            self._seen[key] = seen
            while len(self._seen) > MAX_REMEMBERED:
                del self._seen[next(iter(self._seen))]
        return seen

    def _decide(self, seen: _Seen) -> None:
        if self._over(seen.usage):
            raise LimitExceeded(
                f"the workspace's home holds {seen.usage.bytes} bytes in {seen.usage.files}"
                f" files{' or more' if seen.usage.truncated else ''}, over its quota of"
                f" {self.quota_bytes} bytes (home_quota_bytes): make room in it, or release"
                " the workspace with keep_home: false",
                scope="home",
                bytes=seen.usage.bytes,
                files=seen.usage.files,
                quota_bytes=self.quota_bytes,
                truncated=seen.usage.truncated,
            )
        seen.handed = True

    def _over(self, usage: HomeUsage) -> bool:
        return usage.truncated or usage.bytes > self.quota_bytes

    def _due(self, seen: _Seen) -> bool:
        if self._over(seen.usage):
            return True  # refused until a walk finds room: always looked at again
        if not seen.handed:
            return False
        if seen.cost < CHEAP_WALK_S:
            return True
        return self._clock() - seen.measured_at >= AMORTISE * seen.cost


def _small(seen: _Seen) -> bool:
    """Was the home small when last walked (walked again on the event loop)?"""
    usage = seen.usage
    return not usage.truncated and usage.files <= INLINE_FILES and seen.cost < INLINE_WALK_S
