"""A git layer's baseline: its sandbox's refs at the last conclusion, and its last import.

The refs the sandbox's view showed at the last conclusion, and when that conclusion
imported its objects (docs/working-layer.md, "The git layer").

Written when the git layer is made (`mounts.git_layer`: the checkout's refs then) and
after each conclusion (`changes.git_refs`), read by the next: a ref the sandbox moved
since is one whose view differs from it, and an object file made since (ctime) is one
to import. One msgpack file `baseline` in the git layer's directory, replaced
atomically. Blocking: callers use worker threads.
"""

from __future__ import annotations

import os
import stat
import time

import msgspec

from substrate.fs import fsops

#: The baseline holds at most this many refs (every `read_refs` of a git layer too).
MAX_REFS = 100_000
#: Its file in the git layer's directory.
BASELINE = "baseline"
#: Largest baseline read (a ref name and id are well under 1 KiB each).
MAX_BASELINE_BYTES = 64 << 20


class Baseline(msgspec.Struct, frozen=True, kw_only=True):
    """The refs the sandbox's view showed, and the time (ns) objects were imported up to."""

    refs: dict[str, str] = msgspec.field(default_factory=dict)
    imported_ns: int = 0
    #: When the last conclusion began (`stamp`): what the sandbox wrote since is its
    #: evidence (`changes.git_evidence`).
    concluded_ns: int = 0


class Settled(msgspec.Struct, frozen=True, kw_only=True):
    """What a git conclusion left (in memory, per sandbox's layer): the baseline's times
    and what the upper dir held then, with the checkout watch's change count when it
    began. The next conclusion needs nothing more when nothing moved since
    (`changes.git_quiet`)."""

    seen: int  # `LowerWatch.seen` when that conclusion began
    concluded_ns: int
    imported_ns: int
    refs: bool  # the upper dir held `refs` then
    packed: bool  # and `packed-refs`


_decoder = msgspec.msgpack.Decoder(Baseline)
_encoder = msgspec.msgpack.Encoder()


def exists(layer_dir: str) -> bool:
    """Is there a baseline in `layer_dir` (a regular file, no symlink followed)?"""
    try:
        return stat.S_ISREG(os.lstat(f"{layer_dir}/{BASELINE}").st_mode)
    except FileNotFoundError:
        return False


def load(layer_dir: str) -> Baseline:
    """The baseline (empty when it is missing or unreadable: every object is then
    imported again, and a ref the sandbox moved reads as made)."""
    try:
        fd = os.open(f"{layer_dir}/{BASELINE}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return Baseline()
    try:
        data = fsops.read_fd(fd, MAX_BASELINE_BYTES)
    finally:
        os.close(fd)
    if data is None:
        return Baseline()
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError:
        return Baseline()


def save(layer_dir: str, baseline: Baseline, *, durable: bool = True) -> None:
    """Replace the baseline atomically; with `durable`, fsynced (without: a crash may
    lose it, and an older or empty baseline only makes more refs look moved, each
    still checked against the checkout by its compare-and-swap)."""
    fd = os.open(layer_dir, fsops.DIR_FLAGS)
    try:
        fsops.atomic_write(fd, BASELINE, _encoder.encode(baseline), mode=0o600, fsync=durable)
    finally:
        os.close(fd)


#: The file whose ctime `stamp` takes, in the git layer's directory.
STAMP = "stamp"


#: `mark` waits at most this long for the file-system clock to tick (it ticks every
#: 1-10 ms: one jiffy).
MAX_MARK_WAIT_S = 0.1


def mark(layer_dir: str) -> int:
    """A file-system time (ns) after every file written so far and at or before every
    file written from now on: `stamp`s until the clock ticked past the first one. Files
    are stamped by the kernel's coarse clock, so without the wait a file written in the
    same tick before the mark would count as written after it (a ref move reported
    twice; an object staged again), and with a strict comparison one written in the
    same tick after it would be missed. Costs up to one tick (1-10 ms)."""
    first = stamp(layer_dir)
    deadline = time.monotonic() + MAX_MARK_WAIT_S
    now = first
    while now <= first and time.monotonic() < deadline:
        time.sleep(0.0005)
        now = stamp(layer_dir)
    return now


def stamp(layer_dir: str) -> int:
    """The file-system clock now (ns): the ctime `stamp` gets when touched (the clock
    the upper dir's files are stamped by)."""
    fd = os.open(
        f"{layer_dir}/{STAMP}", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    try:
        os.utime(fd)
        return os.fstat(fd).st_ctime_ns
    finally:
        os.close(fd)
