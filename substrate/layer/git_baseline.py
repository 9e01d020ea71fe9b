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


def save(layer_dir: str, baseline: Baseline) -> None:
    """Replace the baseline, atomically and durably."""
    fd = os.open(layer_dir, fsops.DIR_FLAGS)
    try:
        fsops.atomic_write(fd, BASELINE, _encoder.encode(baseline), mode=0o600)
    finally:
        os.close(fd)
